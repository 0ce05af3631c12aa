"""Times Gumbel-kernel launch plans with claimed steps (``common.Claims``).

``PYTHONPATH=. python3 scripts/sweep_claims.py [--batch ...] [--variants ...]``
prints device time per call (``jaxsample.bench.time_op``, median) of the
tokens of ``combine_partials(gumbel_partials(...))`` on randn rows (V =
151936, T = 0.7) for each variant ``CLAIMS:AHEAD:SPLITS``: 1-warp plans
whose programs take their steps from the row's counter (``CLAIMS`` 1) or
walk a split each (0), claims ``AHEAD`` steps ahead of the loads, ``SPLITS``
programs per row (0: the default plan); ``same`` = tokens equal to the
first variant's.
"""
import argparse
import sys

import jax
import jax.numpy as jnp

import jaxsample as js
from jaxsample import bench, rng
from jaxsample.pallas import common, gumbel


from jax._src.pallas.triton import lowering as _lowering
_ACQ_REL = _lowering._atomic_rmw


def relaxed(on: bool):
  """Atomics lowered with relaxed (on) or acq_rel (off) semantics."""
  def relaxed_rmw(op, ptr, val, mask=None, **kw):
    return _ACQ_REL(op, ptr, val, mask=mask,
                    semantic=_lowering.tt_dialect.MemSemantic.RELAXED)
  _lowering._atomic_rmw = relaxed_rmw if on else _ACQ_REL


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", default="32,128,256,512,640")
  parser.add_argument("--dtypes", default="float32")
  parser.add_argument("--variants",
                      default="0:2:0,1:2:0,1:1:0,1:3:0")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--iters", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  vocab = args.vocab
  bandwidth = bench.measure_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
  variants = [tuple(float(f) for f in v.split(":"))
              for v in args.variants.split(",")]
  for dtype in args.dtypes.split(","):
    for batch in (int(b) for b in args.batch.split(",")):
      params = js.SamplingParams.make(batch, temperature=0.7)
      streams, _ = rng.row_streams(jax.random.key(1), None, batch, vocab)
      inputs = bench.rotating_inputs(batch, vocab, jnp.dtype(dtype))
      floor = batch * vocab * jnp.dtype(dtype).itemsize / bandwidth * 1e6
      want = None
      for claims, ahead, splits, *lanes_per_sm in variants:
        lanes, per_sm = (lanes_per_sm + [128, 15])[:2]
        common._WARP_LANES = int(lanes)
        common._PROGRAMS_PER_SM[1] = int(per_sm)
        common._ONE_WARP_RESIDENT = max(16, int(per_sm) + 1)
        common.CLAIMS, common.CLAIMS_AHEAD = bool(claims), int(ahead)
        common.CLAIM_ORDER = ("atomic", "interleaved", "contiguous", "atomic")[
            max(int(claims) - 1, 0)]
        relaxed(int(claims) == 4)
        cfg = js.SamplerConfig(implementation="pallas",
                               num_splits=int(splits) or None)
        plan = common.make_plan(batch, vocab, dtype, cfg, generator="philox",
                                claimable=True)
        common.CLAIM_SPAN = plan.steps * plan.lane_groups
        tokens = jax.jit(lambda x: gumbel.combine_partials(
            gumbel.gumbel_partials(x, params.temperature, streams, cfg))[0])
        got = jax.block_until_ready(tokens(inputs[0]))
        want = got if want is None else want
        r = bench.time_op(tokens, inputs, args.iters, args.repeats)
        kernel = max(r.get("kernel_us", {"?": 0.0}).values())
        print(f"{dtype:8s} B={batch:4d} claimed={int(claims)} ahead="
              f"{int(ahead)} splits={plan.num_splits:3d} lanes={plan.chunk} "
              f"{r['us']:7.1f} us "
              f"(kernel {kernel:6.1f}) x_floor {r['us'] / floor:5.2f} "
              f"same {bool(jnp.all(got == want))}", flush=True)
      del inputs
  return 0


if __name__ == "__main__":
  sys.exit(main())
