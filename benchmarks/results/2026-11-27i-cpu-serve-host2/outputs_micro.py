"""Host CPU of a jitted call with six int32 outputs (f) against one concatenated output (g):
the call alone, plus copy_to_host_async of each output, plus device_get (us per call).

    JAX_PLATFORMS=cpu python3 outputs_micro.py
"""
import time, jax, jax.numpy as jnp, numpy as np
f = jax.jit(lambda x: (x+1, x*2, x-1, x+3, x*5, x>0))
g = jax.jit(lambda x: jnp.concatenate([x+1, x*2, x-1, x+3, x*5, (x>0).astype(x.dtype)], -1))
x = jnp.ones((32, 8), jnp.int32)
for fn in (f, g):
  out = fn(x); jax.block_until_ready(out)
  n = 2000
  t = time.thread_time()
  for _ in range(n): out = fn(x)
  t1 = time.thread_time()
  for _ in range(n):
    out = fn(x)
    for l in jax.tree.leaves(out): l.copy_to_host_async()
  t2 = time.thread_time()
  for _ in range(n):
    out = fn(x)
    for l in jax.tree.leaves(out): l.copy_to_host_async()
    h = jax.device_get(out)
  t3 = time.thread_time()
  print(fn is g, "call us", (t1-t)/n*1e6, "+copy_async", (t2-t1)/n*1e6, "+device_get", (t3-t2)/n*1e6)
