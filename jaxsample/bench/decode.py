"""Decode-step benchmarks: ``python -m jaxsample.bench decode [--tiny]``.

Three tables:

1. ``generate`` with the embedded Shakespeare model at B = 1, 8, 64 (T = 0.8,
   top-p 0.9, no stop token): generated tokens per second of the jitted call
   after a compiling warm-up (wall clock, host transfer of the result included).
2. One decode step of random-weight bf16 Flax NNX decoders with a KV cache of
   1,024 positions (every slot at position 512; attention spans the whole
   cache): a Llama-3.1-8B-like and a Qwen2.5-0.5B-like shape at B = 64 and
   128.  The step (model forward, token choice, state update, cache donated)
   is timed with each token chooser: ``argmax`` (the model alone), XLA
   ``jax.random.categorical``, ``lax.top_k(50)`` + top-p 0.9 + categorical,
   and jaxsample's ``emit`` (``decode_step``'s sampler) plain (T = 1) and
   with top-k 50 + top-p 0.9.  All choosers live in one jitted step behind a
   ``lax.switch`` on a traced index, so each (shape, B) compiles once;
   jaxsample's parameters are traced.  Step time: wall clock over
   ``--steps`` consecutive steps (asynchronous dispatch, one sync at the end).
   The sampler's share: (step - argmax step) / step.
3. Each sampler alone on ``[B, V]`` fp32 logits from the model, device time
   (``jaxsample.bench.timing.time_op``; wall clock on CPU), and its share of the
   step.  For the 0.5B shape, the floor: logits bytes over weight + cache
   bytes (the least a sampler that reads the logits once can cost, relative
   to a memory-bound step).

With ``--processors``, instead (default shape Qwen2.5-0.5B): the decode step
(model forward, ``emit``, cache donated) plain at T = 1, without and with
issue 40's processors in the decode state (penalties over ``--history``
1,024-token output histories, a logit bias of 16 ids, a grammar bitmask) and
top-``--num-top`` (5) raw logprobs of the emitted tokens: step ms of each,
timed in alternating blocks of ``--steps`` steps (median of ``--rounds``),
and the processors' share of the processed step, (with - without) / with.

Weights are drawn on the device (normal, std 1/sqrt(fan_in); the LM head and
embeddings at 2.5/sqrt(d) so logits spread like an LLM's).  ``--tiny`` swaps
in tiny shapes so the script runs on CPU in a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsample as js
from jaxsample import serve_loop
from jaxsample.bench.cases import processor_fields
from jaxsample.bench.timing import time_op
from jaxsample.models import Transformer, TransformerConfig, load_embedded

__all__ = ["SHAPES", "main"]

CACHE_LEN = 1024
SHAPES = {
    "llama-3.1-8b": TransformerConfig(
        vocab_size=128256, d_model=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, mlp_dim=14336, max_len=CACHE_LEN, rope_base=500000.0,
        tie_embeddings=False, dtype="bfloat16"),
    "qwen2.5-0.5b": TransformerConfig(
        vocab_size=151936, d_model=896, num_layers=24, num_heads=14,
        num_kv_heads=2, mlp_dim=4864, max_len=CACHE_LEN, rope_base=1000000.0,
        tie_embeddings=True, dtype="bfloat16"),
}
TINY_SHAPES = {
    "tiny-untied": TransformerConfig(
        vocab_size=1000, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
        mlp_dim=128, max_len=64, tie_embeddings=False, dtype="bfloat16"),
    "tiny-tied": TransformerConfig(
        vocab_size=1500, d_model=64, num_layers=2, num_heads=4, num_kv_heads=1,
        mlp_dim=128, max_len=64, dtype="bfloat16"),
}
CHOOSERS = ("argmax", "jax.random.categorical", "lax.top_k(50)+top-p(0.9)",
            "jaxsample plain", "jaxsample top-k 50 + top-p 0.9")
TOP_K, TOP_P = 50, 0.9


def random_weights(config: TransformerConfig, seed: int = 0):
  """``(NnxLM, state)`` with weights drawn on the default device."""
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  lm, state = serve_loop.NnxLM.split(abstract)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  head_std = 2.5 / math.sqrt(config.d_model)
  values = []
  for i, (path, leaf) in enumerate(leaves):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      std = None
    elif "embed" in name or "head" in name:
      std = head_std if ("head" in name or config.tie_embeddings) else 1.0
    else:
      std = 1.0 / math.sqrt(leaf.shape[0])
    values.append(_draw(jax.random.key(seed * 1000 + i), leaf.shape,
                        leaf.dtype, std))
  return lm, jax.tree_util.tree_unflatten(treedef, values)


def _draw(key, shape, dtype, std):
  if std is None:
    return jnp.ones(shape, dtype)
  return jax.jit(lambda k: (jax.random.normal(k, shape, dtype) * std
                            ).astype(dtype))(key)


def _chooser_branches(logits, key, config):
  """Token choosers on ``[B, V]`` logits, each ``small_state -> small_state``."""
  def baseline(choose):
    def branch(small):
      tokens = choose(jax.random.fold_in(key, small.positions[0]), logits)
      return dataclasses.replace(small, tokens=tokens.astype(jnp.int32),
                                 positions=small.positions + 1)
    return branch

  def sampler(small):
    return serve_loop.emit(small, logits, config=config)[0]

  return [baseline(lambda k, x: jnp.argmax(x, axis=-1)),
          baseline(lambda k, x: jax.random.categorical(k, x)),
          baseline(top_k_top_p_sample), sampler, sampler]


def top_k_top_p_sample(key, logits):
  """``lax.top_k(50)``, then top-p 0.9 over those, then categorical."""
  values, ids = jax.lax.top_k(logits.astype(jnp.float32), TOP_K)
  probs = jax.nn.softmax(values, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  choice = jax.random.categorical(key, jnp.where(before < TOP_P, values,
                                                 -jnp.inf))
  return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]


def make_step(lm, config: js.SamplerConfig):
  """Jitted ``(weights, state, which) -> state`` with the cache donated."""
  def step(weights, state, which):
    logits, cache = lm.apply(weights, state.tokens[:, None],
                             state.positions[:, None], state.cache)
    small = dataclasses.replace(state, cache=None)
    branches = _chooser_branches(logits[:, 0], jax.random.key(7), config)
    small = jax.lax.switch(which, branches, small)
    return dataclasses.replace(small, cache=cache)
  return jax.jit(step, donate_argnums=(1,))


def start_state(lm, weights, config: TransformerConfig, batch: int,
                cache_len: int) -> serve_loop.DecodeState:
  """Every slot at position ``cache_len // 2`` (T = 1) with a zero cache."""
  params = js.SamplingParams.make(batch, temperature=1.0)
  keys = jax.random.key_data(jax.random.split(jax.random.key(3), batch))
  cache = jax.jit(lambda w: lm.init_cache(w, batch, cache_len))(weights)
  return serve_loop.DecodeState(
      tokens=jnp.arange(batch, dtype=jnp.int32) % config.vocab_size,
      positions=jnp.full((batch,), cache_len // 2, jnp.int32), keys=keys,
      params=params, finished=jnp.zeros((batch,), bool),
      stop_tokens=jnp.full((batch, 4), -1, jnp.int32),
      remaining=jnp.full((batch,), 2**30, jnp.int32), cache=cache)


def time_steps(step, weights, state, which: int, steps: int):
  """Seconds per step over ``steps`` steps after 2 warm-up steps."""
  which = jnp.int32(which)
  for _ in range(2):
    state = step(weights, state, which)
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(steps):
    state = step(weights, state, which)
  jax.block_until_ready(state)
  return (time.perf_counter() - start) / steps, state


def bench_shape(name, config, batches, steps, sampler_config, iters):
  lm, weights = random_weights(config)
  step = make_step(lm, sampler_config)
  weight_bytes = sum(a.nbytes for a in jax.tree.leaves(weights))
  rows = []
  for batch in batches:
    state = start_state(lm, weights, config, batch, config.max_len)
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(state.cache))
    times = {}
    for which, chooser in enumerate(CHOOSERS):
      state = dataclasses.replace(state, params=js.SamplingParams.make(
          batch, temperature=1.0, top_k=TOP_K if "top-k" in chooser else 0,
          top_p=TOP_P if "top-p" in chooser else 1.0))
      state = dataclasses.replace(state, positions=jnp.full(
          (batch,), config.max_len // 2, jnp.int32))
      times[chooser], state = time_steps(step, weights, state, which, steps)
    logits = jax.jit(lambda w, s: lm.apply(
        w, s.tokens[:, None], s.positions[:, None], s.cache)[0][:, 0])(
            weights, state)
    alone = sampler_alone(logits, batch, sampler_config, iters)
    logits_bytes = batch * config.vocab_size * 4
    rows.append({"shape": name, "batch": batch, "step_s": times,
                 "sampler_alone_us": alone, "weight_bytes": weight_bytes,
                 "cache_bytes": cache_bytes, "logits_bytes": logits_bytes,
                 "floor": logits_bytes / (weight_bytes + cache_bytes)})
    # Each row as soon as it is measured: a run cut short keeps what it did.
    print(json.dumps(rows[-1]), flush=True)
    del state
  return rows


def sampler_alone(logits, batch, sampler_config, iters):
  key = jax.random.key(5)
  keys = jax.random.split(key, batch)
  positions = jnp.zeros((batch,), jnp.int32)
  plain = js.SamplingParams.make(batch, temperature=1.0)
  trunc = js.SamplingParams.make(batch, temperature=1.0, top_k=TOP_K,
                                 top_p=TOP_P)
  fns = {
      "argmax": lambda x: jnp.argmax(x, axis=-1),
      "jax.random.categorical": lambda x: jax.random.categorical(key, x),
      "lax.top_k(50)+top-p(0.9)": lambda x: top_k_top_p_sample(key, x),
      "jaxsample plain": lambda x: js.sample(
          x, plain, keys, positions=positions, config=sampler_config).tokens,
      "jaxsample top-k 50 + top-p 0.9": lambda x: js.sample(
          x, trunc, keys, positions=positions, config=sampler_config).tokens,
  }
  inputs = [logits + 0.01 * i for i in range(4)]
  return {name: time_op(jax.jit(fn), inputs, iters, 3)["us"]
          for name, fn in fns.items()}


def make_emit_step(lm, config: js.SamplerConfig, num_top: int):
  """Jitted ``(weights, state) -> (state, top)``: the forward pass and
  ``emit`` (top-``num_top`` raw logprobs as an output, so they are computed;
  none with 0), the cache donated."""
  mode = "raw_logprobs" if num_top else None

  def step(weights, state):
    logits, cache = lm.apply(weights, state.tokens[:, None],
                             state.positions[:, None], state.cache)
    small, out = serve_loop.emit(dataclasses.replace(state, cache=None),
                                 logits[:, 0], config=config, num_top=num_top,
                                 logprob_mode=mode)
    return dataclasses.replace(small, cache=cache), out.top
  return jax.jit(step, donate_argnums=(1,))


def bench_processing(name, config, batches, steps, rounds, sampler_config,
                     history, num_top):
  """Per batch: step seconds without and with the processors (module doc)."""
  if (rounds + 1) * steps > config.max_len // 2:
    raise ValueError(f"--steps x (--rounds + 1) = {(rounds + 1) * steps} "
                     f"must be at most the cache's free positions, "
                     f"{config.max_len // 2}: pass fewer --steps or --rounds")
  lm, weights = random_weights(config)
  variants = {"without": (make_emit_step(lm, sampler_config, 0), None),
              "with": (make_emit_step(lm, sampler_config, num_top), history)}
  rows = []
  for batch in batches:
    fields = processor_fields(batch, config.vocab_size, history)
    states = {}
    for variant, (_, width) in variants.items():
      state = start_state(lm, weights, config, batch, config.max_len)
      states[variant] = state if width is None else dataclasses.replace(
          state, processors=js.LogitsProcessors(
              **{k: v for f in fields.values() for k, v in f.items()}))
    times = {variant: [] for variant in variants}
    for _ in range(rounds + 1):  # the first round compiles and warms up
      for variant, (step, _) in variants.items():
        state = states[variant]
        start = time.perf_counter()
        for _ in range(steps):
          state, top = step(weights, state)
        jax.block_until_ready((state, top))
        times[variant].append((time.perf_counter() - start) / steps)
        states[variant] = state
    step_s = {v: float(np.median(t[1:])) for v, t in times.items()}
    added = step_s["with"] - step_s["without"]
    rows.append({"shape": name, "batch": batch, "history": history,
                 "num_top": num_top, "step_s": step_s,
                 "share": added / step_s["with"]})
    print(json.dumps(rows[-1]), flush=True)
    del states
  return rows


def report_processing(rows) -> None:
  print("\n## decode step (ms) without and with issue 40's processors")
  print("| shape | B | without | with | processors' share of the step |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['shape']} | {r['batch']} | {r['step_s']['without'] * 1e3:.3f} "
          f"| {r['step_s']['with'] * 1e3:.3f} | {100 * r['share']:.1f}% |")


def bench_embedded(batches, new_tokens, sampler_config):
  model, tokenizer = load_embedded()
  prompt = tokenizer.encode("KING LEAR.\nBlow, winds, and crack").ids
  rows = []
  for batch in batches:
    params = js.SamplingParams.make(batch, temperature=0.8, top_p=0.9)
    keys = jax.random.split(jax.random.key(0), batch)
    run = lambda: jax.block_until_ready(serve_loop.generate(
        model, [prompt] * batch, params=params, keys=keys,
        max_new_tokens=new_tokens, config=sampler_config))
    run()
    start = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - start
    tokens = int(np.sum(out.num_tokens))
    rows.append({"batch": batch, "tokens": tokens, "seconds": seconds,
                 "tokens_per_s": tokens / seconds})
    print(json.dumps({"embedded": rows[-1]}), flush=True)
  return rows


def report(embedded, steps_rows) -> None:
  print("\n## generate, embedded model")
  print("| B | tokens | s | tokens/s |\n|---|---|---|---|")
  for r in embedded:
    print(f"| {r['batch']} | {r['tokens']} | {r['seconds']:.3f} | "
          f"{r['tokens_per_s']:.0f} |")
  print("\n## decode step (ms) and sampler share of the step")
  print("| shape | B | " + " | ".join(CHOOSERS) + " |")
  print("|---|---|" + "---|" * len(CHOOSERS))
  for r in steps_rows:
    base = r["step_s"]["argmax"]
    cells = [f"{r['step_s'][c] * 1e3:.3f}" + (
        "" if c == "argmax" else
        f" ({100 * (r['step_s'][c] - base) / r['step_s'][c]:+.1f}%)")
             for c in CHOOSERS]
    print(f"| {r['shape']} | {r['batch']} | " + " | ".join(cells) + " |")
  print("\n## sampler alone on the step's logits (us) and share of its step")
  print("| shape | B | " + " | ".join(CHOOSERS) + " | floor |")
  print("|---|---|" + "---|" * (len(CHOOSERS) + 1))
  for r in steps_rows:
    cells = [f"{r['sampler_alone_us'][c]:.1f} "
             f"({100 * r['sampler_alone_us'][c] * 1e-6 / r['step_s'][c]:.2f}%)"
             for c in CHOOSERS]
    print(f"| {r['shape']} | {r['batch']} | " + " | ".join(cells) +
          f" | {100 * r['floor']:.2f}% |")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxsample.bench decode",
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--tiny", action="store_true",
                      help="tiny shapes and batches (a CPU check of the script)")
  parser.add_argument("--shapes", nargs="*", default=None,
                      help=f"subset of {list(SHAPES)} (default: all)")
  parser.add_argument("--steps", type=int, default=20,
                      help="timed decode steps per chooser")
  parser.add_argument("--iters", type=int, default=20,
                      help="calls per block when timing a sampler alone")
  parser.add_argument("--new-tokens", type=int, default=128,
                      help="max new tokens per request for the embedded model")
  parser.add_argument("--skip-embedded", action="store_true")
  parser.add_argument("--processors", action="store_true",
                      help="time the step with issue 40's processors against "
                      "the same step without (module doc); default shape "
                      "qwen2.5-0.5b")
  parser.add_argument("--history", type=int, default=1024,
                      help="--processors: output tokens the penalties count")
  parser.add_argument("--num-top", type=int, default=5,
                      help="--processors: top-n raw logprobs")
  parser.add_argument("--rounds", type=int, default=5,
                      help="--processors: alternating timed blocks per variant")
  parser.add_argument("--json", help="also write the results to this file")
  args = parser.parse_args(argv)
  shapes = TINY_SHAPES if args.tiny else SHAPES
  chosen = args.shapes
  if chosen is None and args.processors and not args.tiny:
    chosen = ["qwen2.5-0.5b"]
  shapes = {k: v for k, v in shapes.items() if chosen is None or k in chosen}
  batches = (2, 4) if args.tiny else (64, 128)
  embedded_batches = (1, 8) if args.tiny else (1, 8, 64)
  new_tokens = 16 if args.tiny else args.new_tokens
  sampler_config = js.SamplerConfig()
  print(f"jaxsample {js.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}); sampler implementation auto")
  if args.processors:
    steps, rounds, history = ((min(args.steps, 4), min(args.rounds, 2),
                               min(args.history, 16)) if args.tiny else
                              (args.steps, args.rounds, args.history))
    rows = [r for name, config in shapes.items() for r in bench_processing(
        name, config, batches, steps, rounds, sampler_config, history,
        args.num_top)]
    report_processing(rows)
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind,
                   "processing": rows}, f, indent=2)
    return 0
  embedded = [] if args.skip_embedded else bench_embedded(
      embedded_batches, new_tokens, sampler_config)
  rows = []
  for name, config in shapes.items():
    t0 = time.perf_counter()
    rows += bench_shape(name, config, batches, args.steps, sampler_config,
                        args.iters)
    print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
  report(embedded, rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "embedded": embedded,
                 "steps": rows}, f, indent=2)
  return 0
