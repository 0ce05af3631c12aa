"""Top-p window searches on zipf bf16 rows, CPU interpret mode: the rows whose
window missed the threshold, with the tie groups around it.

    .venv/bin/python benchmarks/results/2026-11-24-window-upper/window_probe.py P B BUFFER

(repo root; P the top-p, B the rows, BUFFER the index of bench_truncation's
input buffer).
"""
import sys, time
sys.path[:0] = [".", "scripts"]
import jax, jax.numpy as jnp, numpy as np
from jaxsample import SamplerConfig, SamplingParams, rng
from jaxsample.pallas import threshold
import bench_truncation as bt
B, V = int(sys.argv[2]) if len(sys.argv) > 2 else 4, 151936
p = float(sys.argv[1]) if len(sys.argv) > 1 else 0.9
x = bt.make_inputs("zipf", B, V, jnp.bfloat16)[int(sys.argv[3]) if len(sys.argv) > 3 else 0]
params = SamplingParams.make(B, temperature=1.0, top_p=p).canonical(V)
config = SamplerConfig(implementation="pallas")
streams, _ = rng.row_streams(jax.random.key(0), None, B, V)
t0 = time.time()
trunc = threshold.sample_truncated(x, params, streams, config, finish_large=False)
rows = trunc.unfinished(params)
pass
cap = config.max_candidates * threshold._WINDOW_BUFFERS
search, lower, upper = threshold._place_window(params, trunc, rows, trunc.t1, cap, by_count=False)
pass
thr, mass, held, _ = threshold._window_search(x, params, trunc, config, rows, trunc.t1, by_count=False)
print("not held", np.flatnonzero(~np.asarray(held)))
y = np.asarray(x.astype(jnp.float32))
for b in [b for b in range(B) if not held[b]]:
  yy = np.sort(y[b])[::-1]
  e = np.exp(yy - yy[0]); c = np.cumsum(e); idx = np.searchsorted(c, p * c[-1])
  t = yy[idx]
  lo, up = float(lower[b]), float(upper[b])
  inwin = ((y[b] >= lo) & (y[b] < up)).sum()
  print(b, "ref thr", t, "tie group", (y[b] == t).sum(), "window count", inwin, "lo==up", lo == up,
        "distinct in window", len(np.unique(y[b][(y[b] >= lo) & (y[b] < up)])))
search, lower, upper = threshold._place_window(params, trunc, rows, trunc.t1, cap, by_count=False)
found = threshold.collect_candidates(x, params, rows, lower, trunc.t1, threshold._safe(trunc.row_max), None, config, upper=upper, capacity=cap)
total = found.above_mass + found.outside_mass + found.inside_mass
for b in np.flatnonzero(~np.asarray(held)):
  print("row", b, "lower", float(lower[b]), "upper", float(upper[b]), "count", int(found.count[b]),
        "above_mass", float(found.above_mass[b]), "p*total", float(p * total[b]), "thr", float(thr[b]))
  yy = y[b]; e = np.exp(yy.astype(np.float64) - yy.max())
  for v in sorted(set(yy[(yy >= float(lower[b]) - 0.2) & (yy < float(upper[b]) + 0.2)].tolist()), reverse=True):
    print("  v", v, "n", (yy == v).sum(), "mass>=v", e[yy >= v].sum(), "mass>v", e[yy > v].sum())
