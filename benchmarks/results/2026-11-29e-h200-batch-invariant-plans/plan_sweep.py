"""Sweep batch-independent launch plans (after tree) against the old per-B plans (before tree), one GPU run.
python3 plan_sweep.py TREE LABEL OUT.json"""
import json, os, sys, time
tree, label, out = sys.argv[1:4]
sys.path.insert(0, tree)
import jax, jax.numpy as jnp
import jaxsample as js
from jaxsample.bench import timing
V = int(os.environ.get("V", 151936)); BUFFERS = 4
configs = {"default": None}
if label == "after":
  from jaxsample.pallas import tuning as T
  for w in (1, 2, 4):
    for s in (75, 38, 19, 10):
      configs[f"gumbel w{w} s{s}"] = js.SamplerConfig(tuning=T.Tuning(gumbel=T.RaceLaunch(num_warps=w, num_splits=s)))
  for f in (2, 4, 8):
    occ = T.Occupancy(programs_per_sm=((1, max(1, 15 // f)), (2, max(1, 6 // f)), (4, max(1, 3 // f))))
    configs[f"occupancy/{f}"] = js.SamplerConfig(tuning=T.Tuning(occupancy=occ))
rows = []
start = time.time()
for batch in (1, 8, 32, 128, 256):
  bufs = [2 * jax.random.normal(k, (batch, V)) for k in jax.random.split(jax.random.key(1234 + batch), BUFFERS)]
  keys = jax.random.split(jax.random.key(7), batch); pos = jnp.arange(batch, dtype=jnp.int32)
  for name, cfg in configs.items():
    settings = {"plain closed": None}
    if not name.startswith("gumbel"):
      settings.update({"plain traced": {}, "top_p0.95 traced": {"top_p": 0.95}, "min_p0.1 traced": {"min_p": 0.1},
                       "top_k50+top_p0.9 traced": {"top_k": 50, "top_p": 0.9}})
    for sname, fields in settings.items():
      if fields is None:
        one = js.SamplingParams.make(batch, temperature=1.0)
        fn = jax.jit(lambda x: js.sample(x, one, keys, positions=pos, config=cfg))
      else:
        p = js.SamplingParams.make(batch, temperature=1.0, **fields)
        tr = jax.jit(lambda x, p: js.sample(x, p, keys, positions=pos, config=cfg))
        fn = lambda x, tr=tr, p=p: tr(x, p)
      us = timing.time_op(fn, bufs, iters=10, repeats=15)["us"]
      rows.append(dict(tree=label, config=name, setting=sname, batch=batch, us=us))
      print(json.dumps(rows[-1]), flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, seconds=time.time() - start), open(out, "w"), indent=1)
