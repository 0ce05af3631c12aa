"""Issue 47 point 4: the speed of batch-independent launch plans, before against after,
and the after tree's logprobs bit for bit across batch sizes, on one GPU.

    BEFORE=/path/to/old/tree AFTER=/path/to/new/tree python3 plans_speed.py

Runs one process per tree (``--tree TREE --out FILE``, this same file), each timing with its
own tree's ``jaxsample.bench.timing.time_op`` (median device time of ``REPEATS`` blocks of
``ITERS`` calls rotating over 4 input buffers): ``jax.jit(sample)`` at T = 1 plain (params
closed over: the Gumbel route alone), and with traced params plain (T = 1), top-k 50 + top-p
0.9, top-p 0.95 and min-p 0.1 (one program per batch: every route's kernels), plus
``jnp.max`` over the same logits; V = 151936 in fp32 and bf16, B = 1, 8, 32, 128, 256.  Each
process also samples fixed check rows (per-request keys) at every B, in order and reversed,
and reports whether every row's token and logprob are bit-identical to its B = 256 result
(plain and top-p 0.95; the first dtype only, its B = 256 first).  Prints a table (before, after, after / before) and writes JSON to
OUT (default ./plans_speed.json).

Env: BEFORE, AFTER (tree roots); V (default 151936; 2048 for a CPU smoke run, where ``sample``
takes the XLA path); BATCHES (default 1,8,32,128,256); DTYPES (default float32,bfloat16);
ITERS (10), REPEATS (20); BUDGET_S (per tree, default 120: the (dtype, B) groups that would
start past it are skipped and reported); OUT.
"""
import json
import os
import subprocess
import sys
import time

SETTINGS = {"plain T=1": {}, "top_k50+top_p0.9": {"top_k": 50, "top_p": 0.9},
            "top_p0.95": {"top_p": 0.95}, "min_p0.1": {"min_p": 0.1}}
CHECKED = ("plain T=1", "top_p0.95")  # settings whose bits are compared across B
BUFFERS = 4


def env_list(name, default, cast):
  return [cast(v) for v in os.environ.get(name, default).split(",") if v]


def worker(tree: str, out: str) -> None:
  sys.path.insert(0, tree)
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jaxsample as js
  from jaxsample.bench import timing

  vocab = int(os.environ.get("V", 151936))
  batches = env_list("BATCHES", "1,8,32,128,256", int)
  dtypes = env_list("DTYPES", "float32,bfloat16", str)
  iters, repeats = int(os.environ.get("ITERS", 10)), int(os.environ.get("REPEATS", 20))
  budget = float(os.environ.get("BUDGET_S", 120))
  start = time.time()
  most = max(batches)
  keys = jax.random.split(jax.random.key(7), most)  # per-request keys: row b's at any B
  positions = jnp.arange(most, dtype=jnp.int32) * 3
  rows, skipped, bits = [], [], {}

  def timed(op, setting, dtype, batch, fn, xs):
    r = timing.time_op(fn, xs, iters=iters, repeats=repeats)
    rows.append({"op": op, "setting": setting, "dtype": dtype, "batch": batch,
                 "us": r["us"]})
    print(f"{tree}: {rows[-1]}", flush=True)

  for dtype in dtypes:
    checked = dtype == dtypes[0]  # the bit checks: first dtype only, B = max first
    check = (2 * jax.random.normal(jax.random.key(99), (most, vocab))).astype(dtype)
    for batch in sorted(batches, key=lambda b: (b != most) if checked else b):
      if time.time() - start > budget:
        skipped.append(f"{dtype} B={batch}")
        continue
      bufs = [(2 * jax.random.normal(k, (batch, vocab))).astype(dtype)
              for k in jax.random.split(jax.random.key(1234 + batch), BUFFERS)]
      k, pos = keys[:batch], positions[:batch]
      one = js.SamplingParams.make(batch, temperature=1.0)
      closed = jax.jit(lambda x: js.sample(x, one, k, positions=pos))
      timed("sample (params closed over)", "plain T=1", dtype, batch, closed, bufs)
      traced = jax.jit(lambda x, p, k, pos: js.sample(x, p, k, positions=pos))
      for name, fields in SETTINGS.items():
        params = js.SamplingParams.make(batch, temperature=1.0, **fields)
        timed("sample (traced params)", name, dtype, batch,
              lambda x: traced(x, params, k, pos), bufs)
        if checked and name in CHECKED:  # the check rows, in order and reversed
          rev = np.arange(batch)[::-1]
          got = traced(check[:batch], params, k, pos)
          back = traced(check[:batch][rev], params, k[rev], pos[rev])
          for order, res in (("in order", got), ("reversed", back)):
            idx = np.arange(batch) if order == "in order" else rev
            entry = bits.setdefault(f"{dtype} {name}", {})
            entry[f"{batch} {order}"] = (np.asarray(res.tokens)[np.argsort(idx)].tolist(),
                                         np.asarray(res.logprobs, np.float32)[
                                             np.argsort(idx)].view(np.uint32).tolist())
      timed("jnp.max", "-", dtype, batch, jax.jit(lambda x: jnp.max(x, axis=-1)), bufs)

  identical = {}
  for case, runs in bits.items():  # against B = max's rows
    want_tokens, want_bits = runs[f"{most} in order"]
    identical[case] = {
        key: tokens == want_tokens[:len(tokens)] and lp == want_bits[:len(lp)]
        for key, (tokens, lp) in runs.items()}
  json.dump({"tree": tree, "device": jax.devices()[0].device_kind,
             "backend": jax.default_backend(), "jax": jax.__version__, "vocab": vocab,
             "rows": rows, "skipped": skipped, "bit_identical_to_largest_batch": identical,
             "seconds": time.time() - start}, open(out, "w"), indent=1)


