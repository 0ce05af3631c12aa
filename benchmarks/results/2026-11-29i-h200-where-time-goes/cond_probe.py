"""Does a lax.cond on the batch cost a host trip on this JAX?  Plain/top-p traced with the
current route (every route's kernels, idle rows skipped) vs a lax.cond on 'any row truncates';
device us (profiler), wall us pipelined (no profiler), wall us synced per call, in-loop steps."""
import json, os, statistics, time
import jax, jax.numpy as jnp
import jaxsample as js
from jaxsample._src import rowwise
from jaxsample.bench import timing
from jaxsample.bench.cases import make_logits

V = int(os.environ.get("PV", 151936))
out = open(os.path.join(os.environ.get("OUT", "/tmp"), "cond.jsonl"), "a")
def emit(**rec):
  print(json.dumps(rec), flush=True); out.write(json.dumps(rec) + "\n"); out.flush()
orig = rowwise.cond
def cond_always(pred, t, f, *, unknown=None):
  return orig(pred, t, f)
def wall(fn, xs, n=int(os.environ.get("PN", 200))):
  jax.block_until_ready(fn(xs[0]))
  t0 = time.perf_counter(); o = None
  for i in range(n): o = fn(xs[i % len(xs)])
  jax.block_until_ready(o); pipelined = (time.perf_counter() - t0) * 1e6 / n
  lat = []
  for i in range(50):
    t0 = time.perf_counter(); jax.block_until_ready(fn(xs[i % len(xs)])); lat.append((time.perf_counter() - t0) * 1e6)
  return pipelined, statistics.median(lat)
SET = {"plain": {}, "top_p0.95": dict(top_p=0.95), "top_k50+top_p0.9": dict(top_k=50, top_p=0.9)}
for batch in tuple(int(b) for b in os.environ.get("PB", "1,32,128").split(",")):
  keys = jax.random.split(jax.random.key(7), batch)
  pos = jnp.arange(batch, dtype=jnp.int32)
  xs = [make_logits(k, batch, V, "randn", i) for i, k in enumerate(jax.random.split(jax.random.key(3), 4))]
  cat = jax.jit(lambda x: jax.random.categorical(jax.random.key(1), x / 0.7))
  r = timing.time_op(cat, xs, 16, 5); pw, lat = wall(cat, xs)
  emit(batch=batch, variant="categorical", setting="plain", us=r["us"], wall=pw, latency=lat)
  mx = jax.jit(lambda x: jnp.max(x, -1)); pw, lat = wall(mx, xs)
  emit(batch=batch, variant="jnp.max", setting="-", us=timing.time_op(mx, xs, 16, 5)["us"], wall=pw, latency=lat)
  for variant in ("now", "cond"):
    rowwise.cond = orig if variant == "now" else cond_always
    for s, f in SET.items():
      p = js.SamplingParams.make(batch, temperature=0.7, **f)
      fn = jax.jit(lambda x, p: js.sample(x, p, keys, positions=pos))
      call = lambda x: fn(x, p)
      r = timing.time_op(call, xs, 16, 5); pw, lat = wall(call, xs)
      toks = fn(xs[0], p).tokens
      emit(batch=batch, variant=variant, setting=s, us=r["us"], wall=pw, latency=lat,
           kernels=r.get("kernels_per_call"), tok=int(jnp.sum(toks)))
      if s == "plain":
        st = jax.jit(lambda x: js.sample(x, p, keys, positions=pos))
        r = timing.time_op(st, xs, 16, 5); pw, lat = wall(st, xs)
        emit(batch=batch, variant=variant, setting="plain static", us=r["us"], wall=pw, latency=lat,
             kernels=r.get("kernels_per_call"))
      # a decode loop on device: 16 steps in one fori_loop, params traced
      def loop(x, p):
        def body(i, acc):
          res = js.sample(x + acc[:, None].astype(x.dtype) * 0, p, keys, positions=pos + i)
          return acc + res.tokens
        return jax.lax.fori_loop(0, 16, body, jnp.zeros((batch,), jnp.int32))
      lf = jax.jit(loop)
      r = timing.time_op(lambda x: lf(x, p), xs, 4, 5)
      emit(batch=batch, variant=variant, setting=s + " fori16", us=r["us"] / 16, wall=r["wall_us"] / 16)
rowwise.cond = orig
