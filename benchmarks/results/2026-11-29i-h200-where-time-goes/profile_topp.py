"""Where top-p's time goes: per-kernel device time of jitted sample calls (params traced)."""
import json, os, sys
import jax, jax.numpy as jnp
import jaxsample as js
from jaxsample.bench import timing
from jaxsample.bench.cases import make_logits

V = 151936
out = open(os.path.join(os.environ.get("OUT", "/tmp"), "profile.jsonl"), "a")
def rows_of(batch, dist):
  keys = jax.random.split(jax.random.key(11), 4)
  return [make_logits(k, batch, V, dist, i) for i, k in enumerate(keys)]
SET = {"plain": {}, "top_p0.95": dict(top_p=0.95), "top_p0.9": dict(top_p=0.9),
       "top_k50+top_p0.9": dict(top_k=50, top_p=0.9), "min_p0.1": dict(min_p=0.1)}
cases = [(d, s) for d in ("randn",) for s in SET] + [("llm", "plain"), ("llm", "top_p0.95"), ("llm", "top_p0.9")]
for batch in (1, 32, 128):
  keys = jax.random.split(jax.random.key(7), batch)
  pos = jnp.arange(batch, dtype=jnp.int32)
  fn = jax.jit(lambda x, p: js.sample(x, p, keys, positions=pos))
  for dist in ("randn", "llm"):
    xs = rows_of(batch, dist)
    r = timing.time_op(jax.jit(lambda x: jnp.max(x, axis=-1)), xs, 16, 5)
    rec = dict(batch=batch, dist=dist, setting="jnp.max", us=r["us"], wall=r["wall_us"])
    print(rec, flush=True); out.write(json.dumps(rec) + "\n"); out.flush()
    for d, s in cases:
      if d != dist: continue
      p = js.SamplingParams.make(batch, temperature=0.7, **SET[s])
      r = timing.time_op(lambda x: fn(x, p), xs, 16, 5)
      rec = dict(batch=batch, dist=dist, setting=s, us=r["us"], wall=r["wall_us"],
                 kernels=r.get("kernels_per_call"),
                 top={k[:60]: round(v, 2) for k, v in list(r.get("kernel_us", {}).items())[:14]})
      print(json.dumps(rec), flush=True); out.write(json.dumps(rec) + "\n"); out.flush()
