"""Device time of truncated sampling with FP64 Gumbel noise.

``PYTHONPATH=. python3 scripts/bench_fp64_truncation.py [--batch 1,32,128]
[--settings top_k50+top_p0.9,top_p0.9] [--mask-caps 1024] [--iters 20]
[--repeats 3]``

Per (B, setting), fp32 logits ``[B, 151936]`` (``2 N(0, 1)``, rotating
buffers > 2x the L2), temperature 0.7, one batch key, ``bench.time_op``
(profiler-summed GPU time per call, median over repeats):

* ``pallas fp64``: ``sample(use_fp64_gumbel=True)`` on the kernels (the kept
  sets' thresholds, then an FP64 race of each);
* ``pallas fp64 +mask K_cap=N`` (``--mask-caps``): the same with
  ``return_mask=True`` and ``max_mask_ids=N`` (tokens and mask returned);
* ``pallas fp32``: the same with FP32 noise;
* ``xla fp64``: the sort-based XLA reference with FP64 noise.

The FP64 ops are jitted and called under ``jax.enable_x64(True)``.  The HBM
floor is one read of the logits over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse

import jax

import jaxsample as js
from jaxsample import bench

SETTINGS = {
    "top_k50+top_p0.9": dict(top_k=50, top_p=0.9),
    "top_p0.9": dict(top_p=0.9),
    "min_p0.05": dict(min_p=0.05),
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", default="1,32,128")
  parser.add_argument("--settings", default="top_k50+top_p0.9,top_p0.9")
  parser.add_argument("--mask-caps", default="")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  bandwidth = bench.measure_bandwidth()
  print(f"# device: {jax.devices()[0].device_kind}, jax {jax.__version__}; "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; V={args.vocab}, "
        "fp32 logits, T=0.7")
  print(f"{'setting':18s} {'B':>4s} {'op':28s} {'us':>9s} {'floor':>7s} "
        f"{'x_floor':>7s}")
  key = jax.random.key(1)
  for batch in [int(b) for b in args.batch.split(",")]:
    inputs = bench.rotating_inputs(batch, args.vocab, jax.numpy.float32,
                                   seed=batch)
    floor_us = batch * args.vocab * 4 / bandwidth * 1e6
    for name in args.settings.split(","):
      params = js.SamplingParams.make(batch, temperature=0.7, **SETTINGS[name])
      caps = [int(c) for c in args.mask_caps.split(",") if c]
      for op, impl, fp64, cap in (
          ("pallas fp64", "pallas", True, 0),
          *((f"pallas fp64 +mask K_cap={c}", "pallas", True, c)
            for c in caps),
          ("pallas fp32", "pallas", False, 0),
          ("xla fp64", "xla", True, 0)):
        config = js.SamplerConfig(implementation=impl, use_fp64_gumbel=fp64,
                                  max_mask_ids=cap or 1024)
        jitted = jax.jit(lambda x, c=config, cap=cap: js.sample(
            x, params, key, config=c, return_mask=bool(cap)))

        def fn(x, jitted=jitted, fp64=fp64):
          with jax.enable_x64(fp64):
            return jitted(x)

        us = bench.time_op(fn, inputs, args.iters, args.repeats)["us"]
        print(f"{name:18s} {batch:4d} {op:28s} {us:9.1f} {floor_us:7.1f} "
              f"{us / floor_us:7.2f}", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
