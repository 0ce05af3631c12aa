"""Issue 48's same-run speed table: one jaxsample tree's ops, timed and their tokens saved.

    python3 layout_speed.py TREE TIMING_PY OUT_PREFIX

TREE is a source tree whose ``jaxsample`` is imported; TIMING_PY is the one timing harness
(``jaxsample/bench/timing.py`` of the newer tree, loaded by path: it imports jax only), so
both trees are timed by the same code.  Writes OUT_PREFIX.json (us per call per case) and
OUT_PREFIX.npz (every case's outputs on one fixed input).  A driver runs the trees
alternately in one job on one GPU.
"""
import importlib.util
import json
import os
import sys

tree, timing_py, out = sys.argv[1:4]
sys.path.insert(0, tree)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxsample as js  # noqa: E402

spec = importlib.util.spec_from_file_location("layout_timing", timing_py)
timing = importlib.util.module_from_spec(spec)
sys.modules["layout_timing"] = timing  # dataclasses look their module up
spec.loader.exec_module(timing)
if os.environ.get("LAYOUT_TOKENS_ONLY"):  # the outputs alone (a second job checks tokens)
  timing.time_op = lambda *a, **k: {"us": float("nan")}

V = int(os.environ.get("LAYOUT_V", 151936))  # smaller only for a CPU smoke run
SETTINGS = {"plain": {}, "top_k50+top_p0.9": {"top_k": 50, "top_p": 0.9},
            "top_p0.95": {"top_p": 0.95}, "min_p0.05": {"min_p": 0.05}}
BUFFERS = 4


def logits_buffers(batch, shape_tail=()):
  keys = jax.random.split(jax.random.key(1234), BUFFERS)
  return [2 * jax.random.normal(k, (batch, *shape_tail, V), jnp.float32) for k in keys]


def llm_rows(x):  # a few heavy heads per row, like an LM's logits (LLM-like rows)
  b = x.shape[0]
  ids = (jnp.arange(b)[:, None] * 7919 + jnp.arange(16)[None, :] * 104729) % V
  return x.at[jnp.arange(b)[:, None], ids].set(18.0)


rows, saved = [], {}
for batch in (1, 32, 128):
  xs = [llm_rows(x) for x in logits_buffers(batch)]
  keys = jax.random.split(jax.random.key(7), batch)
  positions = jnp.arange(batch, dtype=jnp.int32)
  for name, fields in SETTINGS.items():
    params = js.SamplingParams.make(batch, temperature=1.0, **fields)
    fn = jax.jit(lambda x, p: js.sample(x, p, keys, positions=positions))
    r = timing.time_op(lambda x: fn(x, params), xs, iters=16, repeats=5)
    rows.append({"op": "sample", "setting": name, "batch": batch, "us": r["us"]})
    res = fn(xs[0], params)
    saved[f"sample/{name}/{batch}/tokens"] = np.asarray(res.tokens)
    saved[f"sample/{name}/{batch}/logprobs"] = np.asarray(res.logprobs)
    print(rows[-1], flush=True)
  params = js.SamplingParams.make(batch, temperature=1.0, top_p=0.95)
  ext = jax.jit(lambda x, p: js.extract_sampling_mask(x, p))
  r = timing.time_op(lambda x: ext(x, params), xs, iters=16, repeats=5)
  rows.append({"op": "extract_sampling_mask", "setting": "top_p0.95", "batch": batch, "us": r["us"]})
  m = ext(xs[0], params)
  saved[f"mask/{batch}/ids"] = np.asarray(m.ids)
  saved[f"mask/{batch}/count"] = np.asarray(m.count)
  print(rows[-1], flush=True)

k, batch = 4, 128
ts = [llm_rows(x.reshape(batch * (k + 1), V)).reshape(batch, k + 1, V)
      for x in logits_buffers(batch, (k + 1,))]
drafts = jax.random.randint(jax.random.key(3), (batch, k), 0, V)
num = jnp.full((batch,), k, jnp.int32)
for name, fields in (("plain", {}), ("top_k50+top_p0.9", {"top_k": 50, "top_p": 0.9})):
  params = js.SamplingParams.make(batch, temperature=1.0, **fields)
  ver = jax.jit(lambda t, p: js.rejection_sample(t, drafts, num, p, jax.random.key(5)))
  r = timing.time_op(lambda t: ver(t, params), ts, iters=16, repeats=5)
  rows.append({"op": "rejection_sample k=4 one-hot", "setting": name, "batch": batch, "us": r["us"]})
  s = ver(ts[0], params)
  saved[f"spec/{name}/tokens"] = np.asarray(s.tokens)
  saved[f"spec/{name}/accepted"] = np.asarray(s.num_accepted)
  print(rows[-1], flush=True)

ref = jax.jit(lambda x: jnp.max(x, axis=-1))
for batch in (1, 32, 128):
  xs = logits_buffers(batch)
  rows.append({"op": "jnp.max", "setting": "-", "batch": batch,
               "us": timing.time_op(ref, xs, iters=16, repeats=5)["us"]})
  print(rows[-1], flush=True)
json.dump({"tree": tree, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "rows": rows}, open(out + ".json", "w"), indent=1)
np.savez(out + ".npz", **saved)
