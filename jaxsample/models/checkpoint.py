"""Saving and loading ``Transformer`` weights (safetensors) and tokenizers.

A model directory holds ``config.json`` (the ``TransformerConfig`` fields),
``model.safetensors`` (parameters named by their NNX path, e.g.
``blocks.0.attention.query.kernel``) and ``tokenizer.json`` (a Hugging Face
``tokenizers`` file).  ``load_embedded`` opens the directory shipped in the
package: a model trained on Shakespeare by ``scripts/train_model.py``
(``docs/model.md``).

safetensors and tokenizers come with the ``models`` extra and are imported
when a function here needs them, so ``jaxsample.models`` (and the
``Transformer``) import without them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsample.models.transformer import (Transformer, TransformerConfig,
                                          fill_params, param_name)

if TYPE_CHECKING:
  import tokenizers

__all__ = ["DRAFT_DIR", "EMBEDDED_DIR", "load_draft", "load_embedded",
           "load_model", "load_tokenizer", "save_model"]

EMBEDDED_DIR = pathlib.Path(__file__).parent / "data" / "shakespeare"
# A smaller model trained on the same corpus with the embedded tokenizer
# (``scripts/train_model.py --tokenizer``): the draft model of speculative
# decoding.  Its ``training.json`` has the command and held-out loss.
DRAFT_DIR = pathlib.Path(__file__).parent / "data" / "shakespeare-draft"


MODELS_EXTRA_HINT = ("the embedded model (jaxsample.models checkpoints and "
                     "tokenizers) needs safetensors and tokenizers: "
                     'pip install "jaxsample[models]"')


def _models_extra(module: str):
  """Imports ``module`` (safetensors.numpy or tokenizers) of the ``models``
  extra; an ``ImportError`` naming the extra if it is not installed."""
  try:
    return importlib.import_module(module)
  except ImportError as err:
    raise ImportError(f"{MODELS_EXTRA_HINT} ({err})") from err


def save_model(model: Transformer, directory, *, dtype=None) -> None:
  """Writes ``config.json`` and ``model.safetensors`` (weights cast to ``dtype``)."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  config = dataclasses.asdict(model.config)
  if dtype is not None:
    config["dtype"] = jnp.dtype(dtype).name
  if config["dtype"] not in ("float32", "float16"):
    raise ValueError(f"save_model: dtype must be float32 or float16 "
                     f"(safetensors.numpy has no bfloat16); got {config['dtype']}")
  (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  tensors = {param_name(path): np.asarray(value, dtype=config["dtype"])
             for path, value in flat}
  _models_extra("safetensors.numpy").save_file(
      tensors, str(directory / "model.safetensors"))


def load_model(directory=EMBEDDED_DIR, *, dtype: str | None = None) -> Transformer:
  """Builds a ``Transformer`` from a model directory (optionally recast)."""
  directory = pathlib.Path(directory)
  fields = json.loads((directory / "config.json").read_text())
  if dtype is not None:
    fields["dtype"] = jnp.dtype(dtype).name
  config = TransformerConfig(**fields)
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  tensors = _models_extra("safetensors.numpy").load_file(
      str(directory / "model.safetensors"))
  names = [param_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(
      nnx.state(model, nnx.Param))[0]]
  missing = sorted(set(names) - set(tensors))
  extra = sorted(set(tensors) - set(names))
  if missing or extra:
    raise ValueError(f"{directory}/model.safetensors does not match "
                     f"config.json: missing {missing[:5]}, unexpected {extra[:5]}")

  def load(name, shape):
    if tensors[name].shape != shape.shape:
      raise ValueError(f"{name}: stored shape {tensors[name].shape}, "
                       f"config wants {shape.shape}")
    return jnp.asarray(tensors[name], config.dtype)

  fill_params(model, load)
  return model


def load_tokenizer(directory=EMBEDDED_DIR) -> tokenizers.Tokenizer:
  """The ``tokenizers.Tokenizer`` saved as ``tokenizer.json`` in ``directory``."""
  return _models_extra("tokenizers").Tokenizer.from_file(
      str(pathlib.Path(directory) / "tokenizer.json"))


def load_embedded(*, dtype: str | None = None
                  ) -> tuple[Transformer, tokenizers.Tokenizer]:
  """The packaged Shakespeare model and its tokenizer."""
  return load_model(EMBEDDED_DIR, dtype=dtype), load_tokenizer(EMBEDDED_DIR)


def load_draft(*, dtype: str | None = None) -> Transformer:
  """The packaged draft model (it shares the embedded model's tokenizer)."""
  return load_model(DRAFT_DIR, dtype=dtype)
