"""The ``width`` largest entries of a buffer, in order, without a sort.

``listing_top_ids(y, ids, count, rows, width)`` orders the ``count`` first
entries of each flagged row of a buffer ``[B, N]`` (a mask's ``Listing``:
tempered values ``y`` and their vocab ids, vocab order, -inf holes) and
writes the ids of the ``width`` largest, by descending ``y`` and smallest id
first among equal values: equivalent to ``listing_top_ids_reference``, a
key-value sort of ``(-y, ids)`` cut to ``width``.

A sample sort in two kernels:

1. ``_bucket_kernel`` (one program per row): every ``_STRIDE``-th entry is a
   splitter; the splitters are put in descending order by ranking each
   against all of them (``(N / _STRIDE)^2`` comparisons); an entry's bucket
   is the number of splitters above it (a binary search), its slot in the
   bucket an atomic increment of the bucket's counter; the entries are then
   laid out bucket after bucket (each bucket's offset: the prefix sum of the
   counts), so the layout is ordered by value up to the order inside buckets.
2. ``_rank_kernel`` (grid ``(B, N / _RANK_TILE)``): an entry's position is
   its bucket's offset plus the number of entries of its bucket ahead of it
   (larger, or equal with a smaller id): comparisons within buckets alone,
   about ``_STRIDE`` entries each when the buffer's order is unrelated to
   the values (ties of one value share a bucket).  Tiles whose buckets start
   at or past ``width`` are skipped; the entries at positions below
   ``width`` are written.

Masked scatter stores give their idle lanes an index past the buffer:
interpret mode writes every lane (idle ones rewrite the old value, and
repeated indices keep the last lane) but drops those out of bounds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_STRIDE = 32  # entries per splitter
_BUCKET_CHUNK = 1024  # entries per loop step of the bucket kernel
_SPLITTER_STEP = 32  # splitters compared per loop step of their ranking
_RANK_TILE = 128  # entries each program of the rank kernel places
_RANK_STEP = 64  # entries compared per loop step of the rank kernel
_BUCKET_WARPS = 8
_RANK_WARPS = 4
_HALF = 16  # a layout entry's bucket range: start | end << _HALF


def _pow2_ceil(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def fits(size: int) -> bool:
  """Whether ``listing_top_ids`` orders buffers of ``size`` slots."""
  return 0 < size < 1 << (_HALF - 1) and not size & (size - 1)


def listing_top_ids_reference(y, ids, count, width: int) -> jax.Array:
  """``[B, width]``: the ids of the ``width`` largest of each row's first
  ``count`` finite entries, by descending ``y``, smallest id first on ties
  (-1 past them)."""
  slot = jnp.arange(y.shape[1])
  y = jnp.where((slot < count[:, None]) & (y > -jnp.inf), y, -jnp.inf)
  ids = jnp.where(y > -jnp.inf, ids, jnp.iinfo(jnp.int32).max)
  _, ordered = lax.sort((-y, ids), num_keys=2, is_stable=False)
  ordered = ordered[:, :width]
  return jnp.where(ordered == jnp.iinfo(jnp.int32).max, -1, ordered)


def _claim_slots(counter_ref, row, bucket, valid, interpret: bool):
  """Each valid lane's slot in its bucket: the bucket's counter, incremented.
  On a GPU an atomic add (slots in any order); interpret mode discharges
  atomics on repeated indices non-atomically, so it counts the lanes ahead
  with the same bucket (slots in lane order)."""
  if not interpret:
    return plgpu.atomic_add(counter_ref, (row, bucket),
                            jnp.ones_like(bucket), mask=valid)
  lane = jnp.arange(bucket.shape[0], dtype=jnp.int32)
  ahead = jnp.sum(jnp.where(
      (bucket[None, :] == bucket[:, None]) & valid[None, :] &
      (lane[None, :] < lane[:, None]), 1, 0), axis=1)
  counts = counter_ref[row, :]
  hit = (bucket[:, None] == jnp.arange(counts.shape[0])[None, :]) & (
      valid[:, None])
  counter_ref[row, :] = counts + jnp.sum(jnp.where(hit, 1, 0), axis=0)
  return jnp.sum(jnp.where(hit, counts[None, :], 0), axis=1) + ahead


def _bucket_kernel(flag_ref, count_ref, y_ref, id_ref, _, splitter_ref,
                   counter_ref, offset_ref, meta_ref, lay_y_ref, lay_id_ref,
                   lay_range_ref, finite_ref, *, interpret: bool):
  """One row's layout by bucket (module doc, 1.); ``finite_ref``: the number
  of finite entries laid out.  ``counter_ref`` starts at 0 (aliased input)."""
  row = pl.program_id(0)
  size = y_ref.shape[1]
  num_splitters = splitter_ref.shape[1]
  chunk = min(_BUCKET_CHUNK, size)

  def sync():  # stores read by other threads of the program
    if not interpret:
      plgpu.debug_barrier()

  @pl.when(flag_ref[row] != 0)
  def _():
    n = jnp.minimum(count_ref[row], size)
    m = (n + _STRIDE - 1) // _STRIDE  # splitters: the entries at j * _STRIDE

    # Splitters in descending order (ties by slot): rank of each, by
    # comparison with all of them.
    j = jnp.arange(num_splitters, dtype=jnp.int32)
    s = plgpu.load(y_ref.at[row, j * _STRIDE], mask=j < m, other=-jnp.inf)
    step = min(_SPLITTER_STEP, num_splitters)

    def count_ahead(c, ahead):
      i = c * step + jnp.arange(step, dtype=jnp.int32)
      si = plgpu.load(y_ref.at[row, jnp.where(i < m, i, 0) * _STRIDE],
                      mask=i < m, other=-jnp.inf)
      beats = (si[None, :] > s[:, None]) | (
          (si[None, :] == s[:, None]) & (i[None, :] < j[:, None]))
      return ahead + jnp.sum(jnp.where(beats & (i < m)[None, :], 1, 0),
                             axis=1)

    rank = lax.fori_loop(0, (m + step - 1) // step, count_ahead,
                         jnp.zeros((num_splitters,), jnp.int32))
    plgpu.store(splitter_ref.at[row, jnp.where(j < m, rank, num_splitters)],
                s, mask=j < m)
    sync()

    def bucket_of(y):
      """The number of splitters above ``y`` (binary search)."""
      found = jnp.zeros(y.shape, jnp.int32)
      probe_step = _pow2_ceil(num_splitters)
      while probe_step:
        probe = found + probe_step
        inside = probe <= m
        splitter = plgpu.load(
            splitter_ref.at[row, jnp.where(inside, probe - 1, 0)],
            mask=inside, other=-jnp.inf)
        found = jnp.where(inside & (splitter > y), probe, found)
        probe_step //= 2
      return found

    def load_chunk(c):
      pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
      y = plgpu.load(y_ref.at[row, pos], mask=pos < n, other=-jnp.inf)
      return pos, y, y > -jnp.inf  # holes and padding: -inf

    def claim(c, finite):
      pos, y, valid = load_chunk(c)
      bucket = bucket_of(y)
      slot = _claim_slots(counter_ref, row, bucket, valid, interpret)
      plgpu.store(meta_ref.at[row, pos], (bucket << _HALF) | slot,
                  mask=valid)
      return finite + jnp.sum(jnp.where(valid, 1, 0))

    chunks = (n + chunk - 1) // chunk
    finite_ref[row] = lax.fori_loop(0, chunks, claim, jnp.int32(0))
    sync()
    counts = counter_ref[row, :]
    offset_ref[row, :] = jnp.cumsum(counts) - counts
    sync()

    def place(c, carry):
      pos, y, valid = load_chunk(c)
      meta = plgpu.load(meta_ref.at[row, pos], mask=valid, other=0)
      bucket = meta >> _HALF
      start = plgpu.load(offset_ref.at[row, bucket], mask=valid, other=0)
      end = plgpu.load(offset_ref.at[row, bucket + 1], mask=valid, other=0)
      at = jnp.where(valid, start + (meta & ((1 << _HALF) - 1)), size)
      plgpu.store(lay_y_ref.at[row, at], y, mask=valid)
      plgpu.store(lay_id_ref.at[row, at],
                  plgpu.load(id_ref.at[row, pos], mask=valid, other=0),
                  mask=valid)
      plgpu.store(lay_range_ref.at[row, at], start | (end << _HALF),
                  mask=valid)
      return carry

    lax.fori_loop(0, chunks, place, 0)


def _rank_kernel(flag_ref, finite_ref, lay_y_ref, lay_id_ref, lay_range_ref,
                 out_ref):
  """Places one tile of a row's layout (module doc, 2.)."""
  row, tile = pl.program_id(0), pl.program_id(1)
  n = finite_ref[row]
  first = tile * _RANK_TILE
  width = out_ref.shape[1]
  low_mask = (1 << _HALF) - 1

  @pl.when((flag_ref[row] != 0) & (first < n))
  def _():
    lowest = lay_range_ref[row, first] & low_mask  # the first bucket's start

    @pl.when(lowest < width)
    def _():
      q = first + jnp.arange(_RANK_TILE, dtype=jnp.int32)
      valid = q < n
      q = jnp.where(valid, q, 0)
      y = plgpu.load(lay_y_ref.at[row, q], mask=valid, other=-jnp.inf)
      ids = plgpu.load(lay_id_ref.at[row, q], mask=valid, other=0)
      bounds = plgpu.load(lay_range_ref.at[row, q], mask=valid, other=0)
      start, end = bounds & low_mask, bounds >> _HALF
      highest = jnp.max(jnp.where(valid, end, 0))

      def count_ahead(c, ahead):
        j = lowest + c * _RANK_STEP + jnp.arange(_RANK_STEP, dtype=jnp.int32)
        inside = j < highest
        j = jnp.where(inside, j, 0)
        yj = plgpu.load(lay_y_ref.at[row, j], mask=inside, other=-jnp.inf)
        idj = plgpu.load(lay_id_ref.at[row, j], mask=inside, other=0)
        beats = (yj[None, :] > y[:, None]) | (
            (yj[None, :] == y[:, None]) & (idj[None, :] < ids[:, None]))
        same = (j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])
        return ahead + jnp.sum(
            jnp.where(beats & same & inside[None, :], 1, 0), axis=1)

      ahead = lax.fori_loop(
          0, (highest - lowest + _RANK_STEP - 1) // _RANK_STEP, count_ahead,
          jnp.zeros((_RANK_TILE,), jnp.int32))
      position = start + ahead
      keep = valid & (position < width)
      plgpu.store(out_ref.at[row, jnp.where(keep, position, width)], ids,
                  mask=keep)


