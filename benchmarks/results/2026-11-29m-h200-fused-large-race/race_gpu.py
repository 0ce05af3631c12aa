"""Branch `race` on one H200: the large-set route's fused race (no floored
Gumbel pass where the last window search held the threshold).

(a) bit-compare: `jaxsample.sample` (pallas) against the XLA reference
    backend, tokens and logprobs, 3 seeds; and the fused route against the
    floored race on the same thresholds (`threshold.sample_large` vs
    `threshold.floored_race`), which must agree bit for bit on tokens and
    exactly on counts wherever rows are raced;
(b) timing: `jaxsample.bench.timing.time_op`, kernel_us per kernel.
V = 151936 fp32, dists randn (flat, 2*randn) and llm, B in {1, 32, 128},
T = 0.7; settings plain, top_p0.95, top_k50+top_p0.9, min_p0.1.
Writes JSON lines to $OUT/race.jsonl as it goes.  Run from the repo root:
  PYTHONPATH=$PWD python .stage_race_gpu.py
"""
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js
from jaxsample._src import rng
from jaxsample.bench import timing
from jaxsample.bench.cases import make_logits

sys.path.insert(0, "tests")
from test_large_race import _fused_and_floored as fused_and_floored  # noqa: E402

V = 151936
T = 0.7
SETTINGS = {"plain": {}, "top_p0.95": dict(top_p=0.95),
            "top_k50+top_p0.9": dict(top_k=50, top_p=0.9),
            "min_p0.1": dict(min_p=0.1)}
out = open(os.path.join(os.environ.get("OUT", "/tmp"), "race.jsonl"), "a")
START = time.time()


def emit(rec):
  rec["t"] = round(time.time() - START, 1)
  line = json.dumps(rec)
  print(line, flush=True)
  out.write(line + "\n")
  out.flush()


def compare(batch, dist):
  pallas = jax.jit(lambda x, p, k: js.sample(
      x, p, k, config=js.SamplerConfig(implementation="pallas")))
  xla = jax.jit(lambda x, p, k: js.sample(
      x, p, k, config=js.SamplerConfig(implementation="xla")))
  for seed in range(3):
    x = make_logits(jax.random.key(100 + seed), batch, V, dist)
    key = jax.random.key(seed)
    for name, setting in SETTINGS.items():
      p = js.SamplingParams.make(batch, temperature=T, **setting)
      a = jax.device_get(pallas(x, p, key))
      b = jax.device_get(xla(x, p, key))
      tok = np.asarray(a.tokens) != np.asarray(b.tokens)
      dlp = np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs))
      rec = dict(kind="sample_vs_xla", batch=batch, dist=dist, seed=seed,
                 setting=name, token_mismatch=int(tok.sum()),
                 logprob_bits_equal=int((dlp == 0).sum()),
                 max_logprob_diff=float(np.max(dlp[~tok], initial=0.0)))
      if name != "plain":  # fused vs floored on the same thresholds
        streams, _ = rng.row_streams(key, None, batch, V)
        rows, measured, fused, (res, count, log_kept) = jax.tree.map(
            np.asarray, fused_and_floored(x, p.canonical(V), streams,
                                          js.SamplerConfig()))
        raced = rows & measured
        rec.update(
            large_rows=int(rows.sum()), raced_rows=int(raced.sum()),
            fused_token_mismatch=int((fused[0] != res.tokens)[rows].sum()),
            fused_count_mismatch=int((fused[4] != count)[rows].sum()),
            fused_max_logprob_diff=float(np.max(np.abs(
                fused[1] - res.logprobs)[rows], initial=0.0)),
            fused_max_log_kept_diff=float(np.max(np.abs(
                fused[5] - log_kept)[rows], initial=0.0)))
      emit(rec)


def profile(batch, dist):
  keys = jax.random.split(jax.random.key(7), batch)
  pos = jnp.arange(batch, dtype=jnp.int32)
  fn = jax.jit(lambda x, p: js.sample(x, p, keys, positions=pos))
  xs = [make_logits(k, batch, V, dist, i)
        for i, k in enumerate(jax.random.split(jax.random.key(11), 4))]
  for name, setting in SETTINGS.items():
    p = js.SamplingParams.make(batch, temperature=T, **setting)
    r = timing.time_op(lambda x: fn(x, p), xs, 16, 5)
    emit(dict(kind="time", batch=batch, dist=dist, setting=name,
              us=r["us"], wall_us=r["wall_us"],
              kernels=r.get("kernels_per_call"),
              kernel_us={k[:60]: round(v, 2)
                         for k, v in list(r.get("kernel_us", {}).items())[:14]}))


emit(dict(kind="start", devices=str(jax.devices())))
for batch in (1, 128):  # the timing: the same-run A/B table (speed_ab.py)
  for dist in ("randn", "llm"):
    compare(batch, dist)
emit(dict(kind="done"))
