"""``python -m jaxsample.bench hf``: jaxsample against transformers on
Hugging Face checkpoints (bf16, random weights, one GPU).

For each shape (a Llama-3.1-8B-shaped ``LlamaForCausalLM`` with llama3 RoPE
scaling and an untied head; a Qwen2.5-0.5B-shaped ``Qwen2ForCausalLM`` with
q/k/v biases and tied embeddings), transformers builds the model on the GPU
with random bf16 weights (normal, std 1/sqrt(fan_in); embeddings and head
2.5/sqrt(hidden) so logits spread like an LLM's) and ``save_pretrained``
writes it; jaxsample loads that folder (``load_pretrained``).  Then, at each
batch size, on the same random prompts of ``--prompt-len`` tokens, with
T = 1, top-k 50 and top-p 0.9 and no stop token (every request generates
``--new-tokens`` tokens):

* tokens/s: B x new tokens over the wall clock of one call, after a warm-up
  call of the same shapes (jaxsample's ``generate``, jitted: its compile is
  in the warm-up; transformers' ``generate(do_sample=True)`` with its
  default cache and attention);
* time to first token: transformers' call with one new token; jaxsample's
  from one program: ``T(new) - (new - 1) x step``, the step from the
  difference of two calls (``time_jaxsample``);
* memory: peak device bytes of each framework's allocator (JAX's
  ``peak_bytes_in_use``, torch's ``max_memory_allocated``): weights, cache
  and work space.  Each shape runs in its own process and the batch sizes
  in increasing order, so JAX's peak (which cannot be reset) is that of the
  row's batch;
* the sampler's share of jaxsample's decode step: ``js.sample`` alone on
  ``[B, V]`` fp32 logits (device time, ``timing.time_op``) over that step
  time.

B = 1 runs ``generate``'s smallest slot bucket, 8 slots (``docs/generation.md``).
Needs torch and transformers; sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
(unless set) so that JAX and torch share the GPU.  ``--quick`` generates 32
tokens instead of 256; ``--tiny`` swaps in tiny shapes (runs on CPU).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js
from jaxsample import serve_loop
from jaxsample.bench.timing import time_op
from jaxsample.generation.generate import MIN_NEW
from jaxsample.models import load_pretrained

__all__ = ["SHAPES", "TINY_SHAPES", "add_options", "main"]

LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192)
SHAPES = {
    "llama-3.1-8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=False)),
    "qwen2.5-0.5b": ("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=True)),
}
TINY_SHAPES = {
    "tiny-llama": ("llama", dict(
        vocab_size=1000, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_scaling=dict(LLAMA3_SCALING, original_max_position_embeddings=64),
        max_position_embeddings=1024, tie_word_embeddings=False)),
    "tiny-qwen2": ("qwen2", dict(
        vocab_size=1500, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=1024, tie_word_embeddings=True)),
}
TOP_K, TOP_P = 50, 0.9


def add_options(parser: argparse.ArgumentParser) -> None:
  """The suite's options (``python -m jaxsample.bench hf --help``)."""
  parser.add_argument("--shapes", help=f"comma-separated, of {list(SHAPES)} "
                      f"(with --tiny: {list(TINY_SHAPES)}); default all")
  parser.add_argument("--batch", default="1,8,64", help="batch sizes")
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--new-tokens", type=int, default=256)
  parser.add_argument("--quick", action="store_true",
                      help="32 new tokens (about half the run time)")
  parser.add_argument("--tiny", action="store_true",
                      help="tiny shapes (a CPU smoke run)")
  parser.add_argument("--dir", help="where to write the checkpoints "
                      "(default: a temporary folder, removed at the end)")
  parser.add_argument("--out", help="write the rows as JSON to this file")


def _import_torch():
  try:
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
  except ImportError as error:
    raise SystemExit(f"the hf suite needs torch and transformers ({error})")
  return torch, transformers


