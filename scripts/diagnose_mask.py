"""Where the mask path's extra device time goes (issue 5 diagnostics).

    PYTHONPATH=. python3 scripts/diagnose_mask.py [B ...] [top_k=K] [top_p=P]

Per batch size: the device ops of one ``jaxsample.sample`` call without
and with ``return_mask``, for each ``K_cap`` of ``MASK_IDS`` (default the
config's; e.g. ``MASK_IDS=64,1024``), top-k 50 + top-p 0.9 by default (fp32,
randn, or every entry equal with ``DIST=flat``), in
launch order (``TOP``: only the costliest, by total time per op name),
each with the HLO op the profiler attributes it to; the optimized HLO of both
programs goes to ``$OUT`` (or ./diagnose-out).
"""
import argparse
import glob
import os
import tempfile

import jax
import jax.numpy as jnp

import jaxsample
from jaxsample import SamplingParams

parser = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("words", nargs="*", metavar="B | top_k=K | top_p=P",
                    help="batch sizes (default 1 32) and filter settings")
words = parser.parse_args().words
out = os.environ.get("OUT", "diagnose-out")
os.makedirs(out, exist_ok=True)
vocab = 151936
batches = [int(b) for b in words if "=" not in b] or [1, 32]
setting = dict(top_k=50, top_p=0.9)
setting.update({a.split("=")[0]: float(a.split("=")[1]) for a in words
                if "=" in a})
setting["top_k"] = int(setting["top_k"])
top = int(os.environ.get("TOP", "0"))
flat = os.environ.get("DIST", "randn") == "flat"
caps = [int(c) for c in os.environ.get("MASK_IDS", "").split(",") if c] or [
    jaxsample.SamplerConfig().max_mask_ids]


def events(fn, x):
  jax.block_until_ready(fn(x))
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    jax.block_until_ready(fn(x))
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(
        glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
  rows = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      for e in line.events:
        stats = {}
        try:
          stats = {k: v for k, v in e.stats}
        except Exception:  # pylint: disable=broad-except
          pass
        rows.append((e.start_ns, line.name, e.name, e.duration_ns / 1e3,
                     stats.get("hlo_op", ""), stats.get("memcpy_details", "")))
  return sorted(rows)


for batch in batches:
  x = jax.random.normal(jax.random.key(batch), (batch, vocab))
  if flat:
    x = jnp.full_like(x, 0.5)
  params = SamplingParams.make(batch, **setting)
  key = jax.random.key(0)
  for cap in [0] + caps:  # 0: no mask
    config = jaxsample.SamplerConfig(max_mask_ids=cap or caps[0])
    # Params are arguments, as in a decode loop.
    jitted = jax.jit(lambda x, params, m=bool(cap), c=config: jaxsample.sample(
        x, params, key, return_mask=m, config=c))
    fn = lambda x: jitted(x, params)
    with open(f"{out}/hlo-b{batch}-mask{cap}.txt", "w") as f:
      f.write(jitted.lower(x, params).compile().as_text())
    rows = events(fn, x)
    total = sum(r[3] for r in rows if r[1].startswith("Stream"))
    print(f"== B={batch} {setting} K_cap={cap or 'no mask'}: {total:.1f} us "
          "on streams")
    if top:
      per = {}
      for row in rows:
        per[row[2]] = per.get(row[2], 0.0) + row[3]
      for name, us in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us:8.1f}  {name[:90]}")
      continue
    for start, line, name, us, op, detail in rows:
      print(f"  {line[:14]:14s} {us:7.2f}  {name[:50]:50s} {op} {detail}")
