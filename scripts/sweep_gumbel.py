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
  sys.modules[spec.name] = module  # dataclasses look their module up there
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
  parser.add_argument("--dtypes", default="float32,bfloat16",
                      help="dtypes of the --warps cases")
  parser.add_argument("--no-skip", dest="skip", action="store_false",
                      help="leave out the tile-skip variant")
  parser.add_argument("--warps", default="",
                      help="warps per program to time at every --batch (fp32 "
                      "and bf16, default splits or each of --splits), in "
                      "place of the built-in plans")
  args = parser.parse_args(argv)
  baseline = load_module(args.baseline) if args.baseline else None
  vocab = args.vocab
  bandwidth = bench.measure_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
  batches = [int(b) for b in args.batch.split(",")]
  splits_list = [int(n) for n in args.splits.split(",")] if args.splits else []
  cases = [("float32", b, None, None) for b in batches]
  if args.warps:
    cases += [(dtype, b, n, int(w)) for w in args.warps.split(",")
              for dtype in args.dtypes.split(",") for b in batches
              for n in splits_list or [None]]
  elif args.splits:
    cases += [("float32", b, n, None) for b in batches for n in splits_list]
  elif args.plans:  # other dtypes and plans at a few batch sizes
    cases += [("bfloat16", 128, None, None), ("float32", 128, 2, None),
              ("float32", 128, 8, None), ("float32", 32, 26, None),
              ("float32", 512, 2, None)]
  for dtype, batch, splits, warps in cases:
    params = js.SamplingParams.make(batch, temperature=0.7)
    streams, _ = rng.row_streams(jax.random.key(1), None, batch, vocab)
    cfg = js.SamplerConfig(implementation="pallas", num_splits=splits,
                           num_warps=warps)
    plan = common.make_plan(batch, vocab, dtype, cfg, generator="philox")
    variants = {}
    if baseline is not None and splits is None and warps is None:
      variants["baseline"] = (baseline, {})
    variants["default"] = (gumbel, dict(tile_skip=False))
    if args.skip:
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
              f"{plan.steps:<3d} warps={plan.num_warps} {name:8s} {r['us']:8.1f} us  x_floor "
              f"{r['us'] / floor:5.2f}  raced {raced:5s} same_tokens {same}",
              flush=True)
      del inputs
  return 0


if __name__ == "__main__":
  sys.exit(main())