def save_random_checkpoint(arch: str, fields: dict, path, device: str):
  """Builds a random bf16 transformers model on ``device``, writes it to
  ``path`` with ``save_pretrained`` and returns it (eval mode)."""
  torch, transformers = _import_torch()
  config_class, model_class = {
      "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
  config = config_class(**fields)
  default = torch.get_default_dtype()
  torch.set_default_dtype(torch.bfloat16)
  try:
    with torch.device(device):
      model = model_class(config)
  finally:
    torch.set_default_dtype(default)
  head_std = 2.5 / math.sqrt(fields["hidden_size"])
  generator = torch.Generator(device).manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.fill_(1.0)
      elif "embed" in name or "lm_head" in name:
        p.normal_(0.0, head_std, generator=generator)
      elif name.endswith("bias"):
        p.normal_(0.0, 0.1, generator=generator)
      else:
        p.normal_(0.0, p.shape[1] ** -0.5, generator=generator)
  model.eval()
  model.save_pretrained(path)
  return model


def _time(fn):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def time_jaxsample(model, prompts: np.ndarray, new: int, cache_len: int):
  """``(generate wall s, first-token s, decode step s)`` after a compiling
  warm-up.

  Each time is the faster of two calls.  One program (one compile) gives
  all three: a call whose requests stop
  after ``k < new`` tokens (``k`` in ``new``'s token-buffer bucket) gives
  the step ``(T(new) - T(k)) / (new - k)`` and the first token
  ``T(new) - (new - 1) * step``.  Where that difference is not positive
  (the host's noise exceeds ``new - k`` steps of a small model: raise
  ``--new-tokens``), the step and the first token are None (not resolved).
  """
  if new < 2:
    raise SystemExit("--new-tokens must be >= 2")
  batch = len(prompts)
  params = js.SamplingParams.make(batch, temperature=1.0, top_k=TOP_K,
                                  top_p=TOP_P)
  keys = jax.random.split(jax.random.key(0), batch)
  run = lambda n: jax.block_until_ready(serve_loop.generate(
      model, prompts.tolist(), params=params, keys=keys, max_new_tokens=n,
      cache_len=cache_len).tokens)
  k = 1 if new <= MIN_NEW else serve_loop.bucket(new, MIN_NEW) // 2 + 1
  run(new)  # compiles
  full = min(_time(lambda: run(new)) for _ in range(2))
  part = min(_time(lambda: run(k)) for _ in range(2))
  step = (full - part) / (new - k)
  if step <= 0:
    return full, None, None
  return full, full - (new - 1) * step, step


def time_transformers(torch, model, prompts: np.ndarray, new: int):
  """``(generate wall s, first-token wall s)`` after a warm-up."""
  ids = torch.tensor(prompts, device=model.device)

  def run(n):
    with torch.no_grad():
      model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                     temperature=1.0, top_k=TOP_K, top_p=TOP_P,
                     max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    if ids.is_cuda:
      torch.cuda.synchronize()

  run(4)
  return _time(lambda: run(new)), _time(lambda: run(1))


def sampler_us(batch: int, vocab: int) -> float:
  """jaxsample top-k 50 + top-p 0.9 alone on ``[B, V]`` fp32 logits (us)."""
  params = js.SamplingParams.make(batch, temperature=1.0, top_k=TOP_K,
                                  top_p=TOP_P)
  keys = jax.random.split(jax.random.key(1), batch)
  positions = jnp.zeros((batch,), jnp.int32)
  fn = jax.jit(lambda x: js.sample(x, params, keys, positions=positions).tokens)
  inputs = [3 * jax.random.normal(jax.random.key(i), (batch, vocab))
            for i in range(4)]
  return time_op(fn, inputs, 20, 3)["us"]


def _peak_bytes() -> int | None:
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def bench_shape(name, arch, fields, opts, root) -> list[dict]:
  torch, _ = _import_torch()
  device = "cuda" if torch.cuda.is_available() else "cpu"
  path = pathlib.Path(root) / name
  start = time.perf_counter()
  hf = save_random_checkpoint(arch, fields, path, device)
  saved_s = time.perf_counter() - start
  model = load_pretrained(path)
  loaded_s = time.perf_counter() - start - saved_s
  print(f"{name}: saved in {saved_s:.1f} s, loaded by jaxsample in "
        f"{loaded_s:.1f} s", flush=True)
  new = 32 if opts.quick else opts.new_tokens
  cache_len = 1 << (opts.prompt_len + new - 1).bit_length()
  rng = np.random.default_rng(0)
  rows = []
  for batch in sorted(map(int, opts.batch.split(","))):
    prompts = rng.integers(0, fields["vocab_size"], (batch, opts.prompt_len))
    js_s, js_first, js_step = time_jaxsample(model, prompts, new, cache_len)
    js_peak = _peak_bytes()
    if device == "cuda":
      torch.cuda.reset_peak_memory_stats()
    hf_s, hf_first = time_transformers(torch, hf, prompts, new)
    hf_peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    step_us = js_step and js_step * 1e6
    alone = sampler_us(batch, fields["vocab_size"])
    row = {"shape": name, "batch": batch, "prompt_len": opts.prompt_len,
           "new_tokens": new, "jaxsample_tok_s": batch * new / js_s,
           "transformers_tok_s": batch * new / hf_s,
           "jaxsample_ttft_ms": js_first and js_first * 1e3,
           "transformers_ttft_ms": hf_first * 1e3,
           "jaxsample_peak_gib": js_peak and js_peak / 2**30,
           "transformers_peak_gib": hf_peak and hf_peak / 2**30,
           "step_us": step_us, "sampler_us": alone,
           "sampler_share": step_us and alone / step_us}
    rows.append(row)
    print(_format(row), flush=True)
  del hf
  if device == "cuda":
    torch.cuda.empty_cache()
  return rows


def _format(row: dict) -> str:
  gib = lambda v: "-" if v is None else f"{v:.1f}"
  share = ("step not resolved (raise --new-tokens)" if row["step_us"] is None
           else f"{100 * row['sampler_share']:.2f}% of the "
           f"{row['step_us'] / 1e3:.2f} ms step")
  ttft = row["jaxsample_ttft_ms"]
  return (f"{row['shape']:>14} B={row['batch']:<3} tok/s jaxsample "
          f"{row['jaxsample_tok_s']:9.0f} transformers "
          f"{row['transformers_tok_s']:9.0f} | TTFT ms "
          f"{'-' if ttft is None else f'{ttft:7.1f}'} / "
          f"{row['transformers_ttft_ms']:7.1f}"
          f" | peak GiB {gib(row['jaxsample_peak_gib'])} / "
          f"{gib(row['transformers_peak_gib'])} | sampler "
          f"{row['sampler_us']:.1f} us = {share}")


def _in_child(name: str, opts: argparse.Namespace, out: pathlib.Path) -> list:
  """The rows of shape ``name``, measured by a fresh process."""
  argv = [sys.executable, "-m", "jaxsample.bench", "hf", "--shapes", name,
          "--batch", opts.batch, "--prompt-len", str(opts.prompt_len),
          "--new-tokens", str(opts.new_tokens), "--out", str(out)]
  argv += ["--quick"] * opts.quick + ["--tiny"] * opts.tiny
  argv += ["--dir", opts.dir] if opts.dir else []
  subprocess.run(argv, check=True)
  return json.loads(out.read_text())


def main(opts: argparse.Namespace) -> int:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  _import_torch()
  shapes = TINY_SHAPES if opts.tiny else SHAPES
  names = opts.shapes.split(",") if opts.shapes else list(shapes)
  unknown = [n for n in names if n not in shapes]
  if unknown:
    raise SystemExit(f"--shapes: unknown {unknown}; expected {list(shapes)}")
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    if len(names) > 1:  # one process per shape: per-shape peak memory
      for name in names:
        rows += _in_child(name, opts, pathlib.Path(tmp) / f"{name}.json")
    else:
      rows = bench_shape(names[0], *shapes[names[0]], opts, opts.dir or tmp)
  if opts.out:
    pathlib.Path(opts.out).write_text(json.dumps(rows, indent=1) + "\n")
  return 0
