import jax, jax.numpy as jnp
from jaxsample import bench, reference
for B in (1, 128):
  for cap in (2048, 4096, 8192):
    width = 1024
    ys = [jax.random.normal(jax.random.key(i), (B, cap)) for i in range(4)]
    last = jnp.sort(ys[0], axis=-1)[:, cap - width]
    ops = {
        "top_ids": jax.jit(lambda y: reference.top_ids(y, last, width)),
        "full sort": jax.jit(lambda y: jax.lax.sort(
            (-y, jax.lax.broadcasted_iota(jnp.int32, y.shape, 1)), num_keys=1,
            is_stable=True)[1][:, :width]),
        "lax.top_k": jax.jit(lambda y: jax.lax.top_k(y, width)[1]),
    }
    for name, fn in ops.items():
      r = bench.time_op(fn, ys, 32, 3)
      print(f"B={B} cap={cap} {name:10s} {r['device_us']:8.1f} us")
