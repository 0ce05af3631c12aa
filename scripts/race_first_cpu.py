"""CPU time per call of ``sample`` without logprobs: race first against a
backend's own route, interleaved in one process (``docs/truncation.md``,
*Race first*).

    PYTHONPATH=. JAX_PLATFORMS=cpu nice -n 10 python scripts/race_first_cpu.py \\
        --batch 8 --vocab 32000 --dist llm --implementation xla_search

``implementation`` with logprobs (its threshold route) against
``logprobs=False`` at ``race_candidates`` 4 and 1, forced to race first
(``--implementation xla`` races first by default; ``xla_search`` keeps its
route, so this script calls ``race_first.sample`` with its fallback).
"""

from __future__ import annotations

import argparse
import time

import jax

import jaxsample
from jaxsample import SamplerConfig, SamplingParams, race_first, rng
from jaxsample.bench import cases


def _race_first(params, implementation: str, candidates: int):
  """Race-first tokens with ``implementation``'s route as the fallback."""
  config = SamplerConfig(implementation=implementation)

  def run(x, key):
    batch, vocab = x.shape
    canon = params.canonical(vocab)
    streams, _ = rng.row_streams(key, None, batch, vocab)
    return race_first.sample(
        x, canon, streams, generator=config.rng, candidates=candidates,
        fallback=lambda _: jaxsample.sample(x, params, key,
                                            config=config).tokens).tokens

  return jax.jit(run)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--dist", default="llm", choices=cases.DISTS)
  parser.add_argument("--implementation", default="xla_search",
                      choices=("xla", "xla_search"))
  parser.add_argument("--settings", default="plain,top_p0.95,"
                      "top_k50+top_p0.9,min_p0.05")
  parser.add_argument("--rounds", type=int, default=6)
  args = parser.parse_args()
  inputs = [cases.make_logits(jax.random.key(i), args.batch, args.vocab,
                              args.dist) for i in range(4)]
  for setting in args.settings.split(","):
    params = SamplingParams.make(args.batch, temperature=0.8,
                                 **cases.SETTINGS[setting])
    config = SamplerConfig(implementation=args.implementation)
    ops = {args.implementation: jax.jit(
        lambda x, k: jaxsample.sample(x, params, k, config=config).tokens)}
    for m in (4, 1):
      ops[f"race first M={m}"] = _race_first(params, args.implementation, m)
    for op in ops.values():
      for x in inputs:
        op(x, jax.random.key(0)).block_until_ready()
    seconds = dict.fromkeys(ops, 0.0)
    for r in range(args.rounds):
      for name, op in ops.items():
        start = time.process_time()
        for i, x in enumerate(inputs):
          op(x, jax.random.key(10 * r + i)).block_until_ready()
        seconds[name] += time.process_time() - start
    calls = args.rounds * len(inputs)
    print(f"B={args.batch} V={args.vocab} {args.dist} {setting}: " + ", ".join(
        f"{name} {1e3 * s / calls:.2f} ms" for name, s in seconds.items()),
          flush=True)


if __name__ == "__main__":
  main()
