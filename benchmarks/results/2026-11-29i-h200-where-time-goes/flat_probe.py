"""Issue 49 point 2: the truncation kernels behind one top-level lax.cond on 'any row
truncates' (no cond nested in it; the large-set cond stays after it) against today's
route (every route's kernels, idle rows skipped).  Device us, wall us pipelined, latency,
a 16-step fori_loop; tokens compared."""
import json, os, statistics, time
import jax, jax.numpy as jnp
import jaxsample as js
from jaxsample._src import rowwise
from jaxsample._src.backends import pallas as bp
from jaxsample._src.pallas import threshold
from jaxsample.bench import timing
from jaxsample.bench.cases import make_logits

V = int(os.environ.get("PV", 151936))
CONFIG = js.SamplerConfig(implementation=os.environ.get("PIMPL", "auto"))
out = open(os.path.join(os.environ.get("OUT", "/tmp"), "flat.jsonl"), "a")
def emit(**rec):
  print(json.dumps(rec), flush=True); out.write(json.dumps(rec) + "\n"); out.flush()
def wall(fn, xs, n=int(os.environ.get("PN", 200))):
  jax.block_until_ready(fn(xs[0]))
  t0 = time.perf_counter(); o = None
  for i in range(n): o = fn(xs[i % len(xs)])
  jax.block_until_ready(o); pipelined = (time.perf_counter() - t0) * 1e6 / n
  lat = []
  for i in range(40):
    t0 = time.perf_counter(); jax.block_until_ready(fn(xs[i % len(xs)])); lat.append((time.perf_counter() - t0) * 1e6)
  return pipelined, statistics.median(lat)

flat_route = bp._threshold_route  # the tree's: the truncation stage behind its own cond
def now_route(logits, params, streams, config, width, truncating):  # e298181's
  trunc = threshold.sample_truncated(logits, params, streams, config,
                                     order_width=width, finish_large=False)
  unfinished = trunc.unfinished(params)
  large = rowwise.only_if(unfinished, lambda: threshold.sample_large(
      logits, params, trunc, streams, config, unfinished, order_width=width))
  return trunc, unfinished, large

SET = {"plain": {}, "top_k50+top_p0.9": dict(top_k=50, top_p=0.9), "top_p0.95": dict(top_p=0.95)}
for batch in tuple(int(b) for b in os.environ.get("PB", "128,1").split(",")):
  keys = jax.random.split(jax.random.key(7), batch)
  pos = jnp.arange(batch, dtype=jnp.int32)
  xs = [make_logits(k, batch, V, "randn", i) for i, k in enumerate(jax.random.split(jax.random.key(3), 4))]
  for s, f in SET.items():
    p = js.SamplingParams.make(batch, temperature=0.7, **f)
    toks = {}
    for variant, route in (("now", now_route), ("flat", flat_route)):
      bp._threshold_route = route
      fn = jax.jit(lambda x, p: js.sample(x, p, keys, positions=pos, config=CONFIG))
      call = lambda x: fn(x, p)
      r = timing.time_op(call, xs, 16, 5); pw, lat = wall(call, xs)
      res = fn(xs[1], p); toks[variant] = (res.tokens, res.logprobs)
      if s == "top_p0.95":
        emit(batch=batch, variant=variant, setting=s, us=r["us"], wall=pw, latency=lat,
             kernels=r.get("kernels_per_call"))
        continue
      def loop(x, p):
        def body(i, acc):
          return acc + js.sample(x, p, keys, positions=pos + i, config=CONFIG).tokens
        return jax.lax.fori_loop(0, 16, body, jnp.zeros((batch,), jnp.int32))
      lf = jax.jit(loop)
      lr = timing.time_op(lambda x: lf(x, p), xs, 4, 5)
      emit(batch=batch, variant=variant, setting=s, us=r["us"], wall=pw, latency=lat,
           kernels=r.get("kernels_per_call"), fori16_us=lr["us"] / 16, fori16_wall=lr["wall_us"] / 16)
    bp._threshold_route = flat_route
    emit(batch=batch, setting=s, tokens_equal=bool(jnp.array_equal(toks["now"][0], toks["flat"][0])),
         logprobs_equal=bool(jnp.array_equal(toks["now"][1], toks["flat"][1])))
