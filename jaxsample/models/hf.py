"""Llama 3.x and Qwen2/Qwen2.5 checkpoints from a Hugging Face folder.

``load_pretrained(path)`` reads ``config.json`` and the safetensors weights
(``model.safetensors``, or the shards named by
``model.safetensors.index.json``) one tensor at a time with
``safetensors.safe_open`` and returns a ``Transformer`` that ``generate`` and
``ServeLoop`` accept.  Supported ``architectures``:

* ``LlamaForCausalLM``: RoPE plain or with ``rope_scaling`` of type
  ``llama3`` (Llama 3.1+), tied or untied head, no biases;
* ``Qwen2ForCausalLM``: biases on the query/key/value projections, tied or
  untied head, no sliding window.

Hugging Face's ``nn.Linear`` weights are ``[out, in]``; NNX kernels are
``[in, out]``, so projection weights are transposed on load.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsample.models import sharding
from jaxsample.models.transformer import (Transformer, TransformerConfig,
                                          fill_params, param_name)

__all__ = ["ARCHITECTURES", "DEFAULT_MAX_LEN", "hf_names", "load_pretrained",
           "read_config", "require"]

ARCHITECTURES = {"LlamaForCausalLM": False, "Qwen2ForCausalLM": True}
"""Supported ``architectures`` -> whether the q/k/v projections have biases."""
DEFAULT_MAX_LEN = 4096
"""The default cache length: ``min(max_position_embeddings, 4096)``."""
DTYPES = ("float32", "bfloat16", "float16")
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "vocab_size")


def require(module: str):
  """Imports ``module`` or raises ImportError naming the extra to install."""
  try:
    return importlib.import_module(module)
  except ImportError as error:
    raise ImportError(f"{module} is needed to read Hugging Face folders: "
                      'pip install "jaxsample[models]"') from error


def _rope(fields: dict, path) -> tuple[float, tuple | None]:
  """``(rope_theta, llama3 scaling or None)`` from the older ``rope_theta``
  + ``rope_scaling`` fields or the newer ``rope_parameters``."""
  params = fields.get("rope_parameters") or {}
  scaling = fields.get("rope_scaling") or params
  theta = float(fields.get("rope_theta", params.get("rope_theta", 10000.0)))
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise ValueError(f"{path}/config.json: rope type {kind!r} is not "
                     "supported (only 'default' and 'llama3')")
  names = ("factor", "low_freq_factor", "high_freq_factor",
           "original_max_position_embeddings")
  missing = [n for n in names if n not in scaling]
  if missing:
    raise ValueError(f"{path}/config.json: llama3 rope scaling lacks "
                     f"{missing}")
  return theta, tuple(float(scaling[n]) for n in names)


def read_config(path, *, dtype: str | None = None,
                max_len: int | None = None) -> TransformerConfig:
  """The ``TransformerConfig`` of the Hugging Face folder ``path``.

  ``dtype``: the weights' and activations' dtype (``float32``, ``bfloat16``
  or ``float16``); default the checkpoint's ``torch_dtype`` (``dtype`` in
  newer files), else float32.  ``max_len``: the default cache length
  (default ``min(max_position_embeddings, DEFAULT_MAX_LEN)``).

  Raises:
    FileNotFoundError: without ``config.json``.
    ValueError: naming the field, for an unsupported architecture or
      setting (sliding window, another rope type, attention or MLP biases
      on Llama, a head_dim other than hidden_size / heads) or a missing
      field.
  """
  path = pathlib.Path(path)
  file = path / "config.json"
  if not file.is_file():
    raise FileNotFoundError(f"{file} is missing: load_pretrained needs a "
                            "Hugging Face model folder with config.json")
  fields = json.loads(file.read_text())
  arch = (fields.get("architectures") or [None])[0]
  if arch not in ARCHITECTURES:
    raise ValueError(f"{file}: architectures {fields.get('architectures')} "
                     f"is not supported; supported: {list(ARCHITECTURES)}")
  missing = [n for n in _REQUIRED if n not in fields]
  if missing:
    raise ValueError(f"{file} lacks the fields {missing}")
  unsupported = [n for n in ("attention_bias", "mlp_bias", "use_sliding_window")
                 if fields.get(n)]
  if unsupported:
    raise ValueError(f"{file}: {unsupported} set to true is not supported")
  heads = fields["num_attention_heads"]
  head_dim = fields.get("head_dim")
  if head_dim is not None and head_dim * heads != fields["hidden_size"]:
    raise ValueError(f"{file}: head_dim {head_dim} != hidden_size / "
                     f"num_attention_heads is not supported")
  dtype = dtype or fields.get("torch_dtype") or fields.get("dtype") or "float32"
  dtype = jnp.dtype(dtype).name
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}; got {dtype!r}")
  theta, scaling = _rope(fields, path)
  limit = fields.get("max_position_embeddings", DEFAULT_MAX_LEN)
  return TransformerConfig(
      vocab_size=fields["vocab_size"], d_model=fields["hidden_size"],
      num_layers=fields["num_hidden_layers"], num_heads=heads,
      num_kv_heads=fields.get("num_key_value_heads") or heads,
      mlp_dim=fields["intermediate_size"],
      max_len=max_len or min(limit, DEFAULT_MAX_LEN), rope_base=theta,
      norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
      dtype=dtype, qkv_bias=ARCHITECTURES[arch], rope_scaling=scaling)


_LAYER = {"attention_norm.scale": "input_layernorm.weight",
          "mlp_norm.scale": "post_attention_layernorm.weight",
          "attention.query": "self_attn.q_proj", "attention.key": "self_attn.k_proj",
          "attention.value": "self_attn.v_proj", "attention.out": "self_attn.o_proj",
          "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
          "mlp.down": "mlp.down_proj"}


def hf_names(name: str) -> tuple[str, bool]:
  """``(Hugging Face tensor name, transpose)`` of the NNX parameter ``name``
  (e.g. ``blocks.3.attention.query.kernel`` ->
  ``(model.layers.3.self_attn.q_proj.weight, True)``)."""
  fixed = {"embed.embedding": ("model.embed_tokens.weight", False),
           "final_norm.scale": ("model.norm.weight", False),
           "head.kernel": ("lm_head.weight", True)}
  if name in fixed:
    return fixed[name]
  _, layer, rest = name.split(".", 2)
  module, leaf = rest.rsplit(".", 1)
  if rest in _LAYER:  # the norms
    return f"model.layers.{layer}.{_LAYER[rest]}", False
  hf_leaf = {"kernel": "weight", "bias": "bias"}[leaf]
  return f"model.layers.{layer}.{_LAYER[module]}.{hf_leaf}", leaf == "kernel"


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
  """Tensor name -> the safetensors file holding it."""
  index = path / "model.safetensors.index.json"
  if index.is_file():
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index} has no weight_map")
    files = {name: path / file for name, file in weight_map.items()}
    absent = sorted({str(f) for f in files.values() if not f.is_file()})
    if absent:
      raise FileNotFoundError(f"{index} names missing shards: {absent}")
    return files
  single = path / "model.safetensors"
  if not single.is_file():
    raise FileNotFoundError(
        f"{path} has neither model.safetensors nor "
        "model.safetensors.index.json (only safetensors weights are read)")
  safetensors = require("safetensors")
  with safetensors.safe_open(str(single), framework="numpy") as f:
    return {name: single for name in f.keys()}


def load_pretrained(path, *, dtype: str | None = None,
                    mesh: jax.sharding.Mesh | None = None,
                    max_len: int | None = None) -> Transformer:
  """A Llama 3.x or Qwen2/Qwen2.5 ``Transformer`` from a Hugging Face folder.

  Args:
    path: a local folder with ``config.json`` and safetensors weights.
    dtype: parameters and activations (``float32``, ``bfloat16``,
      ``float16``); default the checkpoint's ``torch_dtype``.  Logits are
      fp32.
    mesh: None (the default device), or a ``jax.sharding.Mesh`` with axes
      ``"model"`` (tensor parallel) and/or ``"data"`` (the batch): each
      tensor is placed with ``sharding.param_spec`` as it is read.
    max_len: the default cache length of ``generate`` / ``ServeLoop``
      (default ``min(max_position_embeddings, 4096)``).

  Raises:
    ImportError: without ``safetensors`` (the ``models`` extra).
    FileNotFoundError: naming the missing file (config, weights, shards).
    ValueError: for an unsupported config (``read_config``), a missing
      tensor (named), an unexpected tensor, or a tensor of the wrong shape.
  """
  safetensors = require("safetensors")
  path = pathlib.Path(path)
  config = read_config(path, dtype=dtype, max_len=max_len)
  files = _weight_files(path)
  model = nnx.eval_shape(
      lambda: Transformer(config, rngs=nnx.Rngs(0), mesh=mesh))
  wanted = {hf_names(name)[0]: name for name in _param_names(model)}
  missing = sorted(set(wanted) - set(files))
  if missing:
    raise ValueError(f"{path}: the checkpoint lacks the tensors {missing[:8]}"
                     f"{' ...' if len(missing) > 8 else ''} ({len(missing)})")
  ignored = {"lm_head.weight"} if config.tie_embeddings else set()
  extra = sorted(n for n in set(files) - set(wanted) - ignored
                 if not n.endswith("rotary_emb.inv_freq"))
  if extra:
    raise ValueError(f"{path}: unexpected tensors {extra[:8]} for "
                     f"{config}")
  with contextlib.ExitStack() as stack:
    handles = {}

    def load(name, shape):
      name = _module_path(name)
      hf_name, transpose = hf_names(name)
      file = files[hf_name]
      if file not in handles:
        handles[file] = stack.enter_context(
            safetensors.safe_open(str(file), framework="numpy"))
      array = handles[file].get_tensor(hf_name)
      if (array.shape[::-1] if transpose else array.shape) != shape.shape:
        raise ValueError(f"{hf_name} in {file.name}: shape {array.shape} "
                         f"(transposed: {transpose}), the config wants "
                         f"{shape.shape}")
      value = jnp.asarray(array, config.dtype)
      if transpose:  # on the device: a host transpose of 8B weights is slow
        value = _transpose(value)
      if mesh is None:
        return value
      spec = sharding.param_spec(name, value.ndim, config, mesh)
      return jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))

    return fill_params(model, load)


_transpose = jax.jit(jnp.transpose)


def _param_names(model) -> list[str]:
  flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  return [_module_path(param_name(path)) for path, _ in flat]


def _module_path(name: str) -> str:
  """``blocks.0.mlp.up.kernel`` of ``param_name``'s ``...kernel..value``."""
  return name.removesuffix("..value")
