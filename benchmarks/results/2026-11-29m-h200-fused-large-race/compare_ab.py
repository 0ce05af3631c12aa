"""Compares before/after outputs (bit for bit) and prints the table of both trees' times.

    python3 compare_ab.py OUT_DIR   (reads before-core.*, after-core.*, after-wide.*)"""
import json
import os
import sys

import numpy as np

folder = sys.argv[1]
def load(name):
  path = os.path.join(folder, name + ".jsonl")
  return [json.loads(l) for l in open(path)] if os.path.exists(path) else []
key = lambda r: (r["V"], r["dtype"], r["batch"], r["dist"], r["setting"])
before = {key(r): r for r in load("before-core")}
rows = load("after-core") + load("after-wide")
base = {}
for r in rows:
  if r["setting"] in ("jnp.max", "plain"):
    base[(r["V"], r["dtype"], r["batch"], r["dist"], r["setting"])] = r["us"]
print("| V | dtype | B | rows | setting | before us | after us | x plain (after) | kernels before / after |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
  b = before.get(key(r))
  plain = base.get((r["V"], r["dtype"], r["batch"], r["dist"], "plain")) or base.get(
      (r["V"], r["dtype"], r["batch"], "randn", "plain"))
  ratio = f"{r['us'] / plain:.2f}" if plain and r["setting"] not in ("jnp.max",) else ""
  print(f"| {r['V']} | {r['dtype']} | {r['batch']} | {r['dist']} | {r['setting']} | "
        f"{b['us'] if b else '-'} | {r['us']} | {ratio} | {b['kernels'] if b else '-'} / {r['kernels']} |")
paths = [os.path.join(folder, f) for f in ("before-core.npz", "after-core.npz")]
if all(map(os.path.exists, paths)):
  old, new = (np.load(p) for p in paths)
  same = [k for k in old.files if k in new.files and np.array_equal(old[k], new[k])]
  differ = [k for k in old.files if k in new.files and not np.array_equal(old[k], new[k])]
  print(f"\noutputs bit-equal before/after: {len(same)} of {len(same) + len(differ)}; differ: {differ}")
