"""Gumbel kernel: Philox products by mul.wide (default) or mul.hi + mul.lo
(``common._MUL_PAIR``), at several programs per SM; device us, randn, T = 0.7.

``PYTHONPATH=. python3 scripts/sweep_mul.py`` (variants ``PAIR:PER_SM``)."""
import sys

import jax
import jax.numpy as jnp

import jaxsample as js
from jaxsample import bench, rng
from jaxsample.pallas import common, gumbel

VARIANTS = [(0, 15), (1, 15), (1, 20), (1, 24), (0, 20)]


def main():
  vocab = 151936
  bandwidth = bench.measure_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
  for dtype in ("float32", "bfloat16"):
    for batch in ((32, 128, 256, 512) if dtype == "float32" else (128,)):
      params = js.SamplingParams.make(batch, temperature=0.7)
      streams, _ = rng.row_streams(jax.random.key(1), None, batch, vocab)
      inputs = bench.rotating_inputs(batch, vocab, jnp.dtype(dtype))
      floor = batch * vocab * jnp.dtype(dtype).itemsize / bandwidth * 1e6
      want = None
      for pair, per_sm in VARIANTS:
        common._MUL_PAIR = bool(pair)
        common._PROGRAMS_PER_SM[1] = per_sm
        common._ONE_WARP_RESIDENT = max(16, per_sm + 1)
        cfg = js.SamplerConfig(implementation="pallas")
        plan = common.make_plan(batch, vocab, dtype, cfg, generator="philox")
        tokens = jax.jit(lambda x: gumbel.combine_partials(
            gumbel.gumbel_partials(x, params.temperature, streams, cfg))[0])
        got = jax.block_until_ready(tokens(inputs[0]))
        want = got if want is None else want
        r = bench.time_op(tokens, inputs, 32, 3)
        kernel = max(r.get("kernel_us", {"?": 0.0}).values())
        print(f"{dtype:8s} B={batch:4d} mul_pair={pair} per_sm={per_sm:2d} "
              f"splits={plan.num_splits:3d} {r['us']:7.1f} us (kernel "
              f"{kernel:6.1f}) x_floor {r['us'] / floor:5.2f} same "
              f"{bool(jnp.all(got == want))}", flush=True)
      del inputs


if __name__ == "__main__":
  sys.exit(main())