def driver() -> None:
  trees = {"before": os.environ["BEFORE"], "after": os.environ["AFTER"]}
  out = os.environ.get("OUT", "plans_speed.json")
  results = {}
  for label, tree in trees.items():
    part = f"{out}.{label}.json"
    subprocess.run([sys.executable, os.path.abspath(__file__), "--tree", tree, "--out", part],
                   check=True, cwd=tree)
    results[label] = json.load(open(part))
  key = lambda r: (r["op"], r["setting"], r["dtype"], r["batch"])
  before = {key(r): r["us"] for r in results["before"]["rows"]}
  after = {key(r): r["us"] for r in results["after"]["rows"]}
  table = []
  print(f"\n{'op':30} {'setting':18} {'dtype':9} {'B':>4} {'before us':>10} "
        f"{'after us':>10} {'ratio':>6}")
  for k in sorted(set(before) | set(after), key=lambda k: (k[2], k[0], k[1], k[3])):
    b, a = before.get(k), after.get(k)
    ratio = a / b if a and b else None
    table.append({"op": k[0], "setting": k[1], "dtype": k[2], "batch": k[3],
                  "before_us": b, "after_us": a, "ratio": ratio})
    fmt = lambda v, f: format(v, f) if v is not None else "-"
    print(f"{k[0]:30} {k[1]:18} {k[2]:9} {k[3]:>4} {fmt(b, '10.1f')} {fmt(a, '10.1f')} "
          f"{fmt(ratio, '6.3f')}")
  for label in trees:
    same = results[label]["bit_identical_to_largest_batch"]
    bad = {case: [k for k, ok in runs.items() if not ok] for case, runs in same.items()}
    print(f"{label}: rows bit-identical (tokens and logprobs) to B = max at every B, in "
          f"order and reversed: {not any(bad.values())}"
          + ("" if not any(bad.values()) else f"; differ: {bad}"))
    if results[label]["skipped"]:
      print(f"{label}: skipped past the budget: {results[label]['skipped']}")
    print(f"{label}: {results[label]['seconds']:.0f} s on {results[label]['device']}")
  json.dump({"trees": trees, "table": table, "runs": results}, open(out, "w"), indent=1)
  print(f"wrote {out}")


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--tree":
    worker(sys.argv[2], sys.argv[4])
  else:
    driver()