def listing_top_ids(y, ids, count, rows, width: int, *,
                    interpret: bool | None = None):
  """``(ordered, finite)``: ``ordered`` ``[B, width]`` holds the ids of each
  ``rows`` row's ``width`` largest finite entries among its first ``count``
  slots of ``y`` ``[B, N]`` (ids ``ids``), by descending ``y``, smallest id
  first on ties (``listing_top_ids_reference``'s; undefined past
  ``min(width, finite)``, and in other rows); ``finite`` ``[B]`` their
  number (0 in other rows).  ``count`` above ``N`` reads all ``N``."""
  batch, size = y.shape
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if not 0 < width <= size or not fits(size):
    raise ValueError(f"width {width} and buffer {size} need 0 < width <= "
                     f"buffer, a power of 2 below 2^{_HALF - 1}")
  num_splitters = max(size // _STRIDE, 1)
  counters = _pow2_ceil(num_splitters + 2)  # buckets 0..m and offset m + 1
  flags = rows.astype(jnp.int32)
  per_row = lambda dtype: jax.ShapeDtypeStruct((batch,), dtype)
  slots = lambda n, dtype: jax.ShapeDtypeStruct((batch, n), dtype)
  *_, lay_y, lay_id, lay_range, finite = pl.pallas_call(
      functools.partial(_bucket_kernel, interpret=interpret),
      out_shape=[slots(num_splitters, jnp.float32),
                 slots(counters, jnp.int32), slots(counters, jnp.int32),
                 slots(size, jnp.int32), slots(size, jnp.float32),
                 slots(size, jnp.int32), slots(size, jnp.int32),
                 per_row(jnp.int32)],
      grid=(batch,), input_output_aliases={4: 1},
      compiler_params=plgpu.CompilerParams(num_warps=_BUCKET_WARPS,
                                           num_stages=1),
      interpret=interpret, name="jaxsample_listing_buckets")(
          flags, count.astype(jnp.int32), y, ids.astype(jnp.int32),
          jnp.zeros((batch, counters), jnp.int32))
  ordered = pl.pallas_call(
      _rank_kernel, out_shape=slots(width, jnp.int32),
      grid=(batch, pl.cdiv(size, _RANK_TILE)),
      compiler_params=plgpu.CompilerParams(num_warps=_RANK_WARPS,
                                           num_stages=1),
      interpret=interpret, name="jaxsample_listing_ranks")(
          flags, finite, lay_y, lay_id, lay_range)
  return ordered, jnp.where(rows, finite, 0)
