"""``load_pretrained`` against a float64 NumPy forward of Llama / Qwen2
(``tests/helpers/hf_folders.py``) on tiny random Hugging Face folders: the name
mapping, RoPE (llama3 scaling), GQA, biases, tied and untied heads, prefill
and decode through the KV cache, greedy generation, bf16, sharded files and
the errors; on the GPU machine also against transformers itself (the
``gpu``-marked tests at the end)."""

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


# ---------------------------------------------------------------------------
# Against transformers (``gpu``-marked: the GPU machine has torch and
# transformers; each test skips naming them otherwise), at full fp32 matmul
# precision, on checkpoints transformers itself writes (``save_pretrained``):
# small random-weight Llama and Qwen2 in several configs (GQA ratios, tied and
# untied heads, llama3 RoPE scaling on and off, fp32 and bf16).  Per prompt
# (lengths 5, 17, 33) jaxsample generates 64 greedy tokens (``generate``, one
# batch); transformers (its default attention, on the CPU) runs the prompt
# plus those tokens in one forward.  With ``tol`` = TRANSFORMERS_FP32_TOL
# (1e-4) or TRANSFORMERS_BF16_TOL (6e-2), relative to
# ``max(1, max |hf logit|)``: jaxsample's prefill and decode logits lie
# within ``tol`` of transformers', and each greedy token is transformers'
# argmax given the same prefix up to a near-tie (its hf logit within ``tol``
# of hf's best).
# ---------------------------------------------------------------------------


TRANSFORMERS_FP32_TOL, TRANSFORMERS_BF16_TOL = 1e-4, 6e-2
NEW = 64
PROMPT_LENGTHS = (5, 17, 33)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=32)
# name: (architecture, config kwargs, dtype)
CASES = {
    "llama-gqa4-untied-llama3-fp32": ("llama", dict(
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
        rope_scaling=LLAMA3, rope_theta=500000.0), "float32"),
    "llama-mha-tied-fp32": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        rope_theta=10000.0), "float32"),
    "llama-gqa8-untied-llama3-bf16": ("llama", dict(
        num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=False,
        rope_scaling=LLAMA3, rope_theta=500000.0), "bfloat16"),
    "qwen2-gqa2-tied-fp32": ("qwen2", dict(
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
        rope_theta=1000000.0), "float32"),
    "qwen2-gqa4-untied-fp32": ("qwen2", dict(
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
        rope_theta=1000000.0), "float32"),
    "qwen2-gqa2-tied-bf16": ("qwen2", dict(
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
        rope_theta=1000000.0), "bfloat16"),
}


def _hf_model(arch, kwargs, dtype, path):
  """Writes a random transformers model into ``path``; returns it (eval)."""
  torch = pytest.importorskip("torch", reason="the transformers comparison "
                              "needs torch")
  transformers = pytest.importorskip("transformers", reason="the "
                                     "comparison needs transformers")
  config_class, model_class = {
      "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
  config = config_class(vocab_size=512, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=3, max_position_embeddings=256,
                        rms_norm_eps=1e-6, **kwargs)
  torch.manual_seed(0)
  model = model_class(config)
  with torch.no_grad():  # weights that spread the logits (no near-ties)
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.1 * torch.randn_like(p))
      elif "embed" in name:
        p.normal_(0.0, 1.0)
      elif name.endswith("bias"):
        p.normal_(0.0, 0.5)
      else:
        p.normal_(0.0, p.shape[1] ** -0.5)
  model = model.to(getattr(torch, dtype)).eval()
  model.save_pretrained(path)
  return torch, model


@pytest.mark.gpu
@pytest.mark.usefixtures("full_precision")
@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(name, tmp_path):
  arch, kwargs, dtype = CASES[name]
  torch, hf = _hf_model(arch, kwargs, dtype, tmp_path)
  model = load_pretrained(tmp_path)
  assert model.config.dtype == dtype
  # The folder transformers wrote carries the scaling (rope_scaling, or
  # rope_parameters in transformers 5) and jaxsample read it.
  assert (model.config.rope_scaling is not None) == ("rope_scaling" in kwargs)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 512, n).tolist() for n in PROMPT_LENGTHS]
  out = serve_loop.generate(
      model, prompts, params=js.SamplingParams.make(3, temperature=0.0),
      keys=jax.random.split(jax.random.key(0), 3), max_new_tokens=NEW,
      cache_len=128)
  tokens = np.asarray(out.tokens)[:, :NEW]
  prefill, decode = prefill_and_decode(model, prompts, tokens[:, :-1], 128)
  tol = TRANSFORMERS_FP32_TOL if dtype == "float32" else TRANSFORMERS_BF16_TOL
  for b, prompt in enumerate(prompts):
    n = len(prompt)
    seq = torch.tensor([prompt + tokens[b].tolist()])
    with torch.no_grad():
      ref = hf(seq).logits[0].float().numpy().astype(np.float64)
    check_close(prefill[b, :n], ref[:n], tol, f"{name} prefill, prompt {b}")
    check_close(decode[b], ref[n:n + NEW - 1], tol, f"{name} decode, prompt {b}")
    steps = ref[n - 1:n - 1 + NEW]
    gap = steps.max(axis=1) - steps[np.arange(NEW), tokens[b]]
    bound = tol * max(1.0, np.abs(steps).max())
    assert gap.max() <= bound, (
        f"{name}, prompt {b}: greedy token {int(gap.argmax())} is "
        f"{gap.max():.3g} below transformers' argmax (bound {bound:.3g})")


@pytest.mark.gpu
@pytest.mark.usefixtures("full_precision")
def test_bench_suite_tiny(tmp_path):
  """``python -m jaxsample.bench hf --tiny`` writes a row per shape and
  batch with both frameworks' figures; the decode step (a difference of two
  generate calls) is positive, with the sampler's share of it and the first
  token's time, or None where the host's noise exceeds it (a tiny model:
  2026-11-29i's GPU run measured a step of -0.77 ms at 4 new tokens)."""
  import json

  pytest.importorskip("torch", reason="the hf suite needs torch")
  pytest.importorskip("transformers", reason="the hf suite needs transformers")
  from jaxsample.bench import cli
  out = tmp_path / "hf.json"
  assert cli.main(["hf", "--tiny", "--batch", "1,2", "--new-tokens", "4",
                   "--prompt-len", "8", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())
  assert [(r["shape"], r["batch"]) for r in rows] == [
      ("tiny-llama", 1), ("tiny-llama", 2), ("tiny-qwen2", 1), ("tiny-qwen2", 2)]
  for row in rows:
    assert row["jaxsample_tok_s"] > 0 and row["transformers_tok_s"] > 0
    assert row["jaxsample_peak_gib"] > 0 and row["transformers_peak_gib"] > 0
    if row["step_us"] is None:
      assert row["sampler_share"] is None and row["jaxsample_ttft_ms"] is None
    else:
      assert row["step_us"] > 0 and row["sampler_share"] > 0
      assert row["jaxsample_ttft_ms"] > 0
