"""Launch sweeps of the flat top-p route's kernels on an H200 (issue 49): one program per config,
params traced, V = 151936 fp32, T = 0.7; `randn` and `llm` rows, top-p 0.95 (and top-k 50 + top-p 0.9 on
`llm`); device us and the swept kernels' us; outputs compared bit for bit with the first config's.

    OUT=$OUT PYTHONPATH=. python3 launch_sweep.py warps|compact   (SWEEP_DEADLINE_S: stop starting programs)
"""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
import jaxsample as js
from jaxsample import tuning
from jaxsample.bench import timing
from jaxsample.bench.cases import make_logits

V, which = 151936, sys.argv[1]
DEADLINE = float(os.environ.get("SWEEP_DEADLINE_S", 200))
SWEEPS = {  # the first config of each sweep is today's
    "warps": [dict(zip(("window.num_warps", "bounds.num_warps", "select.num_warps", "pack.num_warps"), w))
              for w in ((16, 8, 4, 8), (4, 2, 2, 4), (8, 4, 4, 8), (32, 16, 8, 16))],
    "compact": [{"compact.block_size": b, "compact.chunks_per_step": s, "compact.num_warps": w}
                for b, s, w in ((1024, 1, 4), (2048, 1, 4), (2048, 1, 8), (4096, 1, 8), (512, 4, 4))],
}[which]
CASES = [("randn", "top_p0.95", dict(top_p=0.95)), ("llm", "top_p0.95", dict(top_p=0.95)),
         ("llm", "top_k50+top_p0.9", dict(top_k=50, top_p=0.9))]
start = time.perf_counter()
out = open(os.path.join(os.environ.get("OUT", "/tmp"), f"sweep_{which}.jsonl"), "a")
for batch in (1, 128):
  keys = jax.random.split(jax.random.key(7), batch)
  pos = jnp.arange(batch, dtype=jnp.int32)
  data = {d: [make_logits(k, batch, V, d, i) for i, k in enumerate(jax.random.split(jax.random.key(11), 4))]
          for d in ("randn", "llm")}
  want = {}
  for knobs in SWEEPS:
    if time.perf_counter() - start > DEADLINE:
      print("deadline", batch, knobs, flush=True); break
    cfg = js.SamplerConfig(tuning=tuning.overriding(knobs))
    fn = jax.jit(lambda x, p, cfg=cfg: js.sample(x, p, keys, positions=pos, config=cfg))
    for dist, name, filters in CASES:
      p = js.SamplingParams.make(batch, temperature=0.7, **filters)
      got = fn(data[dist][0], p)
      bits = (np.asarray(got.tokens), np.asarray(got.logprobs).view(np.uint32))
      first = want.setdefault((dist, name), bits)
      r = timing.time_op(lambda x, p=p: fn(x, p), data[dist], 16, 5)
      rec = dict(batch=batch, dist=dist, setting=name, knobs=knobs, us=round(r["us"], 2),
                 kernels=r.get("kernels_per_call"),
                 kernel_us={k[:40]: round(v, 2) for k, v in list(r.get("kernel_us", {}).items())[:8]},
                 same_as_first=all(np.array_equal(a, b) for a, b in zip(bits, first)),
                 elapsed_s=round(time.perf_counter() - start, 1))
      print(json.dumps(rec), flush=True); out.write(json.dumps(rec) + "\n"); out.flush()
