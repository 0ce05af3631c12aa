"""``load_pretrained`` against transformers on checkpoints that transformers
itself writes (``save_pretrained``): small random-weight ``LlamaForCausalLM``
and ``Qwen2ForCausalLM`` in several configs (GQA ratios, tied and untied
heads, llama3 RoPE scaling on and off, fp32 and bf16).

Per prompt (lengths 5, 17, 33): jaxsample generates 64 greedy tokens
(``generate``, one batch); transformers (its default attention, on the CPU)
runs the prompt plus those tokens in one forward.  Checked, with ``tol``
``FP32_TOL`` = 1e-4 (fp32) or ``BF16_TOL`` = 6e-2 (bf16), relative to
``max(1, max |hf logit|)``:

* jaxsample's prefill logits (the prompt) and decode logits (each step
  through the KV cache) within ``tol`` of transformers';
* each of the 64 greedy tokens is transformers' argmax given the same
  prefix, up to a near-tie: its hf logit within ``tol`` of hf's best (so
  the tokens are those of transformers' greedy search wherever its top two
  logits are further apart than the tolerance; with bf16 rounding a
  near-tie may go the other way, after which the sequences part).

Needs torch and transformers (skips naming them otherwise); runs on the GPU
machine (``gpu`` marker) at full fp32 matmul precision.
"""

import numpy as np
import pytest

import jax
import jaxsample as js
from jaxsample import serve_loop
from jaxsample.models import load_pretrained

from helpers.hf_folders import check_close, prefill_and_decode

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_gpu",
                                                      "full_precision")]

FP32_TOL, BF16_TOL = 1e-4, 6e-2
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
  tol = FP32_TOL if dtype == "float32" else BF16_TOL
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


def test_bench_suite_tiny(tmp_path):
  """``python -m jaxsample.bench hf --tiny`` writes a row per shape and
  batch with both frameworks' figures."""
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
    assert 0 < row["sampler_share"]
