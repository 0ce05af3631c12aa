"""GPU sweep of the threshold searches' key bits per step (issue 49, point 1).

    OUT=/tmp/out PYTHONPATH=. python3 .stage_radix_sweep.py   # on the H200, from the repo root

For B in {1, 128, 32} (in that order), r in {1, 2, 3, 4} (`bounds.search_bits_per_step` and
`window.search_bits_per_step` both r: row_bounds, threshold_window and the
window's select are separate kernels, so one program per (B, r) gives each
kernel's time per r), V = 151936 fp32 `randn` (flat, large-set route) and
`llm` rows, T = 0.7, top-p 0.95 and top-k 50 + top-p 0.9 (params traced: one
compile per (B, r), 12 in all): `jaxsample.sample`'s device time and the three
search kernels' time per call (`jaxsample.bench.timing.time_op`, median of 5
blocks of 16 calls), and whether tokens and logprobs are bit-identical to
r = 1's.  One JSON line per (B, r, rows, setting) in $OUT/radix.jsonl, written
as it goes; it stops starting new (B, r) programs after DEADLINE_S seconds.
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js
from jaxsample import tuning
from jaxsample.bench import timing
from jaxsample.bench.cases import make_logits

# RADIX_SMOKE=1: a CPU check of the script itself (V = 4096, B = 1, r in {1, 3}).
SMOKE = os.environ.get("RADIX_SMOKE") == "1"
V = 4096 if SMOKE else 151936
BATCHES, STEPS = ((1,), (1, 3)) if SMOKE else ((1, 128, 32), (1, 2, 3, 4))
ITERS, REPEATS = (2, 1) if SMOKE else (16, 5)
DEADLINE_S = 210
SEARCH_KERNELS = ("row_bounds", "threshold_window", "select_threshold")
SETTINGS = {"top_p0.95": dict(top_p=0.95),
            "top_k50+top_p0.9": dict(top_k=50, top_p=0.9)}
start = time.perf_counter()
out = open(os.path.join(os.environ.get("OUT", "/tmp"), "radix.jsonl"), "a")


def write(record):
  print(json.dumps(record), flush=True)
  out.write(json.dumps(record) + "\n")
  out.flush()


write(dict(device=jax.devices()[0].device_kind, jax=jax.__version__))
for batch in BATCHES:
  keys = jax.random.split(jax.random.key(7), batch)
  positions = jnp.arange(batch, dtype=jnp.int32)
  rows = {dist: [make_logits(k, batch, V, dist, i) for i, k in
                 enumerate(jax.random.split(jax.random.key(11), 4))]
          for dist in ("randn", "llm")}
  first = {}  # (dist, setting) -> r = 1's (tokens, logprobs)
  for steps in STEPS:
    if time.perf_counter() - start > DEADLINE_S:
      write(dict(stopped=f"deadline before B={batch} r={steps}"))
      break
    config = js.SamplerConfig(implementation="pallas", tuning=tuning.overriding(
        {"bounds.search_bits_per_step": steps,
         "window.search_bits_per_step": steps}))
    fn = jax.jit(lambda x, p, config=config: js.sample(
        x, p, keys, positions=positions, config=config))
    program_start = time.perf_counter()
    for dist, xs in rows.items():
      for name, setting in SETTINGS.items():
        params = js.SamplingParams.make(batch, temperature=0.7, **setting)
        result = jax.device_get(fn(xs[0], params))
        compile_s = (None if program_start is None else  # the first call
                     round(time.perf_counter() - program_start, 1))
        program_start = None
        got = (np.asarray(result.tokens), np.asarray(result.logprobs))
        want = first.setdefault((dist, name), got)
        timed = timing.time_op(lambda x, p=params: fn(x, p), xs, ITERS,
                               REPEATS)
        kernel_us = timed.get("kernel_us", {})
        write(dict(
            batch=batch, r=steps, dist=dist, setting=name,
            us=round(timed["us"], 2), wall_us=round(timed["wall_us"], 2),
            kernels=timed.get("kernels_per_call"),
            search_us={k: round(v, 2) for k, v in kernel_us.items()
                       if any(s in k for s in SEARCH_KERNELS)},
            tokens_same=bool(np.array_equal(got[0], want[0])),
            logprobs_same=bool(np.array_equal(got[1], want[1])),
            compile_s=compile_s,
            elapsed_s=round(time.perf_counter() - start, 1)))
write(dict(done=True, elapsed_s=round(time.perf_counter() - start, 1)))
