"""Times Gumbel-kernel launch plans with tail splits and load prefetch depths.

``PYTHONPATH=. python3 scripts/sweep_tail.py [--batch ...] [--variants ...]``
prints device time per call (``jaxsample.bench.time_op``, median) of the
tokens of ``combine_partials(gumbel_partials(...))`` on randn rows (V =
151936, T = 0.7), for each variant ``DEPTH:TAIL:TAIL_STEPS``: loads issued
``DEPTH`` loop steps ahead (``common._PREFETCH``), and about a ``TAIL``
fraction of each row's tiles moved from the long splits into splits of
``TAIL_STEPS`` tiles launched after them (``KernelPlan.tail_splits``), with
``same`` = tokens equal to the first variant's.
"""
import argparse
import sys

import jax
import jax.numpy as jnp

import jaxsample as js
from jaxsample import bench, rng
from jaxsample.pallas import common, gumbel


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", default="32,128,256,512,640")
  parser.add_argument("--dtypes", default="float32")
  parser.add_argument("--variants",
                      default="1:0:1,2:0:1,1:0.2:1,1:0.35:1,1:0.5:1,1:0.2:2,"
                      "2:0.2:1,2:0.35:1")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--iters", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  vocab = args.vocab
  bandwidth = bench.measure_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
  variants = [tuple(float(f) for f in v.split(":"))
              for v in args.variants.split(",")]
  cfg = js.SamplerConfig(implementation="pallas")
  for dtype in args.dtypes.split(","):
    for batch in (int(b) for b in args.batch.split(",")):
      params = js.SamplingParams.make(batch, temperature=0.7)
      streams, _ = rng.row_streams(jax.random.key(1), None, batch, vocab)
      inputs = bench.rotating_inputs(batch, vocab, jnp.dtype(dtype))
      floor = batch * vocab * jnp.dtype(dtype).itemsize / bandwidth * 1e6
      want = None
      for depth, tail, tail_steps in variants:
        common._PREFETCH = int(depth)  # pylint: disable=protected-access
        common._TAIL_FRACTION = tail  # pylint: disable=protected-access
        common._TAIL_STEPS = int(tail_steps)  # pylint: disable=protected-access
        plan = common.make_plan(batch, vocab, dtype, cfg, generator="philox",
                                tail=True)
        tokens = jax.jit(lambda x: gumbel.combine_partials(
            gumbel.gumbel_partials(x, params.temperature, streams, cfg))[0])
        got = jax.block_until_ready(tokens(inputs[0]))
        want = got if want is None else want
        r = bench.time_op(tokens, inputs, args.iters, args.repeats)
        kernel = max(r.get("kernel_us", {"?": 0.0}).values())
        print(f"{dtype:8s} B={batch:4d} depth={int(depth)} tail={tail:4.2f}x"
              f"{int(tail_steps)} plan={plan.num_splits}x{plan.steps}"
              f"+{plan.tail_splits}x{plan.tail_steps} {r['us']:7.1f} us "
              f"(kernel {kernel:6.1f}) x_floor {r['us'] / floor:5.2f} "
              f"same {bool(jnp.all(got == want))}", flush=True)
      del inputs
  return 0


if __name__ == "__main__":
  sys.exit(main())
