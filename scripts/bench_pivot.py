"""Device time of ``threshold.pivot_threshold`` (the fallback of large kept
sets), every row active and idle, by count and by mass.

    PYTHONPATH=. python3 scripts/bench_pivot.py [--batch 1,32,128] [--warps 8]

Rows: randn logits (x1), floor -inf, top-k V / 2 (by count) and top-p 0.9
(by mass): every pass runs (keys resolve only after the last pass).
``idle``: no row active (what a batch without large kept sets pays).
Run it with ``PYTHONPATH`` at another checkout to compare implementations;
``--warps`` (a list) sets ``SamplerConfig.num_warps`` (default: the module's).
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

from jaxsample import SamplerConfig, SamplingParams, bench
from jaxsample.pallas import threshold


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", default="1,32,128")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--iters", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warps", default="0", help="0: the module's default")
  args = parser.parse_args()
  print(f"# {jax.devices()[0].device_kind}; V = {args.vocab}; device us")
  print("| B | warps | search | rows | device us |")
  print("|---|---|---|---|---|")
  for batch in [int(b) for b in args.batch.split(",")]:
    xs = [jax.random.normal(jax.random.key(i), (batch, args.vocab))
          for i in range(2)]
    params = SamplingParams.make(batch, top_k=args.vocab // 2,
                                 top_p=0.9).canonical(args.vocab)
    floor = jnp.full((batch,), -jnp.inf)
    row_max = jnp.full((batch,), 8.0)  # above every x (max ~4.5)
    for warps, by_count, rows in itertools.product(
        [int(w) for w in args.warps.split(",")], (True, False),
        ("active", "idle")):
      active = jnp.full((batch,), rows == "active")
      config = SamplerConfig(num_warps=warps or None)
      fn = jax.jit(lambda x, active=active, by_count=by_count, config=config:
                   threshold.pivot_threshold(x, params, active, floor,
                                             row_max, config,
                                             by_count=by_count))
      timing = bench.time_op(fn, xs, args.iters, args.repeats)
      name = "count" if by_count else "mass"
      print(f"| {batch} | {warps or 'default'} | {name} | {rows} | "
            f"{timing.get('device_us', float('nan')):.1f} |", flush=True)


if __name__ == "__main__":
  main()
