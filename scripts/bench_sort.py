"""Experiment: ordering [B, N] (value, id) pairs on the GPU.

XLA's sort (two operands, or a uint32 key with the ids as values) against
two Pallas kernels: a bitonic network in one program per
row (pairs exchanged through reshapes and size-2 reductions) and a rank by
comparison (grid (B, N / tile), each element counts the elements before it).

  PYTHONPATH=. python3 scripts/bench_sort.py [--interpret] [--xla-only]
"""

import functools
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxsample import bench
from jaxsample.pallas import common

warnings.filterwarnings("ignore")
INTERPRET = "--interpret" in sys.argv
XLA_ONLY = "--xla-only" in sys.argv


def _halves(v, j: int):
  """(value at i with bit j clear, value at i with bit j set) at every i."""
  n = v.shape[0]
  v3 = v.reshape(n // (2 * j), 2, j)
  half = lax.broadcasted_iota(jnp.int32, (1, 2, 1), 1)
  zero = jnp.zeros((), v.dtype)
  low = jnp.sum(jnp.where(half == 0, v3, zero), axis=1, keepdims=True)
  high = jnp.sum(jnp.where(half == 1, v3, zero), axis=1, keepdims=True)
  return (jnp.broadcast_to(low, v3.shape).reshape(n),
          jnp.broadcast_to(high, v3.shape).reshape(n))


def bitonic(key, ids):
  """key (uint32) descending, smallest id first on ties."""
  n = key.shape[0]
  pos = lax.broadcasted_iota(jnp.int32, (n,), 0)
  size = 2
  while size <= n:
    forward = (pos & size) == 0
    j = size // 2
    while j >= 1:
      kl, kh = _halves(key, j)
      il, ih = _halves(ids, j)
      low_first = (kl > kh) | ((kl == kh) & (il < ih))
      take_low = ((pos & j) == 0) == (low_first == forward)
      key = jnp.where(take_low, kl, kh)
      ids = jnp.where(take_low, il, ih)
      j //= 2
    size *= 2
  return key, ids


def _bitonic_kernel(y_ref, id_ref, out_ref):
  row = pl.program_id(0)
  n = y_ref.shape[1]
  lanes = jnp.arange(n, dtype=jnp.int32)
  y = plgpu.load(y_ref.at[row, lanes])
  ids = plgpu.load(id_ref.at[row, lanes])
  _, ids = bitonic(common.order_key(y), ids)
  plgpu.store(out_ref.at[row, lanes], ids)


def pallas_bitonic(y, ids, warps):
  b, n = y.shape
  return pl.pallas_call(
      _bitonic_kernel, out_shape=jax.ShapeDtypeStruct((b, n), jnp.int32),
      grid=(b,), interpret=INTERPRET,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      name="exp_bitonic")(y, ids)


def _rank_kernel(y_ref, id_ref, out_ref, *, tile, chunk):
  row, t = pl.program_id(0), pl.program_id(1)
  n = y_ref.shape[1]
  mine = t * tile + jnp.arange(tile, dtype=jnp.int32)
  my_key = common.order_key(plgpu.load(y_ref.at[row, mine]))
  my_id = plgpu.load(id_ref.at[row, mine])

  def body(c, rank):
    other = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    key = common.order_key(plgpu.load(y_ref.at[row, other]))
    oid = plgpu.load(id_ref.at[row, other])
    before = (key[None, :] > my_key[:, None]) | (
        (key[None, :] == my_key[:, None]) & (oid[None, :] < my_id[:, None]))
    return rank + jnp.sum(before.astype(jnp.int32), axis=1)

  rank = lax.fori_loop(0, n // chunk, body, jnp.zeros((tile,), jnp.int32))
  plgpu.store(out_ref.at[row, rank], my_id)


def pallas_rank(y, ids, tile, chunk, warps):
  b, n = y.shape
  return pl.pallas_call(
      functools.partial(_rank_kernel, tile=tile, chunk=chunk),
      out_shape=jax.ShapeDtypeStruct((b, n), jnp.int32),
      grid=(b, n // tile), interpret=INTERPRET,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      name="exp_rank")(y, ids)


def xla_sort(y, ids, stable=True, num_keys=1):
  return lax.sort((-y, ids), num_keys=num_keys, is_stable=stable)[1]


def xla_key_sort(y, ids):
  """One uint32 key (descending order key), ids as values, stable: XLA may
  hand a sort of unsigned keys with one value operand to CUB's radix
  sort (above its size threshold)."""
  return lax.sort((~common.order_key(y), ids), num_keys=1, is_stable=True)[1]


def oracle(y, ids):
  y, ids = np.asarray(y), np.asarray(ids)
  out = np.empty_like(ids)
  for r in range(y.shape[0]):
    out[r] = ids[r][np.lexsort((ids[r], -y[r]))]
  return out


def main():
  sizes = [(b, n) for b in (1, 32, 128, 256) for n in (1024, 4096)]
  if INTERPRET:
    sizes = [(2, 64), (3, 256)]
  for b, n in sizes:
    key = jax.random.key(n + b)
    # Ties: values on a coarse grid; ids a permutation.
    y = jnp.round(jax.random.normal(key, (b, n)) * 8) / 8
    ids = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    if INTERPRET:  # ties broken by id, not by position
      ids = jax.vmap(lambda k: jax.random.permutation(k, n))(
          jax.random.split(key, b)).astype(jnp.int32)
    want = oracle(y, ids)
    cands = {"xla stable": jax.jit(xla_sort),
             "xla unstable(-y,ids)": jax.jit(functools.partial(xla_sort, stable=False)),
             "xla unstable 2 keys": jax.jit(functools.partial(
                 xla_sort, stable=False, num_keys=2)),
             "xla uint32 key stable": jax.jit(xla_key_sort)}
    for w in () if XLA_ONLY else (4, 8, 16) if not INTERPRET else (4,):
      cands[f"bitonic w{w}"] = jax.jit(functools.partial(pallas_bitonic, warps=w))
    for tile, chunk, w in ((64, 256, 4), (128, 256, 4), (128, 512, 8),
                           (32, 512, 4)):
      if tile <= n and chunk <= n and b * n * n <= 2**27 and not XLA_ONLY:
        cands[f"rank t{tile} c{chunk} w{w}"] = jax.jit(functools.partial(
            pallas_rank, tile=tile, chunk=chunk, warps=w))
    for name, fn in cands.items():
      try:
        got = np.asarray(fn(y, ids))
      except Exception as e:  # pylint: disable=broad-except
        print(f"B={b:4d} N={n:5d} {name:24s} FAILED {type(e).__name__}: "
              f"{str(e)[:300]}", flush=True)
        continue
      exact = bool(np.array_equal(got, want))
      if INTERPRET:
        print(f"B={b} N={n} {name:24s} exact={exact}", flush=True)
        continue
      t = bench.time_op(lambda a: fn(*a), [(y, ids)], iters=16, repeats=3)
      print(f"B={b:4d} N={n:5d} {name:24s} {t['us']:8.1f} us  exact={exact}",
            flush=True)


if __name__ == "__main__":
  main()
