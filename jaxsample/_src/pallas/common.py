"""Pieces shared by the Pallas (Triton) kernels: launch plan, GPU math, block loop.

Every kernel walks one row per program over a *split* of the vocabulary
(grid ``(B, S)``), in steps of one RNG tile made of power-of-2 chunks loaded
with masks (any ``V`` works).  ``chunk_loop`` is that walk; it hands each
chunk its vocab ids and, for sampling kernels, the random bits of
``jaxsample._src.rng`` for those ids, so every kernel draws the reference's noise.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxsample._src import reference, rng, rowwise
from jaxsample._src import tuning

__all__ = ["argmax_finish", "argmax_update", "below_floor", "Chunk",
           "chunk_loop", "excluding_loader", "floored_loader", "gpu_div",
           "gpu_exp2_approx", "gpu_mulhilo", "gpu_mulhilo_pair",
           "join_fp64_words", "KernelMath", "KernelPlan", "key_value",
           "logit_floor", "make_plan", "Noise", "order_key", "pallas_call",
           "race_plan", "row_chunk_loader",
           "split_argmax", "split_fp64_words", "split_sumexp", "STREAM_DTYPES",
           "table_row", "Tile", "tile_loop"]

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """Static launch plan for a ``[B, V]`` row-walking kernel.

  Attributes:
    chunk: elements per masked load (power of 2).
    tile: elements per RNG tile (4 x ``PHILOX_LANES`` for philox).
    num_splits: programs per row (grid ``(B, num_splits)``).
    steps: tiles per program; ``num_splits * steps * tile >= V``.
    num_warps, num_stages: Triton compiler parameters.
    interpret: run in Pallas interpret mode (CPU).
    lane_groups: loop steps per tile.  A step loads one chunk from each of
      the tile's ``tile / (chunk * lane_groups)`` segments of
      ``chunk * lane_groups`` ids: with 4 groups of 128 lanes a 1-warp program
      walks a Philox tile in 4 steps (lanes ``128 g + l`` of each word).
  """

  chunk: int
  tile: int
  num_splits: int
  steps: int
  num_warps: int
  num_stages: int
  interpret: bool
  lane_groups: int = 1

  @property
  def split_len(self) -> int:
    return self.steps * self.tile

  @property
  def chunk_stride(self) -> int:
    """Distance between the ids of a step's successive chunks."""
    return self.chunk * self.lane_groups

  def compiler_params(self):
    return plgpu.CompilerParams(num_warps=self.num_warps,
                                num_stages=self.num_stages)


def pallas_call(kernel, *, out_shape,
                compiler_params: plgpu.CompilerParams, **kwargs):
  """``pl.pallas_call`` with Triton ``compiler_params`` (the Triton lowering,
  ``tests/test_lowering.py``), whose outputs vary over the manual mesh axes
  its operands vary over (inside ``jax.shard_map`` with ``check_vma``, which
  needs each out ``ShapeDtypeStruct``'s ``manual_axis_type``); a kernel
  runs on its shard's rows, so its outputs vary wherever its inputs do."""
  if not isinstance(compiler_params, plgpu.CompilerParams):
    raise TypeError("compiler_params must be plgpu.CompilerParams; got "
                    f"{type(compiler_params).__name__}")

  def call(*operands):
    shapes = out_shape
    if jax.sharding.get_abstract_mesh().manual_axes:
      axes = frozenset().union(*(rowwise.varying_axes(a) for a in operands))
      mat = jax.typeof(operands[0]).manual_axis_type.update(varying=axes)
      shapes = jax.tree.map(
          lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                         manual_axis_type=mat), out_shape)
    return pl.pallas_call(kernel, out_shape=shapes,
                          compiler_params=compiler_params, **kwargs)(*operands)

  return call


