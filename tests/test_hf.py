"""``load_pretrained`` against a float64 NumPy forward of Llama / Qwen2
(``tests/helpers/hf_folders.py``) on tiny random Hugging Face folders: the name
mapping, RoPE (llama3 scaling), GQA, biases, tied and untied heads, prefill
and decode through the KV cache, greedy generation, bf16, sharded files and
the errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample as js
from jaxsample import serve_loop
from jaxsample.models import load_pretrained
from jaxsample.models.hf import hf_names, read_config

from helpers.hf_folders import (LLAMA, QWEN2, check_close, hf_weights,
                                prefill_and_decode, reference_greedy, reference_logits,
                                write_folder)

PROMPTS = [[3, 17, 5, 60, 2], [9, 1, 44, 7, 7, 30, 12, 8, 50, 4, 19], [33, 6]]
CACHE = 64
FP32_TOL = 1e-5
"""fp32 logits: ``|jax - ref| <= FP32_TOL * max(1, max |ref|)`` (measured:
3.8e-7 for Llama, 2.4e-7 for Qwen2)."""
BF16_TOL = 2e-2
"""bf16 weights and activations: the same bound with 2e-2 (bf16 keeps 8
significant bits; measured 6.1e-3 for Qwen2)."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """name -> (config dict, stored float64 weights, folder)."""
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for name, config, dtype, shards in (
      ("llama", LLAMA, "float32", 1), ("qwen2", QWEN2, "float32", 3),
      ("llama-bf16", LLAMA, "bfloat16", 2), ("qwen2-bf16", QWEN2, "bfloat16", 1)):
    stored = write_folder(root / name, config, hf_weights(config, seed=len(out)),
                          dtype=dtype, shards=shards)
    out[name] = (config, stored, root / name)
  return out


@pytest.mark.parametrize("name,dtype,tol", [
    ("llama", None, FP32_TOL), ("qwen2", None, FP32_TOL),
    ("llama-bf16", "float32", FP32_TOL), ("qwen2-bf16", None, BF16_TOL)])
def test_logits_match_reference(folders, name, dtype, tol):
  config, weights, path = folders[name]
  model = load_pretrained(path, dtype=dtype)
  assert model.config.dtype == (dtype or json.loads(
      (path / "config.json").read_text())["torch_dtype"])
  rng = np.random.default_rng(7)
  continuations = rng.integers(0, config["vocab_size"], (len(PROMPTS), 5),
                               dtype=np.int32)
  prefill, decode = prefill_and_decode(model, PROMPTS, continuations, CACHE)
  for b, prompt in enumerate(PROMPTS):
    ref = reference_logits(config, weights, prompt + list(continuations[b]))
    n = len(prompt)
    check_close(prefill[b, :n], ref[:n], tol, f"{name} prefill row {b}")
    check_close(decode[b], ref[n:], tol, f"{name} decode row {b}")


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_tokens_match_reference(folders, name):
  config, weights, path = folders[name]
  model = load_pretrained(path)
  out = serve_loop.generate(
      model, PROMPTS, params=js.SamplingParams.make(len(PROMPTS), temperature=0.0),
      keys=jax.random.split(jax.random.key(0), len(PROMPTS)),
      max_new_tokens=12, cache_len=CACHE)
  for b, prompt in enumerate(PROMPTS):
    assert out.tokens[b, :12].tolist() == reference_greedy(config, weights, prompt, 12)


def test_config_mapping(folders):
  config = read_config(folders["llama"][2])
  assert (config.vocab_size, config.d_model, config.num_heads,
          config.num_kv_heads, config.mlp_dim, config.rope_base) == (
              96, 32, 4, 2, 64, 10000.0)
  assert config.rope_scaling == (8.0, 1.0, 4.0, 64.0)
  assert not config.tie_embeddings and not config.qkv_bias
  assert config.max_len == 128 and config.norm_eps == 1e-5
  qwen = read_config(folders["qwen2"][2], max_len=32)
  assert qwen.qkv_bias and qwen.tie_embeddings and qwen.rope_scaling is None
  assert qwen.max_len == 32
  assert hf_names("blocks.1.attention.key.bias") == (
      "model.layers.1.self_attn.k_proj.bias", False)
  assert hf_names("blocks.0.mlp.down.kernel") == (
      "model.layers.0.mlp.down_proj.weight", True)


def test_rope_parameters_field(tmp_path):
  """transformers 5 writes ``rope_parameters`` (theta inside) instead of
  ``rope_theta`` + ``rope_scaling``: the same config results."""
  fields = {k: v for k, v in LLAMA.items() if k not in ("rope_theta",
                                                         "rope_scaling")}
  fields["rope_parameters"] = dict(LLAMA["rope_scaling"],
                                   rope_theta=LLAMA["rope_theta"])
  (tmp_path / "config.json").write_text(json.dumps(fields))
  old = tmp_path / "old"
  old.mkdir()
  (old / "config.json").write_text(json.dumps(LLAMA))
  assert read_config(tmp_path) == read_config(old)


def _damaged(tmp_path, config, **changes):
  path = tmp_path / "m"
  write_folder(path, dict(config, **changes), hf_weights(config))
  return path


def test_errors_name_what_is_missing(tmp_path, folders):
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_pretrained(tmp_path)
  with pytest.raises(ValueError, match="MistralForCausalLM.*supported"):
    load_pretrained(_damaged(tmp_path, LLAMA,
                             architectures=["MistralForCausalLM"]))
  with pytest.raises(ValueError, match="'yarn' is not supported"):
    load_pretrained(_damaged(tmp_path, LLAMA, rope_scaling=dict(
        rope_type="yarn", factor=4.0)))
  with pytest.raises(ValueError, match="use_sliding_window"):
    load_pretrained(_damaged(tmp_path, QWEN2, use_sliding_window=True))
  with pytest.raises(ValueError, match="dtype must be one of"):
    load_pretrained(folders["llama"][2], dtype="int8")
  # A tensor missing from the weights, a shard missing from the index.
  weights = hf_weights(LLAMA)
  del weights["model.layers.1.mlp.up_proj.weight"]
  write_folder(tmp_path / "hole", LLAMA, weights)
  with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
    load_pretrained(tmp_path / "hole")
  write_folder(tmp_path / "shards", LLAMA, hf_weights(LLAMA), shards=2)
  (tmp_path / "shards" / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
    load_pretrained(tmp_path / "shards")
  (tmp_path / "shards" / "model.safetensors.index.json").unlink()
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    load_pretrained(tmp_path / "shards")


def test_shape_mismatch_is_named(tmp_path):
  weights = hf_weights(LLAMA)
  weights["model.layers.0.self_attn.k_proj.weight"] = weights[
      "model.layers.0.self_attn.q_proj.weight"]
  write_folder(tmp_path, LLAMA, weights)
  with pytest.raises(ValueError, match="k_proj.weight.*shape"):
    load_pretrained(tmp_path)


def test_bf16_parameters_stay_bf16(folders):
  model = load_pretrained(folders["llama-bf16"][2])
  assert model.blocks[0].attention.query.kernel.dtype == jnp.bfloat16
  assert model.head.kernel.dtype == jnp.bfloat16
