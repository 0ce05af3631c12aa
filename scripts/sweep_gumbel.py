"""Times variants of the Gumbel kernel on the GPU: before/after, tile skip, plans.

``PYTHONPATH=. python3 scripts/sweep_gumbel.py [--baseline PATH]`` prints device
time per call (profiler-summed kernel time, median; ``jaxsample.bench.time_op``)
of ``combine_partials(gumbel_partials(...))`` (tokens only), for the logit
distributions of ``jaxsample.bench`` (randn: no tile can be skipped; llm: bulk
plus a few head tokens), with the fraction of RNG tiles that drew random bits
(``raced``).  Variants: ``baseline`` (another ``gumbel.py``, e.g. the previous
commit's, loaded from ``--baseline``), ``default`` (chunk filter only),
and ``skip`` (``gumbel.TILE_SKIP``), each with the
default plan unless ``splits`` says otherwise.
"""
import argparse
import importlib.util
import itertools
import sys

import jax
import jax.numpy as jnp

import jaxsample as js
from jaxsample import bench, rng
from jaxsample.pallas import common, gumbel


def load_module(path):
  spec = importlib.util.spec_from_file_location("gumbel_baseline", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--baseline", default="")
  parser.add_argument("--batch", default="1,8,32,128,512")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--iters", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--no-plans", dest="plans", action="store_false",
                      help="only the default plans at --batch, fp32")
  parser.add_argument("--splits", default="",
                      help="splits per row to time at every --batch (fp32), "
                      "in place of the built-in plans")
  args = parser.parse_args(argv)
  baseline = load_module(args.baseline) if args.baseline else None
  vocab = args.vocab
  bandwidth = bench.measure_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
  cases = [("float32", int(b), None) for b in args.batch.split(",")]
  if args.splits:
    cases += [("float32", int(b), int(n)) for b in args.batch.split(",")
              for n in args.splits.split(",")]
  elif args.plans:  # other dtypes and plans at a few batch sizes
    cases += [("bfloat16", 128, None), ("float32", 128, 2), ("float32", 128, 8),
              ("float32", 32, 26), ("float32", 512, 2)]
  for dtype, batch, splits in cases:
    params = js.SamplingParams.make(batch, temperature=0.7)
    streams, _ = rng.row_streams(jax.random.key(1), None, batch, vocab)
    cfg = js.SamplerConfig(implementation="pallas", num_splits=splits)
    plan = common.make_plan(batch, vocab, dtype, cfg, generator="philox")
    variants = {}
    if baseline is not None and splits is None:
      variants["baseline"] = (baseline, {})
    variants["default"] = (gumbel, dict(tile_skip=False))
    variants["skip"] = (gumbel, dict(tile_skip=True))
    fns = {}
    dummy = jnp.zeros((batch, vocab), jnp.dtype(dtype))
    for name, (module, flags) in variants.items():
      with gumbel.options(**flags):  # read while tracing: trace here
        partials = jax.jit(lambda x, m=module: m.gumbel_partials(
            x, params.temperature, streams, cfg))
        tokens = jax.jit(lambda x, m=module: m.combine_partials(
            m.gumbel_partials(x, params.temperature, streams, cfg))[0])
        jax.block_until_ready((tokens(dummy), partials(dummy)))
      fns[name] = (tokens, partials)
    floor = batch * vocab * jnp.dtype(dtype).itemsize / bandwidth * 1e6
    for dist in bench.DISTS:
      inputs = bench.rotating_inputs(batch, vocab, jnp.dtype(dtype), dist=dist)
      want = None
      for name, (tokens, partials) in fns.items():
        got = tokens(inputs[0])
        if want is None:
          want = got
        same = bool(jnp.all(got == want))
        r = bench.time_op(tokens, inputs, args.iters, args.repeats)
        p = partials(inputs[0])
        raced = ""
        if hasattr(p, "raced_tiles"):
          tiles = batch * -(-vocab // rng.PHILOX_TILE)
          raced = f"{float(jnp.sum(p.raced_tiles)) / tiles:.3f}"
        print(f"{dtype:8s} {dist:5s} B={batch:4d} splits={plan.num_splits:3d}x"
              f"{plan.steps:<3d} {name:8s} {r['us']:8.1f} us  x_floor "
              f"{r['us'] / floor:5.2f}  raced {raced:5s} same_tokens {same}",
              flush=True)
      del inputs
  return 0


if __name__ == "__main__":
  sys.exit(main())
