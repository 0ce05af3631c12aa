"""extract_sampling_mask on the kernels (the kept sets, ``threshold.kept_sets``
with the ids by probability and every set measured, then
``sampling.kept_set_masks``) against the sampler's mask (``sample(...,
return_mask=True)`` on zero keys, its route until 2026-11-26), device time.

    PYTHONPATH=. python3 scripts/bench_extract.py [--batch 1,32,128] [--caps 64,1024]
"""
import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js
from jaxsample import bench

SETTINGS = {"top_k50+top_p0.9": dict(top_k=50, top_p=0.9),
            "top_p0.95": dict(top_p=0.95)}


def sampler_route(x, params, config):
  return js.sample(x, params, jnp.zeros((x.shape[0], 2), jnp.uint32),
                   return_mask=True, config=config)[1]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", default="1,32,128")
  parser.add_argument("--caps", default="64,1024")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--iters", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  print(f"# device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
  for batch in [int(b) for b in args.batch.split(",")]:
    inputs = [jax.random.normal(jax.random.key(i), (batch, args.vocab))
              for i in range(4)]
    for name, setting in SETTINGS.items():
      params = js.SamplingParams.make(batch, temperature=1.0, **setting)
      for cap in [int(c) for c in args.caps.split(",")]:
        config = js.SamplerConfig(implementation="pallas", max_mask_ids=cap)
        routes = {
            "extract_sampling_mask": jax.jit(
                lambda x, p: js.extract_sampling_mask(x, p, config=config)),
            "sample's mask, zero keys": jax.jit(
                lambda x, p: sampler_route(x, p, config)),
        }
        masks = [fn(inputs[0], params) for fn in routes.values()]
        same = all(np.array_equal(np.asarray(getattr(masks[0], f)),
                                  np.asarray(getattr(masks[1], f)))
                   for f in ("ids", "count", "truncated", "overflow"))
        for label, fn in routes.items():
          us = bench.time_op(lambda x, fn=fn: fn(x, params), inputs,
                             args.iters, args.repeats)["us"]
          print(f"{label:28s} {name:17s} B={batch:4d} K_cap={cap:5d} "
                f"{us:8.1f} us  ids/count/flags equal: {same}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
