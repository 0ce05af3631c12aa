"""The main job (for now): sample from synthetic logits with per-request settings.

``python -m jaxsample.demo`` builds a batch of Zipf-like logits, runs a few
jitted decode-style steps with per-request keys and positions and prints each
request's settings, tokens, logprobs and validity, then the time per step.
Runs on CPU (the XLA path) or GPU (the Pallas kernels).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js

REQUESTS = [  # (name, temperature, top_k, top_p, min_p)
    ("greedy", 0.0, 0, 1.0, 0.0),
    ("plain T=1", 1.0, 0, 1.0, 0.0),
    ("cool T=0.7", 0.7, 0, 1.0, 0.0),
    ("top-k 50", 1.0, 50, 1.0, 0.0),
    ("top-p 0.9", 0.8, 0, 0.9, 0.0),
    ("top-k 20 + top-p 0.95", 0.9, 20, 0.95, 0.0),
    ("min-p 0.1", 1.0, 0, 1.0, 0.1),
    ("hot T=1.5 min-p 0.05", 1.5, 0, 1.0, 0.05),
]


def synthetic_logits(key, batch: int, vocab: int) -> jax.Array:
  """Zipf-like rows: a random permutation of ``-1.1 * log(rank)`` plus noise."""
  keys = jax.random.split(key, batch)
  ranks = jnp.arange(1, vocab + 1, dtype=jnp.float32)
  base = -1.1 * jnp.log(ranks)
  rows = [jax.random.permutation(k, base) for k in keys]
  noise = 0.3 * jax.random.normal(key, (batch, vocab))
  return jnp.stack(rows) + noise


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--implementation", default="auto",
                      choices=["auto", "pallas", "xla"])
  parser.add_argument("--rng", default="philox", choices=["philox", "threefry"])
  args = parser.parse_args(argv)

  names, temps, ks, ps, mps = zip(*REQUESTS)
  batch = len(REQUESTS)
  params = js.SamplingParams.make(batch, temperature=temps, top_k=ks,
                                  top_p=ps, min_p=mps)
  config = js.SamplerConfig(implementation=args.implementation, rng=args.rng)
  request_keys = jax.random.split(jax.random.key(args.seed), batch)

  @jax.jit
  def step(logits, positions):
    return js.sample(logits, params, request_keys, positions=positions,
                     config=config)

  print(f"jaxsample {js.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), implementation={args.implementation}, "
        f"rng={args.rng}, B={batch}, V={args.vocab}")
  logits = synthetic_logits(jax.random.key(args.seed + 1), batch, args.vocab)
  positions = jnp.zeros((batch,), jnp.int32)
  jax.block_until_ready(step(logits, positions))  # compile
  times, history = [], []
  for _ in range(args.steps):
    start = time.perf_counter()
    result = jax.block_until_ready(step(logits, positions))
    times.append(time.perf_counter() - start)
    history.append(jax.device_get(result))
    positions = positions + 1
  print(f"{'request':24s} {'tokens':>34s}  {'logprobs':>36s} valid")
  for b, name in enumerate(names):
    tokens = " ".join(f"{int(h.tokens[b]):7d}" for h in history)
    logprobs = " ".join(f"{float(h.logprobs[b]):8.3f}" for h in history)
    valid = all(bool(h.valid[b]) for h in history)
    print(f"{name:24s} {tokens:>34s}  {logprobs:>36s} {valid}")
  print(f"time per step (jitted, host-timed, {args.steps} steps): median "
        f"{np.median(times) * 1e3:.3f} ms")
  return 0


if __name__ == "__main__":
  sys.exit(main())