def make_plan(batch: int, vocab: int, *, chunk: int, tile: int,
              num_warps: int, num_splits: int | None, num_stages: int,
              occupancy: tuning.Occupancy, lane_groups: int = 1) -> KernelPlan:
  """The plan of ``tile``-wide steps over ``[B, V]``: ``num_splits`` programs
  per row (None: ``occupancy.splits``), at most one per tile, none starting
  past ``V``; on a batch shard, as for the whole batch
  (``Occupancy.batch_shards``)."""
  n_tiles = -(-vocab // tile)
  splits = min(num_splits or occupancy.splits(occupancy.planned_rows(batch),
                                              n_tiles, num_warps), n_tiles)
  steps = -(-n_tiles // splits)
  splits = -(-n_tiles // steps)  # No split starts past V.
  return KernelPlan(chunk=chunk, tile=tile, num_splits=splits, steps=steps,
                    num_warps=num_warps, num_stages=num_stages,
                    interpret=jax.default_backend() != "gpu",
                    lane_groups=lane_groups)


def race_plan(batch: int, vocab: int, launch: tuning.RaceLaunch,
              occupancy: tuning.Occupancy, *, generator: str,
              fp64: bool) -> KernelPlan:
  """The plan of a Gumbel race (``tuning.RaceLaunch``).

  Philox plans load 4 elements per thread per chunk (``128 * num_warps``
  lanes, ``lane_groups`` steps per tile) and by default use 1-warp programs
  from ``launch.one_warp_batch`` rows on with FP32 noise: no block
  reductions, so no barriers, in the loop (Gumbel kernel on an H100, B = 128:
  41.7 us against 44.4 with 4 warps; B = 512: 120.3 against 132.2; but B = 1:
  7.1 against 5.3, and FP64 noise at B = 128: 135 against 87,
  ``benchmarks/results/2026-11-24-one-warp``).  Other plans: 4 warps,
  ``launch.block_size`` per load.
  """
  lanes = generator == "philox"
  num_warps = launch.warps(occupancy.planned_rows(batch), fp64=fp64,
                           lanes=lanes)
  if lanes:
    chunk, tile = min(rng.PHILOX_LANES, 128 * num_warps), rng.PHILOX_TILE
  else:
    chunk = tile = launch.block_size
  return make_plan(batch, vocab, chunk=chunk, tile=tile, num_warps=num_warps,
                   num_splits=launch.num_splits, num_stages=launch.num_stages,
                   occupancy=occupancy,
                   lane_groups=rng.PHILOX_LANES // chunk if lanes else 1)


# ---------------------------------------------------------------------------
# Exact arithmetic that Triton would otherwise approximate or cannot lower.
# ---------------------------------------------------------------------------


def _asm(instruction: str, constraint: str, dtypes, *args):
  return plgpu.elementwise_inline_asm(
      instruction, args=list(args), constraints=constraint, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, d)
                           for d in dtypes])


def gpu_mulhilo(a: jax.Array, b: jax.Array):
  """(high, low) words of a uint32 product, from one ``mul.wide.u32``.

  Triton lowers no mulhi.  The 64-bit product comes out of inline asm (traced
  with x64 on, so its int64 result is not narrowed) and splits into its
  words; one ``IMAD.WIDE`` per product instead of a ``mul.hi`` and a
  ``mul.lo`` (Gumbel kernel on an H100: 44.9 instead of 47.0 us at B = 128,
  ``benchmarks/results/2026-11-24-compact-scan``).
  """
  a, b = jnp.broadcast_arrays(a, b)
  to_i32 = lambda v: lax.bitcast_convert_type(v, jnp.int32)
  with jax.enable_x64(True):
    (wide,) = _asm("mul.wide.u32 $0, $1, $2;", "=l,r,r", (jnp.int64,),
                   to_i32(a), to_i32(b))
    words = [lax.shift_right_logical(wide, jnp.int64(32)).astype(jnp.int32),
             wide.astype(jnp.int32)]
  return tuple(lax.bitcast_convert_type(w, jnp.uint32) for w in words)


def gpu_mulhilo_pair(a: jax.Array, b: jax.Array):
  """``gpu_mulhilo`` from a ``mul.hi.u32`` and a ``mul.lo``: faster for the
  FP64 noise, whose two Philox calls per element make ``mul.wide``'s 64-bit
  products costlier (on an H100 at B = 128: 90.3 us instead of 107.8,
  ``benchmarks/results/2026-11-24-one-warp``)."""
  a, b = jnp.broadcast_arrays(a, b)
  to_i32 = lambda v: lax.bitcast_convert_type(v, jnp.int32)
  (hi,) = _asm("mul.hi.u32 $0, $1, $2;", "=r,r,r", (jnp.int32,), to_i32(a),
               to_i32(b))
  return lax.bitcast_convert_type(hi, jnp.uint32), a * b


def gpu_div(x: jax.Array, t: jax.Array) -> jax.Array:
  """fp32 ``x / t`` exactly as XLA computes it on NVIDIA GPUs: ``div.full.f32``
  (within 2 ulp, not always the IEEE quotient; ``scripts/check_division.py``
  at d785b4c found it equal to XLA's quotient on every element on an H100)."""
  x, t = jnp.broadcast_arrays(x, t)
  (q,) = _asm("div.full.f32 $0, $1, $2;", "=f,f,f", (jnp.float32,), x, t)
  return q


def gpu_exp2_approx(x: jax.Array) -> jax.Array:
  """``2^x`` by the hardware ``ex2.approx`` (relative error < 2^-22)."""
  (y,) = _asm("ex2.approx.ftz.f32 $0, $1;", "=f,f", (jnp.float32,), x)
  return y


@dataclasses.dataclass(frozen=True)
class KernelMath:
  """Math that differs between a GPU lowering and interpret mode (bit-identical)."""

  interpret: bool

  def mulhilo(self, a, b):
    return rng.mulhilo(a, b) if self.interpret else gpu_mulhilo(a, b)

  def mulhilo_pair(self, a, b):
    return rng.mulhilo(a, b) if self.interpret else gpu_mulhilo_pair(a, b)

  def div(self, x, t):
    return x / t if self.interpret else gpu_div(x, t)

  def temper(self, x, t):
    """``reference.divide``'s ``x / t`` for a row's ``t``: ``div.full.f32``
    on a GPU, ``x * (1 / t)`` in interpret mode."""
    return x * (1.0 / t) if self.interpret else gpu_div(x, t)

  def exp2_approx(self, x):
    """``2^x`` to within 2^-22 relative: only for bounds and sums, never ties."""
    return jnp.exp2(x) if self.interpret else gpu_exp2_approx(x)


# ---------------------------------------------------------------------------
# The block loop.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One chunk of a row: its first local vocab id, the local ids of its lanes
  and their random bits (or None)."""

  start: jax.Array
  index: jax.Array
  bits: Any


def table_row(table_ref, row, dtypes) -> list[jax.Array]:
  """Row ``row``'s scalars, read in a kernel from a ``rowwise.pack_rows``
  table of per-row kernel scalars whose columns have ``dtypes`` (32-bit)."""
  return [lax.bitcast_convert_type(table_ref[i, row], d)
          for i, d in enumerate(dtypes)]


STREAM_DTYPES = (jnp.uint32,) * 4
"""``table_row`` dtypes of ``RowStreams``' fields."""


@dataclasses.dataclass(frozen=True)
class Noise:
  """Noise for the chunk loop: generator, row stream, global vocab offset."""

  generator: str
  stream: rng.RowStreams
  vocab_offset: jax.Array
  wide: bool


@dataclasses.dataclass(frozen=True)
class Tile:
  """One loop step of ``tile_loop``: ``num_chunks`` chunks of the RNG tile at
  ``start``, chunk ``c`` at local ids ``start + offset + c * stride + lanes``.

  ``bits()`` emits the generator's code for the step's random bits where it
  is called, so a step can draw noise only inside the branch that needs it.
  """

  start: jax.Array
  offset: jax.Array | int
  lanes: jax.Array
  stride: int
  num_chunks: int
  noise: Noise | None
  kmath: KernelMath

  def chunk_start(self, c: int) -> jax.Array:
    return self.start + self.offset + c * self.stride

  def index(self, c: int) -> jax.Array:
    """Local vocab ids of chunk ``c``."""
    return self.chunk_start(c) + self.lanes.astype(jnp.int32)

  def bits(self, anchor: jax.Array | None = None) -> list:
    """Per-chunk random bits of the tile's global ids (``Noise`` required).

    ``anchor``, one chunk of the logits as loaded, gives the bits its
    lanes' register layout: Triton otherwise computes the generator in the
    layout of an iota and moves the bits into the logits' layout through
    shared memory, two barriers per chunk (on an H100 the Gumbel kernel
    takes 46.4 us instead of 48.9 at B = 128 with it,
    ``benchmarks/results/2026-11-24-compact-scan``).
    """
    noise = self.noise
    global_start = (self.start + noise.vocab_offset).astype(jnp.uint32)
    lanes = self.lanes + jnp.asarray(self.offset).astype(jnp.uint32)
    if anchor is not None:  # + 0 from the anchor: x > x is false, NaN included
      lanes = lanes + indicator(anchor > anchor).astype(jnp.uint32)
    return [b for _, b in rng.tile_bits(noise.generator, noise.stream,
                                        global_start, lanes,
                                        wide=noise.wide,
                                        mulhilo=self.kmath.mulhilo_pair
                                        if noise.wide else self.kmath.mulhilo)]

  def chunks(self, anchor: jax.Array | None = None) -> list[Chunk]:
    """The tile's chunks with their bits (drawn here when ``noise`` is set,
    in the layout of ``anchor``: ``bits``)."""
    bits = self.bits(anchor) if self.noise else [None] * self.num_chunks
    return [Chunk(self.chunk_start(c), self.index(c), b)
            for c, b in enumerate(bits)]


def tile_loop(plan: KernelPlan, kmath: KernelMath, split_start, vocab: int,
              load: Callable[[jax.Array, jax.Array], Any],
              step: Callable[[Any, Tile, tuple], Any], carry, *,
              noise: Noise | None = None):
  """Folds ``step(carry, tile, loaded)`` over the RNG tiles of one split,
  ``plan.lane_groups`` steps per tile.

  ``load(start, mask)`` reads one chunk (masked lanes filled by the caller's
  choice); ``loaded`` holds the step's chunks.  Loads run one step ahead of
  the compute: each step issues the next step's loads before it processes the
  current one, so a program keeps two steps of reads in flight (the loop body
  holds data-dependent branches that Triton's pipeliner does not reorder).
  ``vocab`` is the local row length (loads past it are masked).  With
  ``noise``, ``tile.bits()`` are the random bits of the global vocab ids
  (``vocab_offset`` + local id, ``vocab_offset`` a multiple of the tile).
  """
  lanes = jnp.arange(plan.chunk, dtype=jnp.uint32)
  lanes_i32 = lanes.astype(jnp.int32)
  offsets = range(0, plan.tile, plan.chunk_stride)
  split_end = jnp.minimum(split_start + plan.split_len, vocab)
  groups = plan.lane_groups

  def position(i):
    """Tile start and lane offset of step ``i``."""
    if groups == 1:
      return split_start + i * plan.tile, 0
    # groups is a power of 2 (jnp's % and // do not lower in Triton here).
    tile_index = lax.shift_right_logical(i, jnp.int32(groups.bit_length() - 1))
    group = i & (groups - 1)
    return split_start + tile_index * plan.tile, group * plan.chunk

  def load_step(i):
    tile_start, lane_offset = position(i)
    return tuple(load(tile_start + lane_offset + offset,
                      tile_start + lane_offset + offset + lanes_i32 < split_end)
                 for offset in offsets)

  def body(i, state):
    carry, loaded = state
    upcoming = load_step(i + 1)
    tile_start, lane_offset = position(i)
    tile = Tile(tile_start, lane_offset, lanes, plan.chunk_stride,
                len(offsets), noise, kmath)
    return step(carry, tile, loaded), upcoming

  carry, _ = fori_loop(0, plan.steps * groups, body,
                       (carry, load_step(jnp.int32(0))))
  return carry


def chunk_loop(plan: KernelPlan, kmath: KernelMath, split_start, vocab: int,
               load: Callable[[jax.Array, jax.Array], Any],
               step: Callable[[Any, Chunk, Any], Any], carry, *,
               noise: Noise | None = None):
  """``tile_loop`` folding ``step(carry, chunk, loaded)`` chunk by chunk
  (every chunk's bits drawn up front)."""

  def tile_step(carry, tile, loaded):
    anchor = jax.tree.leaves(loaded[0])[0]  # loads may yield tuples
    for chunk, value in zip(tile.chunks(anchor), loaded):
      carry = step(carry, chunk, value)
    return carry

  return tile_loop(plan, kmath, split_start, vocab, load, tile_step, carry,
                   noise=noise)


def indicator(mask: jax.Array, value: int = 1) -> jax.Array:
  """int32 ``value`` where ``mask``, 0 elsewhere (int32 with x64 on too,
  where a Python int would make it int64)."""
  return jnp.where(mask, jnp.int32(value), jnp.int32(0))


def fori_loop(lower, upper, body, init):
  """``lax.fori_loop`` whose ``body`` gets an int32 index (with x64 on,
  Python-int bounds give an int64 one; the bounds stay as given, so Python
  ints still make a scan of a static trip count)."""
  return lax.fori_loop(lower, upper, lambda i, carry: body(
      lax.convert_element_type(i, jnp.int32), carry), init)


def count(mask: jax.Array) -> jax.Array:
  """The int32 number of True entries of ``mask`` (``jnp.sum`` of ints
  accumulates in int64 with x64 on)."""
  return jnp.sum(indicator(mask), dtype=jnp.int32)


def row_chunk_loader(x_ref, row, size: int, fill=-jnp.inf):
  """``load(start, mask)`` for ``chunk_loop``: streams ``x_ref[row, start:start+size]``."""

  def load(start, mask):
    return plgpu.load(x_ref.at[row, pl.ds(start, size)], mask=mask, other=fill,
                      eviction_policy="evict_first")

  return load


def order_key(y: jax.Array) -> jax.Array:
  """uint32 keys ordered like the fp32 values (-0.0 and +0.0 share a key)."""
  # A select, not ``y + 0.0``: XLA folds that add away, and -0.0 stays.
  bits = lax.bitcast_convert_type(jnp.where(y == 0, 0.0, y), jnp.uint32)
  negative = (bits >> jnp.uint32(31)) != 0
  return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def key_value(key: jax.Array) -> jax.Array:
  """Inverse of ``order_key``."""
  positive = (key >> jnp.uint32(31)) != 0
  bits = jnp.where(positive, key & jnp.uint32(0x7FFFFFFF), ~key)
  return lax.bitcast_convert_type(bits, jnp.float32)


_POS_INF_KEY = 0xFF800000  # order_key(inf); larger keys are NaN patterns


def logit_floor(floor, t):
  """``[B]``: the least fp32 ``x`` with ``reference.divide(x, t) >= floor`` (rows'
  kept sets ``{y >= floor}``, temperatures ``t``; ``t <= 0`` reads as 1), so
  that ``x < logit_floor`` iff ``y < floor`` for every non-NaN ``x`` (the
  division is monotone in ``x``): -inf where ``floor`` is -inf, +inf where
  only ``x = inf`` reaches it.  XLA, 32 unrolled steps of a bit-by-bit
  search over ``order_key``s; the kernels then compare logits, not
  quotients."""
  floor = floor.astype(jnp.float32)
  t = jnp.where(t > 0, t, 1.0).astype(jnp.float32)
  below = jnp.zeros(floor.shape, jnp.uint32)  # the largest key not reaching
  for bit in range(31, -1, -1):
    key = below | jnp.uint32(1 << bit)
    reaches = ((key > jnp.uint32(_POS_INF_KEY)) |
               (reference.divide(key_value(key), t) >= floor))
    below = jnp.where(reaches, below, key)
  return key_value(below + jnp.uint32(1))


def below_floor(x, x_floor):
  """Where ``x`` lies below a truncated row's kept set: ``x < x_floor``, with
  ``x_floor = logit_floor(floor, T)``, is ``y < floor`` for the reference's
  ``y = x / T`` (``KernelMath.temper``) bit for bit.  False for a NaN ``x``
  and wherever ``floor`` is -inf (no filter: the row as it is)."""
  return x.astype(jnp.float32) < x_floor


def floored_loader(load, x_floor):
  """``load`` with the elements ``below_floor(x, x_floor)`` read as -inf."""

  def floored(start, mask):
    x = load(start, mask)
    return jnp.where(below_floor(x, x_floor), -jnp.inf, x)

  return floored


def excluding_loader(load, excluded, size: int):
  """``load`` (chunks of ``size``) with local vocab id ``excluded`` (-1:
  none) read as -inf: the id leaves the load's mask, so a chunk costs one
  compare per element (no index vector, no select)."""
  lanes = jnp.arange(size, dtype=jnp.int32)

  def excluding(start, mask):
    return load(start, mask & (lanes != (excluded - start).astype(jnp.int32)))

  return excluding


def argmax_update(best, best_index, value, index):
  """Lane-wise running argmax; smaller ids win ties."""
  better = (value > best) | ((value == best) & (index < best_index))
  return jnp.where(better, value, best), jnp.where(better, index, best_index)


def argmax_finish(best, best_index):
  """Reduces lane-wise (best, index) to the row's max and its smallest index."""
  top = jnp.max(best)
  index = jnp.min(jnp.where(best == top, best_index, jnp.iinfo(jnp.int32).max))
  return top, index


_LOG2E = 1.4426950408889634


def split_argmax(plan: KernelPlan, kmath: KernelMath, split_start, vocab: int,
                 load, *, count_finite: bool = False):
  """``(max, argmax)`` of one split's logits, NaN read as +inf (smallest id
  on ties; an all -inf split reports its first id); with ``count_finite``,
  also the split's number of entries ``> -inf`` (NaN not counted)."""

  def step(carry, chunk, x):
    best, index, finite = carry
    x = x.astype(jnp.float32)
    if count_finite:
      finite = finite + indicator(x > -jnp.inf)
    return *argmax_update(best, index, jnp.where(x != x, jnp.inf, x),
                          chunk.index), finite

  lanes = jnp.arange(plan.chunk, dtype=jnp.int32)
  init = (jnp.full((plan.chunk,), -jnp.inf, jnp.float32), split_start + lanes,
          jnp.zeros((plan.chunk,) if count_finite else (), jnp.int32))
  best, index, finite = chunk_loop(plan, kmath, split_start, vocab, load, step,
                                   init)
  counted = (jnp.sum(finite, dtype=jnp.int32),) if count_finite else ()
  return argmax_finish(best, index) + counted


def split_sumexp(plan: KernelPlan, kmath: KernelMath, split_start, vocab: int,
                 load, t, *, fold=None):
  """``(m, s)`` of one split of logits ``x`` (NaN read as +inf): ``m =
  max(x)`` and ``s = sum exp((x - m) / T)``; with
  ``fold = (init, fn)``, also ``fn``'s fold over the chunks, ``carry =
  fn(carry, chunk, x)`` on the sanitized fp32 ``x`` (``-inf`` past V).

  Lane-wise online sum-exp, one ``ex2.approx`` per element and no block
  reduction in the loop: the larger of ``x`` and the lane max is the lane's
  reference.
  """
  scale = _LOG2E / t
  extra_init, extra_fn = fold or ((), lambda carry, chunk, x: carry)

  def step(carry, chunk, x):
    lane_max, s, extra = carry
    x = x.astype(jnp.float32)
    x = jnp.where(x != x, jnp.inf, x)
    e = kmath.exp2_approx(-jnp.abs(x - lane_max) * scale)
    e = jnp.where(x == -jnp.inf, 0.0, jnp.where(x == lane_max, 1.0, e))
    s = jnp.where(x > lane_max, s * e + 1.0, s + e)
    return jnp.maximum(lane_max, x), s, extra_fn(extra, chunk, x)

  init = (jnp.full((plan.chunk,), -jnp.inf, jnp.float32),
          jnp.zeros((plan.chunk,), jnp.float32), extra_init)
  lane_max, s, extra = chunk_loop(plan, kmath, split_start, vocab, load, step,
                                  init)
  m = jnp.max(lane_max)
  ref = jnp.where(m == -jnp.inf, 0.0, m)
  s = jnp.where(lane_max > -jnp.inf,
                s * kmath.exp2_approx((lane_max - ref) * scale), 0.0)
  return (m, jnp.sum(s)) + ((extra,) if fold else ())


def split_fp64_words(value: jax.Array):
  """fp64 scalar as (high, low) uint32 words.

  A 64-bit kernel output would be narrowed when an outer ``jit`` lowers the
  kernel outside the x64 scope; 32-bit words cross the boundary intact.
  """
  bits = lax.bitcast_convert_type(value, jnp.uint64)
  return ((bits >> jnp.uint64(32)).astype(jnp.uint32),
          (bits & jnp.uint64(0xFFFFFFFF)).astype(jnp.uint32))


def join_fp64_words(hi: jax.Array, lo: jax.Array) -> jax.Array:
  """The fp64 value of ``split_fp64_words``' ``(hi, lo)``."""
  bits = (hi.astype(jnp.uint64) << jnp.uint64(32)) | lo.astype(jnp.uint64)
  return lax.bitcast_convert_type(bits, jnp.float64)
