"""Times the Gumbel kernel over launch plans (warps, splits, stages) on the GPU.

``PYTHONPATH=. python3 scripts/sweep_gumbel.py`` prints device time per call
(profiler-summed kernel time, median) for each plan, to tune ``make_plan``.
"""
import itertools
import sys

import jax
import jax.numpy as jnp

import jaxsample as js
from jaxsample import bench


def main() -> int:
  vocab = 151936
  bandwidth = bench.measure_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
  for dtype, batch in itertools.product(["float32", "bfloat16"], [1, 32, 128, 256, 512]):
    inputs = bench.rotating_inputs(batch, vocab, jnp.dtype(dtype))
    floor = batch * vocab * jnp.dtype(dtype).itemsize / bandwidth * 1e6
    params = js.SamplingParams.make(batch, temperature=0.7)
    key = jax.random.key(1)
    splits = [None, 16, 38] if batch <= 32 else [None, 2, 4, 8]
    for warps, stages, split in itertools.product([4, 8], [1], splits):
      cfg = js.SamplerConfig(implementation="pallas", num_warps=warps,
                             num_stages=stages, num_splits=split)
      fn = jax.jit(lambda x, cfg=cfg: js.sample(x, params, key, config=cfg).tokens)
      r = bench.time_op(fn, inputs, iters=32, repeats=3)
      print(f"{dtype:8s} B={batch:4d} warps={warps:2d} stages={stages} "
            f"splits={str(split):4s} {r['us']:8.1f} us  x_floor {r['us'] / floor:5.2f}",
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
