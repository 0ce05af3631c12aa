"""Issue 48's table from layout_speed.py's outputs: median us per case of each tree over its
rounds, the after/before ratio, and whether every saved output is equal.

    python3 layout_compare.py OUT_DIR   (reads before-R.json/npz and after-R.json/npz)
"""
import glob
import json
import statistics
import sys

import numpy as np

out = sys.argv[1]
times = {}
for path in sorted(glob.glob(f"{out}/*-[0-9].json")):
  tree = path.rsplit("/", 1)[1].split("-")[0]
  doc = json.load(open(path))
  for row in doc["rows"]:
    key = (row["op"], row["setting"], row["batch"])
    times.setdefault(key, {}).setdefault(tree, []).append(row["us"])
lines = ["| op | setting | B | before us | after us | after / before |", "|---|---|---|---|---|---|"]
worst = 0.0
for (op, setting, batch), by_tree in times.items():
  b, a = statistics.median(by_tree["before"]), statistics.median(by_tree["after"])
  if op != "jnp.max":
    worst = max(worst, abs(a / b - 1)) if a == a else worst  # NaN: a tokens-only run
  lines.append(f"| {op} | {setting} | {batch} | {b:.1f} | {a:.1f} | {a / b:.3f} |")
lines.append("")
lines.append(f"largest |after/before - 1| over jaxsample ops: {worst:.3f}")
try:
  before = np.load(f"{out}/before-0.npz")
  after = np.load(f"{out}/after-0.npz")
except FileNotFoundError:  # the outputs were compared on the GPU machine (job_tokens.sh)
  lines.append("outputs: not here (job_tokens.sh compares them on the GPU machine)")
else:
  unequal = [k for k in before.files if not np.array_equal(before[k], after[k], equal_nan=True)]
  missing = sorted(set(before.files) ^ set(after.files))
  lines.append(f"outputs compared: {len(before.files)}; unequal: {unequal or 'none'}; missing: {missing or 'none'}")
print("\n".join(lines))
open(f"{out}/table.md", "w").write("\n".join(lines) + "\n")
