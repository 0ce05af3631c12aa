"""The listing-order kernels' bucket statistics and host-timed calls (needs listing-order.patch).
import sys, time
import numpy as np, jax, jax.numpy as jnp
from jaxsample.pallas import order
np.set_printoptions(linewidth=200)
B, size, width = 128, 16384, 4096
r = np.random.default_rng(0)
y = r.standard_normal((B, size)).astype(np.float32)
ids = np.tile(np.arange(size, dtype=np.int32), (B, 1))
count = np.full(B, 11500, np.int32)
rows = np.ones(B, bool)
args = [jnp.asarray(a) for a in (rows.astype(np.int32), count, y, ids)]
outs = order._layout(*args, False)
spl, cnt, off, ly, lid, lr, fin = map(np.asarray, outs)
sizes = np.diff(off[0, :362])
print("finite", fin[:4], "bucket sizes mean/max", sizes[sizes > 0].mean(), sizes.max(), "nonzero", (sizes > 0).sum())
print("splitters sorted desc:", bool(np.all(np.diff(spl[0, :359]) <= 0)), spl[0, :8])
lo = lr[0, :11500] & 0xFFFF; hi = lr[0, :11500] >> 16
print("range sizes mean/max", (hi - lo).mean(), (hi - lo).max())
def timed(f, *a):
  f = jax.jit(f); jax.block_until_ready(f(*a))
  ts = []
  for _ in range(5):
    t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
  return 1e6 * np.median(ts)
print("layout us", timed(lambda *a: order._layout(*a, False), *args))
print("full us", timed(lambda y, i, c, r: order.listing_top_ids(y, i, c, r, width), args[2], args[3], args[1], jnp.asarray(rows)))
