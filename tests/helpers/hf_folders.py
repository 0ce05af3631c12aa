"""Tiny Hugging Face model folders written by the tests, and a float64 NumPy
forward pass of Llama / Qwen2 (the reference of ``tests/test_hf*.py``).

The reference follows transformers' modeling code: RMSNorm ``w * x /
sqrt(mean(x^2) + eps)``, RoPE in the ``rotate_half`` layout (pairs ``i``,
``i + D/2``) with ``inv_freq = theta^(-2i/D)``, optionally the ``llama3``
rescaling of ``inv_freq``, grouped-query attention (query head ``h`` reads
KV head ``h // (H / KV)``) scaled by ``D^-1/2``, a SwiGLU MLP
``down(silu(gate(x)) * up(x))``, Qwen2's q/k/v biases and a tied or untied
head.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import ml_dtypes
import numpy as np

from jaxsample import serve_loop

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama",
             vocab_size=96, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, rms_norm_eps=1e-5, rope_theta=10000.0,
             rope_scaling=dict(rope_type="llama3", factor=8.0,
                               low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=64),
             tie_word_embeddings=False, max_position_embeddings=128)
"""head_dim 8: wavelengths 6.3, 63, 628, 6283 against 16 and 64, so the
llama3 scaling keeps one frequency, smooths one and divides two."""
QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
             vocab_size=80, hidden_size=48, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=2,
             intermediate_size=96, rms_norm_eps=1e-6, rope_theta=1000000.0,
             tie_word_embeddings=True, max_position_embeddings=128,
             use_sliding_window=False)


def hf_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """Random float64 weights with transformers' names and ``[out, in]``
  layout for ``config`` (biases for Qwen2, ``lm_head`` when untied)."""
  rng = np.random.default_rng(seed)
  d, f = config["hidden_size"], config["intermediate_size"]
  heads = config["num_attention_heads"]
  kv = config.get("num_key_value_heads", heads)
  hd = d // heads
  bias = config["architectures"][0] == "Qwen2ForCausalLM"
  normal = lambda *shape, std: rng.normal(0.0, std, shape)
  w = {"model.embed_tokens.weight": normal(config["vocab_size"], d, std=1.0),
       "model.norm.weight": 1 + normal(d, std=0.1)}
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    for name, n_out, n_in in (("q", heads * hd, d), ("k", kv * hd, d),
                              ("v", kv * hd, d), ("o", d, heads * hd)):
      w[p + f"self_attn.{name}_proj.weight"] = normal(n_out, n_in,
                                                      std=n_in ** -0.5)
      if bias and name != "o":
        w[p + f"self_attn.{name}_proj.bias"] = normal(n_out, std=0.5)
    for name, n_out, n_in in (("gate", f, d), ("up", f, d), ("down", d, f)):
      w[p + f"mlp.{name}_proj.weight"] = normal(n_out, n_in, std=n_in ** -0.5)
    w[p + "input_layernorm.weight"] = 1 + normal(d, std=0.1)
    w[p + "post_attention_layernorm.weight"] = 1 + normal(d, std=0.1)
  if not config["tie_word_embeddings"]:
    w["lm_head.weight"] = normal(config["vocab_size"], d, std=d ** -0.5)
  return w


def write_folder(path, config: dict, weights: dict, *, dtype="float32",
                 shards: int = 1) -> dict[str, np.ndarray]:
  """Writes ``config.json`` (``torch_dtype`` = ``dtype``) and the weights
  (cast to ``dtype``) into ``path``: ``model.safetensors``, or ``shards``
  files and ``model.safetensors.index.json``.  Returns the weights as
  stored, in float64."""
  import safetensors.numpy
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(dict(config, torch_dtype=dtype)))
  np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
  stored = {k: v.astype(np_dtype) for k, v in weights.items()}
  names = sorted(stored)
  if shards == 1:
    safetensors.numpy.save_file(stored, str(path / "model.safetensors"))
  else:
    weight_map = {}
    for s in range(shards):
      file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
      part = names[s::shards]
      safetensors.numpy.save_file({n: stored[n] for n in part},
                                  str(path / file))
      weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
  return {k: v.astype(np.float64) for k, v in stored.items()}


def _rms(x, w, eps):
  return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def inv_freq(config: dict) -> np.ndarray:
  """transformers' ``inv_freq`` (float64), with the llama3 scaling."""
  hd = config["hidden_size"] // config["num_attention_heads"]
  freq = 1.0 / config["rope_theta"] ** (np.arange(0, hd, 2) / hd)
  scaling = config.get("rope_scaling")
  if not scaling:
    return freq
  factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor",
                                            "high_freq_factor"))
  old = scaling["original_max_position_embeddings"]
  out = []
  for fr in freq:
    wavelen = 2 * math.pi / fr
    if wavelen < old / high:
      out.append(fr)
    elif wavelen > old / low:
      out.append(fr / factor)
    else:
      s = (old / wavelen - low) / (high - low)
      out.append((1 - s) * fr / factor + s * fr)
  return np.array(out)


