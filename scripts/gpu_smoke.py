"""Quick GPU check: every kernel variant lowers, runs and matches the XLA reference.

Run on the GPU machine: ``PYTHONPATH=. python3 scripts/gpu_smoke.py``.
"""
import argparse
import itertools
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js
from jaxsample import bench


def main() -> int:
  print(jax.devices(), flush=True)
  failures = 0
  for gen, dtype, fp64, (batch, vocab, dist) in itertools.product(
      ["philox", "threefry"], ["float32", "bfloat16", "float16"], [False, True],
      [(4, 151936, "randn"), (513, 1007, "randn"), (1, 32000, "randn"),
       (32, 151936, "llm")]):
    if fp64 and dtype != "float32":
      continue
    # randn: 3 * N(0, 1); llm: jaxsample.bench's peaked rows.
    x = (bench.make_logits(jax.random.key(batch), batch, vocab, dist) *
         (1.5 if dist == "randn" else 1.0)).astype(dtype)
    x = x.at[0, :7].set(-jnp.inf)
    temps = np.where(np.arange(batch) % 3 == 1, 0.0, 0.6 + 0.01 * (np.arange(batch) % 50))
    params = js.SamplingParams.make(batch, temperature=temps)
    key = jax.random.key(11)
    out = {}
    t0 = time.time()
    for impl in ["pallas", "xla"]:
      cfg = js.SamplerConfig(implementation=impl, rng=gen, use_fp64_gumbel=fp64)
      fn = jax.jit(lambda x: js.sample(x, params, key, config=cfg))
      try:
        with jax.enable_x64(fp64):
          out[impl] = jax.device_get(fn(x))
      except Exception as e:  # report every variant, then fail
        where = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.line}"
                 for f in traceback.extract_tb(e.__traceback__)
                 if "jaxsample" in f.filename][-3:]
        print(f"FAIL {gen} {dtype} fp64={fp64} {batch}x{vocab} {dist} {impl}: "
              f"{type(e).__name__}: {str(e)[:500]} at {where}", flush=True)
        failures += 1
    if len(out) == 2:
      same = np.mean(out["pallas"].tokens == out["xla"].tokens)
      lp = np.max(np.abs(out["pallas"].logprobs - out["xla"].logprobs))
      ok = same == 1.0 and lp < 1e-4
      failures += not ok
      print(f"{'ok  ' if ok else 'BAD '} {gen} {dtype} fp64={fp64} {batch}x{vocab} {dist}: "
            f"token match {same:.4f}, max |dlogprob| {lp:.2e} ({time.time() - t0:.1f}s)",
            flush=True)
  print("failures:", failures)
  return 1 if failures else 0


if __name__ == "__main__":
  argparse.ArgumentParser(description=__doc__.strip().splitlines()[0]).parse_args()
  sys.exit(main())
