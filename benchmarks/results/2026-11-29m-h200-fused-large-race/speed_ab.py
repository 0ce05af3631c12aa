"""Issue 49's same-run table: one jaxsample tree's `sample`, params traced (as a serving loop
passes them), per setting, with `jnp.max` and plain sampling with params closed over beside it.

    python3 speed_ab.py TREE TIMING_PY OUT_PREFIX GRID

TREE: a source tree whose `jaxsample` is imported; TIMING_PY: the one timing harness
(`jaxsample/bench/timing.py` of the newer tree, loaded by path), so both trees are timed by the
same code.  GRID: `core` (fp32, V = 151936, B = 1, 32, 128, 256) or `wide` (bf16 and
V = 128256 at B = 1 and 128).  Rows: `randn` (flat: top-p keeps thousands of ids) and `llm`
(`jaxsample.bench.cases`), T = 0.7.  Writes OUT_PREFIX.jsonl (a line per case, as it goes) and
OUT_PREFIX.npz (every case's tokens and logprobs on its first buffer).
"""
import importlib.util
import json
import os
import sys

tree, timing_py, out, grid = sys.argv[1:5]
sys.path.insert(0, tree)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxsample as js  # noqa: E402
from jaxsample.bench.cases import make_logits  # noqa: E402

spec = importlib.util.spec_from_file_location("ab_timing", timing_py)
timing = importlib.util.module_from_spec(spec)
sys.modules["ab_timing"] = timing  # dataclasses look their module up
spec.loader.exec_module(timing)

SETTINGS = {"plain": {}, "top_p0.95": {"top_p": 0.95}, "top_p0.9": {"top_p": 0.9},
            "top_k50+top_p0.9": {"top_k": 50, "top_p": 0.9}, "min_p0.1": {"min_p": 0.1}}
T = 0.7
SHAPES = {"core": [(151936, "float32", b) for b in (1, 32, 128, 256)],
          "wide": [(v, d, b) for v, d in ((151936, "bfloat16"), (128256, "float32"),
                                         (128256, "bfloat16")) for b in (1, 128)]}[grid]
if os.environ.get("AB_SMOKE"):  # a CPU check of the script itself
  SHAPES = [(4096, "float32", 2)]
log, saved = open(out + ".jsonl", "a"), {}


def emit(record, result):
  record.update(us=round(result["us"], 2), wall_us=round(result["wall_us"], 2),
                kernels=result.get("kernels_per_call"),
                top={k[:48]: round(v, 2) for k, v in list(result.get("kernel_us", {}).items())[:6]})
  print(json.dumps(record), flush=True)
  log.write(json.dumps(record) + "\n")
  log.flush()


for vocab, dtype, batch in SHAPES:
  keys = jax.random.split(jax.random.key(7), batch)
  positions = jnp.arange(batch, dtype=jnp.int32)
  traced = jax.jit(lambda x, p: js.sample(x, p, keys, positions=positions))
  plain = js.SamplingParams.make(batch, temperature=T)
  static = jax.jit(lambda x: js.sample(x, plain, keys, positions=positions))
  for dist in ("randn", "llm"):
    xs = [make_logits(k, batch, vocab, dist, i).astype(dtype)
          for i, k in enumerate(jax.random.split(jax.random.key(11), 4))]
    case = dict(V=vocab, dtype=dtype, batch=batch, dist=dist)
    if dist == "randn":  # the same bytes for both kinds of rows
      emit(dict(case, setting="jnp.max"),
           timing.time_op(jax.jit(lambda x: jnp.max(x, axis=-1)), xs, 16, 5))
      emit(dict(case, setting="plain static"), timing.time_op(static, xs, 16, 5))
    for name, filters in SETTINGS.items():
      params = js.SamplingParams.make(batch, temperature=T, **filters)
      emit(dict(case, setting=name), timing.time_op(lambda x: traced(x, params), xs, 16, 5))
      got = traced(xs[0], params)
      tag = f"{vocab}-{dtype}-{batch}-{dist}-{name}"
      saved[tag + "-tokens"] = np.asarray(got.tokens)
      saved[tag + "-logprobs"] = np.asarray(got.logprobs).view(np.uint32)
  np.savez(out + ".npz", **saved)
