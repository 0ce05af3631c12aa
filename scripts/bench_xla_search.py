"""CPU benchmark of the sorting-free XLA path (``implementation="xla_search"``).

Per shape, row kind and setting, the median wall-clock time of one jitted
call (params traced, a fresh key per call) of:

* ``xla_search``: ``jaxsample.sample`` on the sorting-free path;
* ``xla_sort``: ``jaxsample.sample`` on the sort-based reference
  (``implementation="xla"``);
* ``top_k+cat``: ``lax.top_k(y, 50)`` and ``jax.random.categorical`` over
  the 50 values (the yardstick of issue 36);
* ``categorical``: ``jax.random.categorical`` over the whole row (what plain
  sampling costs in JAX).

The implementations are interleaved in each repeat (the machine may be
shared), and the search path's tokens are checked against the reference's on
every call that both make.  Row kinds: ``llm`` (``3 * randn`` plus heads at
25, 24.5 and 22: the issue's rows), ``flat`` (``randn``: large kept sets).

  PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/bench_xla_search.py \\
      --out benchmarks/results/DATE-cpu-xla-search/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample
from jaxsample import SamplerConfig, SamplingParams

SETTINGS = {
    "top_k50_top_p0.9": dict(top_k=50, top_p=0.9),
    "top_p0.95": dict(top_p=0.95),
    "min_p0.05": dict(min_p=0.05),
    "plain": dict(),
}
HEADS = (25.0, 24.5, 22.0)


def rows(kind: str, batch: int, vocab: int, seed: int) -> jax.Array:
  r = np.random.default_rng(seed)
  if kind == "flat":
    return jnp.asarray(r.standard_normal((batch, vocab)), jnp.float32)
  x = r.standard_normal((batch, vocab)) * 3
  for b in range(batch):
    x[b, r.choice(vocab, len(HEADS), replace=False)] = HEADS
  return jnp.asarray(x, jnp.float32)


def top_k_categorical(x, params, key):
  """The yardstick: ``lax.top_k(x, 50)`` and a categorical draw among them."""
  del params
  values, ids = jax.lax.top_k(x, 50)
  choice = jax.random.categorical(key, values)
  return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]


def samplers():
  sample = lambda impl: jax.jit(lambda x, p, key: jaxsample.sample(
      x, p, key, config=SamplerConfig(implementation=impl)).tokens)
  return {"xla_search": sample("xla_search"), "xla_sort": sample("xla"),
          "top_k+cat": jax.jit(top_k_categorical),
          "categorical": jax.jit(lambda x, p, key: jax.random.categorical(
              key, x))}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default="8x32000,64x151936")
  parser.add_argument("--kinds", default="llm,flat")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--sort-repeats", type=int, default=3,
                      help="repeats of xla_sort (seconds a call at B = 64)")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.default_backend()}, "
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
        f", load {os.getloadavg()}", flush=True)
  fns = samplers()
  records = []
  for shape in args.shapes.split(","):
    batch, vocab = map(int, shape.split("x"))
    for kind in args.kinds.split(","):
      x = rows(kind, batch, vocab, seed=batch + vocab)
      for setting, kw in SETTINGS.items():
        params = SamplingParams.make(batch, **kw)
        times = {name: [] for name in fns}
        mismatches = checked = 0
        for fn in fns.values():  # compiled and warm
          jax.block_until_ready(fn(x, params, jax.random.key(-1)))
        for rep in range(args.repeats):
          key = jax.random.key(rep)
          tokens = {}
          for name, fn in fns.items():
            if name == "xla_sort" and rep >= args.sort_repeats:
              continue
            start = time.perf_counter()
            tokens[name] = np.asarray(jax.block_until_ready(
                fn(x, params, key)))
            times[name].append((time.perf_counter() - start) * 1e3)
          if "xla_sort" in tokens:
            checked += batch
            mismatches += int(np.sum(tokens["xla_sort"] !=
                                     tokens["xla_search"]))
        medians = {n: statistics.median(t) for n, t in times.items()}
        line = "  ".join(f"{n} {m:9.2f}" for n, m in medians.items())
        ratio = medians["xla_search"] / medians["top_k+cat"]
        print(f"B={batch:3d} V={vocab:6d} {kind:5s} {setting:17s} {line} ms"
              f"  search/top_k+cat {ratio:5.2f}x  tokens differ "
              f"{mismatches}/{checked}", flush=True)
        records.append(dict(batch=batch, vocab=vocab, kind=kind,
                            setting=setting, median_ms=medians,
                            times_ms=times, token_mismatches=mismatches,
                            tokens_checked=checked))
  with open(args.out, "w") as f:
    json.dump(dict(jax=jax.__version__, cpus=os.cpu_count(),
                   records=records), f, indent=1)


if __name__ == "__main__":
  main()