def _rotate(x, positions, freq):  # x [S, H, D]
  angle = positions[:, None] * freq[None]  # [S, D/2]
  cos = np.concatenate([np.cos(angle)] * 2, -1)[:, None]
  sin = np.concatenate([np.sin(angle)] * 2, -1)[:, None]
  half = x.shape[-1] // 2
  rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated * sin


def reference_logits(config: dict, w: dict, ids) -> np.ndarray:
  """``[S, V]`` float64 next-token logits of the sequence ``ids``."""
  ids = np.asarray(ids)
  s, eps = len(ids), config["rms_norm_eps"]
  heads = config["num_attention_heads"]
  kv = config.get("num_key_value_heads", heads)
  hd = config["hidden_size"] // heads
  positions = np.arange(s, dtype=np.float64)
  freq = inv_freq(config)
  linear = lambda x, name: x @ w[name + ".weight"].T + w.get(name + ".bias", 0)
  x = w["model.embed_tokens.weight"][ids]
  causal = np.tril(np.ones((s, s), bool))
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = _rms(x, w[p + "input_layernorm.weight"], eps)
    q = _rotate(linear(h, p + "self_attn.q_proj").reshape(s, heads, hd),
                positions, freq)
    k = _rotate(linear(h, p + "self_attn.k_proj").reshape(s, kv, hd),
                positions, freq)
    v = linear(h, p + "self_attn.v_proj").reshape(s, kv, hd)
    group = heads // kv
    out = np.zeros((s, heads, hd))
    for head in range(heads):
      scores = q[:, head] @ k[:, head // group].T / math.sqrt(hd)
      scores = np.where(causal, scores, -np.inf)
      probs = np.exp(scores - scores.max(-1, keepdims=True))
      probs /= probs.sum(-1, keepdims=True)
      out[:, head] = probs @ v[:, head // group]
    x = x + linear(out.reshape(s, heads * hd), p + "self_attn.o_proj")
    h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    gate = linear(h, p + "mlp.gate_proj")
    x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, p + "mlp.up_proj"),
                   p + "mlp.down_proj")
  x = _rms(x, w["model.norm.weight"], eps)
  head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
  return x @ head.T


def reference_greedy(config: dict, w: dict, prompt, n: int) -> list[int]:
  """``n`` greedy tokens after ``prompt`` by the reference."""
  ids = list(prompt)
  for _ in range(n):
    ids.append(int(np.argmax(reference_logits(config, w, ids)[-1])))
  return ids[len(prompt):]


def prefill_and_decode(model, prompts, continuations, cache_len: int):
  """jaxsample's logits ``([B, 16, V] prefill, [B, N, V] decode)``: a
  left-aligned prefill of ``prompts`` (``max(16, longest)`` columns), then one decode step per column of
  ``continuations`` ``[B, N]``, through the KV cache."""
  lm, weights = serve_loop.NnxLM.split(model)
  forward = jax.jit(lm.apply)
  batch, width = len(prompts), max(16, max(map(len, prompts)))
  tokens = np.zeros((batch, width), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  cache = lm.init_cache(weights, batch, cache_len)
  positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
  prefill, cache = forward(weights, tokens, positions, cache)
  steps = []
  lengths = np.array([len(p) for p in prompts], np.int32)
  continuations = np.asarray(continuations, np.int32)
  for t in range(continuations.shape[1]):
    logits, cache = forward(weights, continuations[:, t:t + 1],
                            (lengths + t)[:, None], cache)
    steps.append(np.asarray(logits[:, 0]))
  return np.asarray(prefill), np.stack(steps, 1)


def check_close(got, ref, tol: float, what: str) -> None:
  """Asserts ``max |got - ref| <= tol * max(1, max |ref|)``."""
  bound = tol * max(1.0, float(np.abs(ref).max()))
  err = float(np.abs(np.asarray(got, np.float64) - ref).max())
  assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"
