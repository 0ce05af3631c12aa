"""Sorting-free truncated sampling: exact top-k / top-p / min-p kept sets.

Design (the pass count is bounded: two passes over each truncating row and
one small selection over a bounded candidate buffer; rows whose kept set
does not fit the buffer are reported ``complete = False`` and finished by
``sample_large``: window searches, then at most ``_PIVOT_PASSES`` passes of
the pivot search per threshold no window holds; no sort anywhere):

1. ``stats`` pass (grid ``(B, S)``): per vocab split, the max of the
   sanitized logits ``x``, ``sum exp(y - max)`` (``y = x / T``), the count of
   finite entries and *segment maxima*: the max of ``x`` over each segment of
   contiguous ids (about ``_SEGMENTS_PER_ROW`` per row, ``_segment_size``).
   The segment maxima are actual row elements, so every bound computed from
   them is conservative: the ``k``-th largest segment maximum is ``<=`` the
   row's ``k``-th largest value, and a value whose segment-maxima mass already
   reaches ``p * Z`` is ``<=`` the top-p threshold.  Rows that may keep a
   large set also write their *sample*, every ``_SAMPLE_STRIDE``-th ``x``,
   from the same loads.
2. ``bound`` select (grid ``(B,)``) combines the splits' stats (row max,
   mass, ``t1``) and, on the segment maxima, gives a per-row lower bound
   ``L <= max(t1, t2, t3)`` of the kept set's threshold, so the kept set is
   contained in the *candidates* ``{y >= L}``: one bit-by-bit search over
   the order keys of the segment maxima, for ``t2`` when top-k is on, else
   for ``t3``, stopped after 20 bits (the bound rounds down).  It also lists
   the segments whose maximum reaches ``L``: every candidate lies in one.
3. ``compact`` pass (grid ``(B, S)``): every candidate is written with its
   vocab id to the split's slice of a candidate buffer, in vocab order (a
   cheap filter admits a few elements just below ``L``, dropped afterwards).
   A row with at most ``_LIST_CAP`` listed segments reads only those (a few
   percent of the row for top-k 50) when its outside mass is not needed: top-k
   on, ``L = t1``, or min-p off (outside mass = the row's mass less the
   candidates').  Other rows read the whole row and also sum the mass of the
   min-p survivors below ``L`` (top-p's normalizer when top-k is off).  The
   candidates' Gumbel noise is then drawn for their ids alone
   (``rng.bits_at``), so no RNG runs over the row.
4. ``select`` on the candidates (final mode) finds the exact thresholds by
   comparing each candidate with every min-p survivor among the ``n`` filled
   slots (no sort, no search; ``n x pow2ceil(n)`` comparisons): the ``k``-th
   largest survivor (``t2``) and the largest value whose upper mass reaches
   ``p`` times the survivors' mass (``t3``), then the kept count and mass;
   the same counts give each kept id its position in descending order (the
   sampling mask).  The token is the largest race value among kept
   candidates (smallest id on ties: the buffer is in vocab order).

Large kept sets (rows with ``k > C / 2``, and rows without top-k whose
sample, every ``_SAMPLE_STRIDE``-th logit written by the stats pass, puts
more than ``C / 2`` candidates above ``L``; ``sample_large``): min-p alone keeps
``{y >= t1}``.  Top-k and top-p thresholds each come from a window search:
``threshold_window`` places a window ``[lower, upper)`` of sample ranks
around the threshold estimated from the sample; the compact pass, windowed,
writes the window's elements and sums the count and mass above and the mass
below it; a bound-mode search over the window finds the exact threshold
bit by bit, from the high key bits the window's ends share (top-k first;
top-p then searches above ``max(t1, t2)``).  Then
the Gumbel kernel with a ``floor`` races the kept set and counts it.  Three
passes over the row (stats, windowed compact, Gumbel), four with top-k and
top-p both on; a window that missed the threshold or overflowed its buffer
(rows whose ties span the window, and the rare rows whose sample misleads
the estimate by more than 5 standard deviations) leaves the threshold to
``pivot_threshold``: at most ``_PIVOT_PASSES`` passes, each splitting the
order-key interval that holds it at ``_PIVOTS`` pivots, in one kernel (one
program per row; rows without a miss skip it, so no ``lax.cond`` guards
any of these searches).  The window search
also measures the kept mass (the spec sampler's normalizer).  The sampling
mask of a large kept set (``large_kept_ids``) rides on launches the row
runs anyway: a mask of ``K_cap <= C / 2`` ids on the narrow pass, which
takes large rows as top-k = ``K_cap`` rows (the bound select searches their
``K_cap``-th largest segment maximum and writes the pass's param table), so
its candidate buffer lists their ``K_cap`` largest values by rank; a wider
mask on the row's first window search: its window kernel also places a
listing window by count (the ``K_cap``-th largest value's, with no upper
end) and its compact pass also fills the listing's buffer, from the same loads; a search by count in
that buffer finds the ``K_cap``-th largest value and the ids are sorted as
``[B, K_cap]`` pairs.  No pass or window kernel of its own.

Every partial result is a max, a sum or a list of candidates in vocab order,
so the vocab-parallel sampler combines shards exactly as it combines splits:
a max/sum of the stats, one candidate buffer per shard concatenated in shard
order.

Arithmetic: ``y`` and the race are the reference's bit for bit (XLA's division,
the same noise), so ``t1``, ``t2``, ties and tokens match exactly.  Masses are
fp32 sums in a different order than the reference's sorted cumsum: a row whose
top-p crossing lies within fp32 rounding of ``p`` times its mass may keep an
adjacent threshold (tests treat such rows with the oracle's admissible sets).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxsample import reference, rng, rowwise
from jaxsample.pallas import common, gumbel
from jaxsample.params import SamplerConfig, SamplingParams

_LOG2E = 1.4426950408889634
# Top-p bounds from segment maxima aim this much above ``p * Z`` so fp32 sums
# never place the bound above the exact threshold.
_BOUND_MARGIN = 2.0**-10
# |x * (1 / T) - x / T| <= 2 ulp: the filter widens the candidate test by this.
_FILTER_SLACK = 2.0**-21
_SEGMENTS_PER_ROW = 2048  # segment maxima per row (about), before padding
_MIN_SEGMENT = 16
# Rows whose bound is reached by at most this many segments read only those
# in the compact pass (``Segments``).
_LIST_CAP = 256
# The bound select: on an H100, 8 warps beat 4 and 2 (6.9 against 8.4 and
# 10.6-12.0 us at B = 128, top-k 50 + top-p 0.9).
_BOUND_WARPS = 8
_SELECT_WARPS = 4  # the final select
# The pack kernel: 8 warps at least (4.6 -> 3.9 us at B = 128 on an H100),
# 16 for window buffers.
_PACK_WARPS = 8
# Chunk, chunks per step and warps of the two passes over the row (config's
# block_size and num_warps override; on an H100, 4 x 512 with 4 warps beat
# 1 x 1024, 2 x 1024 and 4 x 1024 with 8 warps: scripts/profile_truncation.py).
_PASS_BLOCK = 512
_PASS_WARPS = 4


_PASS_TILE = 4  # chunks per loop step (loads run one step ahead)
# The compact pass's chunk, chunks per step and warps: on an H100, 1 x 1024
# beat 4 x 512, 2 x 1024 and 1 x 2048 with 4 or 8 warps (69.0 against 74.0,
# 96.6, 77.5 and 80.2 us for a window pass at B = 128; 5.9 against 6.7 us for
# top-k 50 + top-p 0.9; benchmarks/results/2026-11-24-idle-skips).
_COMPACT_BLOCK = 1024
_COMPACT_TILE = 1
_COMPACT_WARPS = 4


def _pass_plan(batch, vocab, dtype, config: SamplerConfig, *,
               block: int | None = None, per_tile: int | None = None,
               warps: int | None = None) -> common.KernelPlan:
  """The plan of the passes over the row (default ``_PASS_*``).  Interpret
  mode (CPU) walks one chunk per step: the tile only schedules the loads
  (the results do not depend on it beyond fp32 summation order), and
  interpreting it would quadruple the compiled loop body."""
  block, per_tile = block or _PASS_BLOCK, per_tile or _PASS_TILE
  # A chunk holds whole groups of the sample's stride.
  plan = common.make_plan(batch, vocab, dtype, dataclasses.replace(
      config, block_size=max(config.block_size or block, _SAMPLE_STRIDE),
      num_warps=config.num_warps or warps or _PASS_WARPS), generator=None)
  if per_tile == 1 or plan.interpret:
    return plan
  tiles = -(-vocab // (plan.chunk * per_tile))
  splits = min(plan.num_splits, tiles)
  steps = -(-tiles // splits)
  return dataclasses.replace(plan, tile=plan.chunk * per_tile,
                             num_splits=-(-tiles // steps), steps=steps)


def _sanitize(x):
  x = x.astype(jnp.float32)
  return jnp.where(x != x, jnp.inf, x)


# ---------------------------------------------------------------------------
# Pass 1: stats, and the bound of the kept set.
# ---------------------------------------------------------------------------


def _segment_size(vocab: int, chunk: int) -> int:
  """Ids per segment: about ``_SEGMENTS_PER_ROW`` segments per row, a power of
  2 between ``_MIN_SEGMENT`` and the chunk."""
  return min(chunk, max(_MIN_SEGMENT, _pow2_ceil(-(-vocab // _SEGMENTS_PER_ROW))))


def _row_flags(row, param_ref, capacity: int):
  """``(active, sampled)`` of a row: sampled with a filter on (canonical
  params), and also without top-k or with ``k > C / 2``, so that its kept
  set may be large and its sample is written."""
  params, _ = _row_params(param_ref, row)
  active = (params.temperature > 0) & params.truncates()
  return active, active & (
      (params.top_k == 0) | (params.top_k > capacity // 2))


def _stats_kernel(param_ref, x_ref, max_ref, sumexp_ref, finite_ref,
                  segment_ref, sample_ref, *, plan: common.KernelPlan,
                  vocab: int, segment: int, capacity: int):
  row, split = pl.program_id(0), pl.program_id(1)
  active, sampled = _row_flags(row, param_ref, capacity)

  @pl.when(active)
  def _():
    math = common.KernelMath(plan.interpret)
    per_chunk = plan.chunk // segment
    sampled_per_chunk = plan.chunk // _SAMPLE_STRIDE
    first_in_group = lax.broadcasted_iota(
        jnp.int32, (plan.chunk,), 0) % _SAMPLE_STRIDE == 0

    def fold(finite, chunk, x):
      """The chunk's segment maxima and sample (the first element of every
      ``_SAMPLE_STRIDE``, on ``sampled`` rows); the finite count.  (A strided
      load of the sample from the row, in place of the reduction per group,
      made the pass 1.9x slower on an H100.)"""
      segment_ref[row, pl.ds(chunk.start // segment, per_chunk)] = jnp.max(
          x.reshape(per_chunk, segment), axis=1)

      @pl.when(sampled)
      def _():
        first = jnp.where(first_in_group, x, -jnp.inf)
        sample_ref[row, pl.ds(chunk.start // _SAMPLE_STRIDE,
                              sampled_per_chunk)] = jnp.max(
                                  first.reshape(sampled_per_chunk,
                                                _SAMPLE_STRIDE), axis=1)

      return finite + jnp.where(x > -jnp.inf, 1, 0)

    top, sumexp, finite = common.split_sumexp(
        plan, math, split * plan.split_len, vocab,
        common.row_chunk_loader(x_ref, row, plan.chunk),
        _row_params(param_ref, row)[0].temperature,
        fold=(jnp.zeros((plan.chunk,), jnp.int32), fold))
    max_ref[row, split] = top
    sumexp_ref[row, split] = sumexp
    finite_ref[row, split] = jnp.sum(finite)


_PARAM_DTYPES = (jnp.float32, jnp.int32, jnp.float32, jnp.float32,
                 jnp.float32)
_TOP_K_FIELD, _TOP_P_FIELD = 1, 2  # rows of a _param_table
_ONE_BITS = 0x3F800000  # fp32 1.0 as int32: a param table's top-p off


def _param_table(params: SamplingParams | jax.Array) -> jax.Array:
  """The kernels' per-row parameters as one ``rowwise.pack_rows`` table:
  ``SamplingParams``' fields, then ``log(min_p)`` (-inf where min-p is off).
  Every kernel takes the same table, so XLA makes it once (one op where
  one input per field cost a launch each).  A table (``RowBounds.
  pass_table``, written by a kernel) passes through."""
  if not isinstance(params, SamplingParams):
    return params
  log_min_p = jnp.where(params.min_p > 0, jnp.log(params.min_p), -jnp.inf)
  return rowwise.pack_rows([params.temperature, params.top_k, params.top_p,
                            params.min_p, log_min_p], params.batch_size)


def _row_params(param_ref, row) -> tuple[SamplingParams, jax.Array]:
  """Row ``row``'s ``SamplingParams`` (scalars) and ``log(min_p)``, read in
  a kernel from a ``_param_table``."""
  *fields, log_min_p = common.table_row(param_ref, row, _PARAM_DTYPES)
  return SamplingParams(*fields), log_min_p


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowStats:
  """The stats pass's results on the rows it read: per-split ``top`` (max
  of ``x``), ``sumexp`` and ``finite`` count ``[B, S]``, raw segment maxima
  ``segment_max`` ``[B, N]`` and ``sample`` ``[B, M]`` (``RowBounds``)."""

  top: jax.Array
  sumexp: jax.Array
  finite: jax.Array
  segment_max: jax.Array
  sample: jax.Array


def _stats_pass(logits, params: SamplingParams, plan, segment,
                capacity: int) -> RowStats:
  """The stats pass (``RowStats``) over the rows sampled with a filter on;
  it writes the sample of those ``_row_flags`` marks ``sampled``."""
  batch, vocab = logits.shape
  shape = (batch, plan.num_splits)
  padded = plan.num_splits * plan.split_len
  kernel = functools.partial(_stats_kernel, plan=plan, vocab=vocab,
                             segment=segment, capacity=capacity)
  return RowStats(*pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.int32),
                 jax.ShapeDtypeStruct((batch, padded // segment), jnp.float32),
                 jax.ShapeDtypeStruct((batch, padded // _SAMPLE_STRIDE),
                                      jnp.float32)],
      grid=shape, compiler_params=plan.compiler_params(),
      interpret=plan.interpret, name="jaxsample_row_stats")(
          _param_table(params), logits))


def _bound_kernel(param_ref, top_ref, sumexp_ref, finite_ref, segment_ref,
                  sample_ref, row_max_out, safe_max_out, mass_out, finite_out,
                  t1_out, bound_out, listed_out, listed_count_out, narrow_out,
                  gather_out, large_out, *pass_outs, splits: int,
                  segments: int, capacity: int, top_width: int,
                  interpret: bool):
  """One row's stats combined across splits, its bound and its route
  (``row_bounds``; ``top_width``: outputs ``pass_bound`` and the narrow
  pass's param table too)."""
  row = pl.program_id(0)
  math = common.KernelMath(interpret)
  active, sampled = _row_flags(row, param_ref, capacity)
  params, log_min_p = _row_params(param_ref, row)
  t = jnp.where(active, params.temperature, 1.0)
  split = jnp.arange(_pow2_ceil(splits), dtype=jnp.int32)
  use = active & (split < splits)
  top = plgpu.load(top_ref.at[row, split], mask=use, other=-jnp.inf)
  sumexp = plgpu.load(sumexp_ref.at[row, split], mask=use, other=0.0)
  x_max = jnp.max(top)
  row_max = jnp.max(math.temper(top, t))  # = temper(x_max): t > 0 is monotone
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  ref = jnp.where(jnp.isfinite(x_max), x_max, 0.0)
  mass = jnp.sum(jnp.where(top > -jnp.inf,
                           sumexp * jnp.exp((top - ref) * (1.0 / t)), 0.0))
  t1 = safe_max + log_min_p
  row_max_out[row] = row_max
  safe_max_out[row] = safe_max
  mass_out[row] = mass
  finite_out[row] = jnp.sum(plgpu.load(finite_ref.at[row, split], mask=use,
                                       other=0))
  t1_out[row] = t1
  if top_width:
    pass_bound_out, pass_table_out = pass_outs
    for field in range(param_ref.shape[0]):
      pass_table_out[field, row] = param_ref[field, row]

  @pl.when(~active)
  def _():  # rows the truncation kernels skip: no search, no route
    bound_out[row] = t1
    listed_count_out[row] = 0
    narrow_out[row] = 0
    gather_out[row] = 0
    large_out[row] = 0
    if top_width:
      pass_bound_out[row] = t1

  @pl.when(active)
  def _():
    k = params.top_k
    lanes = jnp.arange(_pow2_ceil(segments), dtype=jnp.int32)
    y = math.temper(plgpu.load(segment_ref.at[row, lanes],
                               mask=lanes < segments, other=-jnp.inf), t)
    bound, _ = _bound(y, safe_max, t1, k, params.top_p,
                      mass * (1 + _BOUND_MARGIN), 0.0, _BOUND_KEY_BITS)
    valid = jnp.isfinite(row_max)
    # The sample's estimate is too noisy to trust a top-k row (k > C / 2)
    # with the buffer.
    large = valid & sampled & ((k > 0) | (_estimate_reaching(
        bound, row, sample_ref.shape[1], interpret, t, sampled,
        sample_ref) > capacity // 2))
    bound_out[row] = bound
    large_out[row] = jnp.where(large, 1, 0)
    pass_bound, pass_k = bound, k
    if top_width:  # large rows: the bound of their top_width largest
      pass_bound = lax.cond(large, lambda: _bound(
          y, safe_max, t1, jnp.int32(top_width), 1.0, mass, 0.0,
          _BOUND_KEY_BITS)[0], lambda: bound)
      pass_k = jnp.where(large, top_width, k)
      pass_bound_out[row] = pass_bound
      pass_table_out[_TOP_K_FIELD, row] = pass_k
      pass_table_out[_TOP_P_FIELD, row] = jnp.where(
          large, _ONE_BITS, param_ref[_TOP_P_FIELD, row])
    narrow = valid if top_width else valid & ~large
    listed = _list_reaching(y, pass_bound, row, listed_out.shape[1],
                            listed_out)
    listed_count_out[row] = listed
    narrow_out[row] = jnp.where(narrow, 1, 0)
    # Rows whose outside mass is 0 (top-k on: unused; bound == t1: no
    # survivor lies below it) or the row's mass less the candidates' (no
    # min-p).
    gather_out[row] = jnp.where(
        narrow & (listed <= _LIST_CAP) & (
            (pass_k > 0) | (pass_bound == t1) | (t1 == -jnp.inf)), 1, 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowBounds:
  """Per-row results of the stats pass and the bound select (``[B]`` each
  unless noted) on the active rows: sampled, with a filter on.

  ``row_max = max(y)`` (valid iff finite; ``safe_max``: 0 where not),
  ``mass = sum exp(y - row_max)``, ``lse = logsumexp(y)``, ``finite`` the
  number of finite entries, ``t1`` the min-p threshold (``safe_max +
  log(min_p)``), ``bound`` the lower bound ``L`` of the kept set's threshold
  (``>= t1``); ``pass_bound`` and ``pass_table`` the narrow pass's bound
  and ``_param_table``: ``L`` and the params, but on ``large`` rows with
  ``row_bounds``' ``top_width`` the bound of their ``top_width`` largest
  survivors (``y >= t1``) and top-k = ``top_width``, top-p off;
  ``listed`` ``[B, _LIST_CAP]`` the segments (``_segment_size`` contiguous ids each) whose maximum reaches
  ``pass_bound`` (ascending; their number ``listed_count`` may exceed
  ``_LIST_CAP``); ``sample`` ``[B, M]``: every ``_SAMPLE_STRIDE``-th
  sanitized logit ``x`` of the rows that may be large (-inf padded past V;
  undefined on other rows).  The route, int32 flags: valid rows are
  ``large`` (``k > C / 2``, or top-k off and the sample estimates more than
  ``C / 2`` elements reaching ``L``) or not; ``narrow`` rows' candidates
  (``{y >= pass_bound}``) go to the buffer: the rows not ``large``, and
  with ``top_width`` every valid row; ``gather`` narrow rows read only
  their listed segments (``Segments``).  ``stats``: the stats pass's
  ``RowStats``.
  """

  row_max: jax.Array
  safe_max: jax.Array
  mass: jax.Array
  lse: jax.Array
  finite: jax.Array
  t1: jax.Array
  bound: jax.Array
  pass_bound: jax.Array
  pass_table: jax.Array
  listed: jax.Array
  listed_count: jax.Array
  narrow: jax.Array
  gather: jax.Array
  large: jax.Array
  stats: RowStats

  @property
  def sample(self) -> jax.Array:
    return self.stats.sample


def row_bounds(logits, params: SamplingParams, config: SamplerConfig, *,
               top_width: int = 0) -> RowBounds:
  """Runs the stats pass and the bound select on the rows of canonical
  ``params`` that are sampled with a filter on; rows without top-k or with
  ``k > C / 2`` may be routed ``large`` (they write their sample).
  ``top_width`` (``<= C / 2``): the narrow pass also lists the
  ``top_width`` largest survivors of ``large`` rows (``RowBounds``).

  The bound select combines each row's per-split stats, searches its
  segment maxima (``_bound``; on ``large`` rows with ``top_width``, a
  second search by count) and routes it: one program per row,
  ``_BOUND_WARPS`` warps.
  """
  batch, vocab = logits.shape
  plan = _pass_plan(batch, vocab, logits.dtype, config)
  segment = _segment_size(vocab, plan.chunk)
  stats = _stats_pass(logits, params, plan, segment, config.max_candidates)
  kernel = functools.partial(_bound_kernel, splits=plan.num_splits,
                             segments=stats.segment_max.shape[1],
                             capacity=config.max_candidates,
                             top_width=top_width, interpret=plan.interpret)
  f32, i32 = (jax.ShapeDtypeStruct((batch,), d) for d in (jnp.float32,
                                                          jnp.int32))
  table = _param_table(params)
  (row_max, safe_max, mass, finite, t1, bound, listed, listed_count, narrow,
   gather, large, *narrow_pass) = pl.pallas_call(
       kernel,
       out_shape=[f32, f32, f32, i32, f32, f32,
                  jax.ShapeDtypeStruct((batch, _LIST_CAP), jnp.int32), i32,
                  i32, i32, i32] + [f32, jax.ShapeDtypeStruct(
                      table.shape, table.dtype)] * bool(top_width),
       grid=(batch,),
       compiler_params=plgpu.CompilerParams(num_warps=_BOUND_WARPS,
                                            num_stages=1),
       interpret=plan.interpret, name="jaxsample_row_bounds")(
           table, stats.top, stats.sumexp, stats.finite, stats.segment_max,
           stats.sample)
  return RowBounds(row_max, safe_max, mass, row_max + jnp.log(mass), finite,
                   t1, bound, *(narrow_pass or (bound, table)), listed,
                   listed_count, narrow, gather, large, stats)


def _pow2_ceil(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


# ---------------------------------------------------------------------------
# The exact threshold search over a small buffer of values.
# ---------------------------------------------------------------------------


# Key bits the bound search resolves.  Bounds only need to be conservative,
# so the search stops early: 20 bits (sign, exponent and 11 mantissa bits)
# round each bound down by less than 2^-11 of its magnitude.
_BOUND_KEY_BITS = 20
_NEG_INF_KEY = 0x007FFFFF  # order_key(-inf); smaller keys are NaN patterns


def _largest_keys(reaches: tuple, bits: int, start=None) -> tuple:
  """Per predicate of ``reaches``, the largest uint32 ``v`` with its low ``32
  - bits`` bits zero and ``reaches(v)`` (monotone: true below some point),
  built bit by bit in ``bits`` steps; 0 if none.  The searches share one
  loop, so the block reductions of their steps overlap.

  ``start = (prefix, known)`` (``_key_prefix``): the search looks only among
  the keys whose ``known`` high bits are ``prefix``'s (``bits - known``
  steps and a check): the largest there, or 0 if none there reaches."""

  def body(i, keys):
    bit = jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32))
    return tuple(jnp.where(reach(v | bit), v | bit, v)
                 for reach, v in zip(reaches, keys))

  if start is None:
    return lax.fori_loop(0, bits, body, (jnp.uint32(0),) * len(reaches))
  prefix, known = start
  keys = lax.fori_loop(known, bits, body, (prefix,) * len(reaches))
  return tuple(jnp.where(reach(v), v, jnp.uint32(0))
               for reach, v in zip(reaches, keys))


def _largest_key(reaches, bits: int, start=None) -> jax.Array:
  """``_largest_keys`` of one predicate."""
  return _largest_keys((reaches,), bits, start)[0]


def _key_prefix(lower, upper):
  """``(prefix, known)``: the ``known`` high bits that the order keys of
  every value in ``[lower, upper]`` share, and those bits (the rest 0)."""
  low, high = common.order_key(lower), common.order_key(upper)
  known = 32 - _bit_length(low ^ high)
  mask = jnp.where(known > 0, jnp.uint32(0xFFFFFFFF) << jnp.minimum(
      32 - known, 31).astype(jnp.uint32), jnp.uint32(0))
  return low & mask, known


def _count_reaches(key, survives, n):
  """``reaches(v) = #{survivors with key >= v} >= n`` for ``_largest_key``:
  the search then finds the key of the ``n``-th largest survivor."""
  return lambda v: jnp.sum(jnp.where(survives & (key >= v), 1, 0)) >= n


def _bound_thresholds(y, survives, e, k, p, mass, above, bits: int,
                      window=None):
  """Bound mode's ``(t2, k_found, t3)``, rounded down to ``bits`` key bits.

  One search per row: with top-k on, ``t2`` (the ``k``-th largest survivor)
  and ``t3 = -inf`` (every top-k survivor stays a candidate); otherwise ``t2 =
  -inf`` and ``t3`` (the largest value whose upper mass, plus ``above``,
  reaches ``p * mass``).  ``bits`` block reductions, plus one for
  ``k_found``; with 32 bits the thresholds are exact (element values).
  ``window = (lower, upper)``: the search looks only among the keys that
  share the high bits of ``[lower, upper]``'s (``_key_prefix``), and gives
  -inf where none there reaches: exact when the threshold lies in the
  window, below ``lower`` or at least ``upper`` otherwise.
  """
  key = common.order_key(y)
  target = p * mass - above
  mass_reaches = lambda v: jnp.sum(jnp.where(survives & (key >= v), e,
                                             0.0)) >= target
  start = None if window is None else _key_prefix(*window)
  found = lax.cond(
      k > 0,
      lambda: _largest_key(_count_reaches(key, survives, k), bits, start),
      lambda: _largest_key(mass_reaches, bits, start))
  bound = jnp.where(found > _NEG_INF_KEY, common.key_value(found), -jnp.inf)
  k_found = jnp.sum(jnp.where(survives, 1, 0)) >= k
  return (jnp.where(k > 0, bound, -jnp.inf), k_found,
          jnp.where(k > 0, -jnp.inf, bound))


def _bound(y, row_max, t1, k, p, mass, above, bits: int, window=None):
  """Bound mode's ``(max(t1, t2, t3), k_found)`` over the values ``y``
  (``_bound_thresholds``; ``t3`` only where ``p < 1``)."""
  finite = y > -jnp.inf
  e = jnp.where(finite, jnp.exp(y - row_max), 0.0)
  t2, k_found, t3 = _bound_thresholds(y, finite & (y >= t1), e, k, p, mass,
                                      above, bits, window)
  return jnp.maximum(jnp.maximum(t1, t2), jnp.where(p < 1, t3, -jnp.inf)), (
      k_found)


# Values ``y_j`` (scalars) compared per loop step of the ranking (the next
# step's are loaded while this one is compared).
_RANK_STEP = 16


def _rank(y_ref, row, scan, y, t1, row_max, with_ties: bool, step: int):
  """Per entry ``i`` of ``y`` (a prefix of row ``row`` of ``y_ref``), over the
  min-p survivors ``j`` among the first ``scan`` slots: ``(above_i = #{y_j >
  y_i}, mass_i = sum_{y_j >= y_i} exp(y_j - row_max), ties_i = #{y_j = y_i, j
  < i})`` (``ties`` only ``with_ties``); ``scan x len(y)`` comparisons, in
  loop steps of ``step`` scalars (the sums run in slot order whatever the
  step)."""
  size = y.shape[0]
  step = min(step, size)
  lanes = jnp.arange(size, dtype=jnp.int32)

  def load(j):
    return tuple(y_ref[row, j * step + t] for t in range(step))

  def body(j, carry):
    (above, mass, ties), loaded = carry
    upcoming = load(jnp.minimum(j + 1, size // step - 1))
    for t, yj in enumerate(loaded):
      alive = (yj > -jnp.inf) & (yj >= t1)
      ej = jnp.where(alive, jnp.exp(yj - row_max), 0.0)
      above = above + jnp.where(alive & (yj > y), 1, 0)
      mass = mass + jnp.where(alive & (yj >= y), ej, 0.0)
      if with_ties:
        ties = ties + jnp.where(alive & (yj == y) & (j * step + t < lanes), 1,
                                0)
    return (above, mass, ties), upcoming

  zeros = jnp.zeros((size,), jnp.int32)
  (above, mass, ties), _ = lax.fori_loop(
      0, (scan + step - 1) // step, body,
      ((zeros, jnp.zeros((size,), jnp.float32), zeros), load(0)))
  return above, mass, ties


def _rank_plan(n: int, interpret: bool) -> tuple[list[int], int]:
  """The final select's variants (block sizes 64, 128, ... up to ``n``) and
  ranking step (``_RANK_STEP``).  Interpret mode (CPU) compiles the block of
  ``n`` alone, one scalar per step: a longer prefix of -inf padding and a
  shorter step give the same results, and every variant and unrolled step
  would otherwise be compiled (the GPU tests run the variants)."""
  if interpret:
    return [n], 1
  return [min(n, 64 << i) for i in range(max(n // 64, 1).bit_length())], (
      _RANK_STEP)


def _select_kernel(y_ref, row_max_ref, t1_ref, param_ref, mass_ref, *refs,
                   bound: bool, has_above: bool, has_active: bool,
                   has_window: bool, width: int, bits: int, interpret: bool):
  """One row's thresholds (``select_threshold``).

  Bound mode (all ``N`` entries filled; input ``above`` if ``has_above``,
  then ``lower`` and ``upper`` if ``has_window``): ``_bound``.
  Final mode (inputs ``scan``, ``ids``, ``race``; a candidate buffer with
  ``scan`` filled slots, none if ``scan > N``): on the smallest prefix of
  ``_rank_plan``'s sizes holding them, ``_rank``, then ``t2 = min{y_i :
  above_i < k}`` (the ``k``-th largest survivor) and ``t3 = max{y_i >= t2 :
  mass_i >= p * total}`` (the sorted cumulative sum first reaches ``p *
  total`` inside ``y_i``'s group of equal values); ``above_i + ties_i`` is
  ``i``'s position in the stable descending order; the token is the kept
  entry with the largest race value (the first slot on ties).
  ``has_active`` (first input): rows flagged 0 are skipped.
  """
  active_refs, refs = refs[:has_active], refs[has_active:]
  inputs = int(has_above) + 2 * has_window if bound else 3
  (threshold_ref, count_ref, kept_mass_ref, certified_ref,
   *extra_refs) = refs[inputs:]
  row = pl.program_id(0)
  row_max = row_max_ref[row]
  t1 = t1_ref[row]
  params, _ = _row_params(param_ref, row)
  k, p = params.top_k, params.top_p
  sizes, step = _rank_plan(y_ref.shape[1], interpret)
  if not bound:
    scan_ref, ids_ref, race_ref = refs[:3]
    scan = scan_ref[row]
    scan = jnp.where(scan <= y_ref.shape[1], scan, 0)

  def select(size):
    y = y_ref[row, pl.ds(0, size)]
    finite = y > -jnp.inf
    e = jnp.where(finite, jnp.exp(y - row_max), 0.0)
    survives = finite & (y >= t1)
    if bound:
      window = (refs[has_above][row], refs[has_above + 1][row]) if (
          has_window) else None
      threshold, k_found = _bound(y, row_max, t1, k, p, mass_ref[row],
                                  refs[0][row] if has_above else 0.0, bits,
                                  window)
    else:
      above, mass, ties = _rank(y_ref, row, scan, y, t1, row_max,
                                with_ties=bool(width), step=step)
      k_found = jnp.sum(jnp.where(survives, 1, 0)) >= k
      t2 = jnp.min(jnp.where(survives & (above < k), y, jnp.inf))
      t2 = jnp.where((k > 0) & k_found, t2, -jnp.inf)
      survives = survives & (y >= t2)
      # Survivors of top-k all lie in the buffer.
      total = jnp.sum(jnp.where(survives, e, 0.0)) + jnp.where(
          t2 > -jnp.inf, 0.0, mass_ref[row])
      t3 = jnp.max(jnp.where(survives & (mass >= p * total), y, -jnp.inf))
      threshold = jnp.maximum(jnp.maximum(t1, t2),
                              jnp.where(p < 1, t3, -jnp.inf))
    kept = finite & (y >= threshold)
    count = jnp.sum(jnp.where(kept, 1, 0))
    threshold_ref[row] = threshold
    count_ref[row] = count
    kept_mass_ref[row] = jnp.sum(jnp.where(kept, e, 0.0))
    certified_ref[row] = jnp.where((k <= 0) | k_found, 1, 0)
    if not bound:
      token_ref, token_y_ref, *order_ref = extra_refs
      race = jnp.where(kept, race_ref[row, pl.ds(0, size)], -jnp.inf)
      lanes = jnp.arange(size, dtype=jnp.int32)
      first = lanes == jnp.min(jnp.where(race == jnp.max(race), lanes, size))
      token_ref[row] = jnp.sum(jnp.where(first, ids_ref[row, pl.ds(0, size)],
                                         0))
      token_y_ref[row] = jnp.sum(jnp.where(first, y, 0.0))
    if width:  # K fills positions 0 .. count - 1; the rest are -1.
      (order,) = order_ref
      position = above + ties
      plgpu.store(order.at[row, position], ids_ref[row, pl.ds(0, size)],
                  mask=kept & (position < width))
      slots = jnp.arange(_pow2_ceil(width), dtype=jnp.int32)
      plgpu.store(order.at[row, slots], jnp.full(slots.shape, -1, jnp.int32),
                  mask=(slots >= count) & (slots < width))

  run = active_refs[0][row] != 0 if has_active else None
  if bound:
    if run is None:
      select(y_ref.shape[1])
    else:
      pl.when(run)(functools.partial(select, y_ref.shape[1]))
    return
  smaller = -1
  for size in sizes:
    chosen = (scan > smaller) & (scan <= size)
    pl.when(chosen if run is None else chosen & run)(
        functools.partial(select, size))
    smaller = size


def _estimate_reaching(threshold, row, width: int, interpret: bool, t,
                       sampled, sample_ref):
  """``_SAMPLE_STRIDE`` times the number of the row's sample values, tempered
  by ``t``, reaching ``threshold`` (0 on rows not ``sampled``)."""
  lanes = jnp.arange(_pow2_ceil(width), dtype=jnp.int32)
  use = (lanes < width) & sampled
  x = plgpu.load(sample_ref.at[row, jnp.where(use, lanes, 0)], mask=use,
                 other=-jnp.inf)
  y = common.KernelMath(interpret).temper(_sanitize(x), t)
  return _SAMPLE_STRIDE * jnp.sum(jnp.where(use & (y >= threshold), 1, 0))


def _list_reaching(y, threshold, row, cap: int, listed_ref):
  """Writes the indices ``i`` (ascending, the first ``cap``) with ``y_i >=
  threshold`` less twice the candidate filter's slack, and returns their
  number: the segments that may hold candidates of the compact pass's
  filter."""
  reach = jnp.where(threshold > -jnp.inf,
                    threshold - 2 * _FILTER_SLACK * jnp.abs(threshold),
                    -jnp.inf)
  flag = jnp.where(y >= reach, 1, 0)
  position = jnp.cumsum(flag) - flag
  plgpu.store(listed_ref.at[row, position],
              jnp.arange(y.shape[0], dtype=jnp.int32),
              mask=(flag != 0) & (position < cap))
  return jnp.sum(flag)


def select_threshold(y, row_max, t1, params: SamplingParams | jax.Array,
                     mass, *,
                     bound: bool, interpret: bool, ids=None, race=None,
                     scan=None, order_width: int = 0, above=None,
                     bits: int = _BOUND_KEY_BITS,
                     num_warps: int | None = None, active=None,
                     window=None):
  """Thresholds of ``y`` ``[B, N]`` (N a power of 2, -inf padded), no sort,
  under ``params`` (or their ``_param_table``).

  Bound mode searches order keys bit by bit (``_bound_thresholds``: one
  search of ``bits`` block reductions, counting ``above`` ``[B]`` (default
  0) as mass above every entry; with 32 bits an exact search of a row's
  top-p threshold inside a window of its values); final mode ranks the
  entries against the min-p survivors among the first ``scan`` slots
  (``[B]``, required; every finite entry must lie there; ``scan > N``, an
  overflowed buffer, ranks none): ``scan x pow2ceil(scan)`` comparisons,
  below a search's latency up to a few hundred filled slots.

  Final mode: the reference's ``max(t1, t2, t3)`` for a row whose min-p
  survivors outside ``y`` have mass ``mass`` (relative to ``row_max``), exact
  whenever the kept set lies inside ``y``.  Bound mode: a lower bound of the
  row's threshold when ``y`` is a subset of the row and ``mass`` is at least
  the mass of the row's min-p survivors (``t2``/``t3`` are -inf where ``y``
  cannot certify them; ``t3`` is not searched when top-k is on), and no
  higher than the row's ``t2`` when top-k is on.
  Returns ``(threshold, kept count, kept mass, certified)``: ``certified`` is
  False where top-k is on and ``y`` holds fewer than ``k`` survivors.  Final
  mode (``ids`` and ``race`` ``[B, N]`` required): also the token, the id of
  the kept entry with the largest ``race`` (first slot on ties), and its
  ``y``; with ``order_width``, also ``ids``' kept entries by descending
  ``y`` (smallest slot first on ties), ``[B, order_width]``, -1 padded.
  ``active`` ``[B]``: the rows to select (default all); the outputs of
  the others are undefined.  ``window = (lower, upper)`` ``[B]`` (bound
  mode): the search looks only where the thresholds' keys share the high
  bits of ``[lower, upper]``'s (``_bound_thresholds``).
  """
  batch = y.shape[0]
  if window is not None and not bound:
    raise ValueError("a window bounds a bound-mode search")
  kernel = functools.partial(_select_kernel, bound=bound,
                             has_above=above is not None,
                             has_active=active is not None,
                             has_window=window is not None, width=order_width,
                             bits=bits, interpret=interpret)
  out_shape = [jax.ShapeDtypeStruct((batch,), jnp.float32),
               jax.ShapeDtypeStruct((batch,), jnp.int32),
               jax.ShapeDtypeStruct((batch,), jnp.float32),
               jax.ShapeDtypeStruct((batch,), jnp.int32)]
  if not bound:
    out_shape += [jax.ShapeDtypeStruct((batch,), jnp.int32),
                  jax.ShapeDtypeStruct((batch,), jnp.float32)]
  if order_width:
    out_shape.append(jax.ShapeDtypeStruct((batch, order_width), jnp.int32))
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(batch,),
      compiler_params=plgpu.CompilerParams(
          num_warps=num_warps or _SELECT_WARPS, num_stages=1),
      interpret=interpret, name="jaxsample_select_threshold")(
          y, row_max, t1, _param_table(params), mass,
          *([] if active is None else [active.astype(jnp.int32)]),
          *(([] if above is None else [above]) + list(window or ()) if bound
            else [scan.astype(jnp.int32), ids, race]))


# ---------------------------------------------------------------------------
# Large kept sets: a window around the threshold, from a sample.
# ---------------------------------------------------------------------------

# Every ``_SAMPLE_STRIDE``-th element of a row is its sample.  The window
# spans ``2 * half`` sample ranks around the estimate, with ``half`` sized so
# the window's expected count is about 0.7 of its buffer.
_SAMPLE_STRIDE = 32
# The window's buffer, in candidate buffers.  A top-p estimate from the
# sample's mass is tight; the top-k estimate ``k / _SAMPLE_STRIDE`` misses
# the ``k``-th largest by about ``sqrt(_SAMPLE_STRIDE * V / 4)`` elements (one
# standard deviation, at k = V / 2), so its window is twice as wide: with
# V = 151936, 5 standard deviations (a simulation of 2000 random-normal rows
# missed 0.8% of them at 8 buffers).
_WINDOW_BUFFERS = 8
_TOP_K_WINDOW_BUFFERS = 16
_WINDOW_WARPS = 16  # the window and its exact search: long serial searches


def _window_half(capacity: int) -> int:
  return max(1, capacity * 11 // (16 * 2 * _SAMPLE_STRIDE))


def _window_kernel(param_ref, sample_ref, row_max_ref, t1_ref, mass_ref,
                   active_ref, lower_ref, upper_ref, *list_lower_ref,
                   half: int, by_count: bool, list_rank: int, list_half: int,
                   interpret: bool):
  """One ``active`` row's window ``[lower, upper)``: sample ranks ``r +-
  half`` around the estimated threshold (rank ``r``; ``by_count``: the
  ``k``-th largest survivor, else the top-p threshold), clamped to ``>=
  t1``.  With ``list_half``, also a listing's lower end: sample rank
  ``list_rank + list_half``, found in the same search (each active row
  computes both)."""
  row = pl.program_id(0)

  @pl.when(active_ref[row] != 0)
  def _():
    width = sample_ref.shape[1]
    lanes = jnp.arange(_pow2_ceil(width), dtype=jnp.int32)
    x = plgpu.load(sample_ref.at[row, jnp.where(lanes < width, lanes, 0)],
                   mask=lanes < width, other=-jnp.inf)
    params, _ = _row_params(param_ref, row)
    y = common.KernelMath(interpret).temper(_sanitize(x), params.temperature)
    t1 = t1_ref[row]
    finite = y > -jnp.inf
    survives = finite & (y >= t1)
    key = common.order_key(y)
    if by_count:
      rank = params.top_k // _SAMPLE_STRIDE
    else:
      p = params.top_p
      e = jnp.where(finite, jnp.exp(y - row_max_ref[row]),
                    0.0) * _SAMPLE_STRIDE
      # The mass below the threshold is (1 - p) of the survivors' mass, made
      # of many small terms: the sample estimates it well.
      below_t1 = jnp.sum(jnp.where(finite & ~survives, e, 0.0))
      target = (1 - p) * mass_ref[row] + p * below_t1
      threshold_key = _largest_key(
          lambda v: jnp.sum(jnp.where(key < v, e, 0.0)) <= target,
          _BOUND_KEY_BITS)
      rank = jnp.sum(jnp.where(survives & (key >= threshold_key), 1, 0))

    # The (rank - half)-th and (rank + half)-th largest survivors (rounded
    # down; -inf if none), and the listing's, searched together.
    ranks = (rank - half, rank + half) + (
        (list_rank + list_half,) if list_half else ())
    found = _largest_keys(tuple(_count_reaches(key, survives, n)
                                for n in ranks), _BOUND_KEY_BITS)
    ranked = [jnp.where(f > _NEG_INF_KEY, common.key_value(f), -jnp.inf)
              for f in found]
    # The upper end rounds up (the search's next key): rounded down, it
    # could leave its rank's tie group above the window, and a threshold
    # there to the pivot search (bf16 rows: groups of ~1000 equal values).
    upper = jnp.where(
        rank <= half, jnp.inf,
        jnp.where(found[0] > _NEG_INF_KEY, common.key_value(
            found[0] + jnp.uint32(1 << (32 - _BOUND_KEY_BITS))), -jnp.inf))
    lower_ref[row] = jnp.maximum(ranked[1], t1)
    # With fewer survivors in the sample than ``rank - half``, every finite
    # survivor is above the window (counted, not written).
    upper_ref[row] = jnp.maximum(jnp.maximum(upper, t1),
                                 jnp.finfo(jnp.float32).min)
    if list_half:
      list_lower_ref[0][row] = jnp.maximum(ranked[2], t1)


def threshold_window(sample, row_max, t1, params: SamplingParams, mass,
                     capacity: int, active, *, by_count: bool,
                     interpret: bool, list_rows=None, list_width: int = 0,
                     list_capacity: int = 0):
  """``(lower, upper)`` ``[B]`` of the ``active`` rows (others undefined):
  a window that likely holds the threshold
  (``by_count``: the ``k``-th largest min-p survivor; else top-p's, on the
  min-p survivors ``y >= t1``) and fewer than ``capacity`` elements (the
  caller checks both), from the rows' ``sample`` (``RowBounds.sample``,
  tempered here by ``params.temperature`` as the kernels temper logits).
  ``mass``: the row's mass relative to ``row_max``.  Two or three searches of
  ``_BOUND_KEY_BITS`` block reductions over the sample.

  With ``list_rows``, also ``list_lower`` ``[B]`` of those rows (a
  ``Listing``'s lower end, ``_listing_capacity(list_width)`` slots): the
  lower end of the by-count window of ``k = list_width`` (whose upper end
  is ``inf``: ``_listing_width``), found in the last search at no extra
  pass; ``t1`` must be the rows' min-p threshold."""
  batch = sample.shape[0]
  listing = list_rows is not None
  rows = active | list_rows if listing else active
  kernel = functools.partial(
      _window_kernel, half=_window_half(capacity), by_count=by_count,
      list_rank=list_width // _SAMPLE_STRIDE,
      list_half=_window_half(list_capacity) if listing else 0,
      interpret=interpret)
  shape = jax.ShapeDtypeStruct((batch,), jnp.float32)
  return pl.pallas_call(
      kernel, out_shape=[shape] * (2 + listing), grid=(batch,),
      compiler_params=plgpu.CompilerParams(num_warps=_WINDOW_WARPS,
                                           num_stages=1),
      interpret=interpret, name="jaxsample_threshold_window")(
          _param_table(params), sample, row_max, t1, mass,
          rows.astype(jnp.int32))


# ---------------------------------------------------------------------------
# Pass 2: candidates.
# ---------------------------------------------------------------------------


# ``_compact_kernel`` counts a chunk's listed elements in the high half of the
# word whose low half counts its candidates, so one prefix sum places both.
_LISTED = 1 << 16


def _compact_kernel(param_ref, active_ref, bound_ref, t1_ref, row_max_ref,
                    *refs, plan: common.KernelPlan, vocab: int, capacity: int,
                    list_capacity: int, segment: int, windowed: bool,
                    gathering: bool):
  """Writes the split's elements with ``x * (1 / T) >= L - slack`` (a superset
  of ``{y >= L}``: ``collect_candidates`` drops the rest) in vocab order and
  sums the mass of the other min-p survivors.  ``windowed`` (input ``U``,
  outputs ``above_out``): only the elements below ``U + slack`` are written;
  the count and mass of those above it (all ``y >= U``) go to ``above_out``.

  ``active`` holds flags: 1, the row's candidates; 2 (``list_capacity``:
  input ``L2``, output ``list_count_out``), its listing, every element with
  ``x * (1 / T) >= L2 - slack``, written in vocab order after the
  candidates' ``capacity`` slots, from the same loads, prefix sum and
  stores (two store streams cost an H100 as much as two passes).

  ``gathering`` (inputs ``gather``, ``listed`` and ``count`` of
  ``Segments``): ``gather`` rows read only their listed segments, the
  split's share of them in order, and report no outside mass.
  """
  row, split = pl.program_id(0), pl.program_id(1)
  flags = active_ref[row]
  active, candidates = flags != 0, (flags & 1) != 0
  listing = list_capacity > 0
  upper_refs, refs = refs[:windowed], refs[windowed:]
  list_refs, refs = refs[:listing], refs[listing:]
  gather_refs, (x_ref, x_out, id_out, count_out, outside_out, *outs) = (
      refs[:3 * gathering], refs[3 * gathering:])
  above_out, list_count_out = outs[:2 * windowed], outs[2 * windowed:]
  gather = gather_refs[0][row] != 0 if gathering else None
  math = common.KernelMath(plan.interpret)
  inv_t = 1.0 / _row_params(param_ref, row)[0].temperature
  slack = lambda v: _FILTER_SLACK * jnp.abs(v)
  bound = bound_ref[row]
  t1 = t1_ref[row]
  row_max = row_max_ref[row]
  filter_bound = bound - slack(bound)
  upper = upper_refs[0][row] if windowed else jnp.inf
  filter_upper = upper + slack(upper)
  if listing:
    list_bound = list_refs[0][row]
    filter_list = jnp.where((flags & 2) != 0, list_bound - slack(list_bound),
                            jnp.inf)

  def store(position, keep, index, x):
    plgpu.store(x_out.at[row, split, position], x, mask=keep)
    plgpu.store(id_out.at[row, split, position], index, mask=keep)

  def compact(carry, index, x):
    count, list_count, outside, *above = carry
    x = _sanitize(x)
    approx = x * inv_t
    finite = x > -jnp.inf
    flag = (approx >= filter_bound) & finite
    # The difference first: y * log2(e) - row_max * log2(e) contracts to an
    # FMA, whose error overflows exp2 for |y| ~ 1e37.
    e = math.exp2_approx((approx - row_max) * _LOG2E)
    if above_out:
      surely_above = approx >= filter_upper
      flag = flag & ~surely_above
      above = [above[0] + jnp.where(surely_above, 1, 0),
               above[1] + jnp.where(surely_above, e, 0.0)]
      below = ~flag & ~surely_above
    else:
      below = ~flag
    outside = outside + jnp.where(below & (approx >= t1), e, 0.0)
    if listing:
      flag = flag & candidates
      listed = (approx >= filter_list) & finite
      words = jnp.where(flag, 1, 0) + jnp.where(listed, _LISTED, 0)
    else:
      words = jnp.where(flag, 1, 0)
    found = jnp.sum(words)

    def write():
      before = jnp.cumsum(words) - words
      if not listing:
        position = count + before
        store(position, flag & (position < capacity), index, x)
        return
      # One store of [2, chunk]: the candidates' slots, then the listing's.
      first = lax.broadcasted_iota(jnp.int32, (2, plan.chunk), 0) == 0
      position = jnp.where(first, count + (before & (_LISTED - 1)),
                           list_count + (before >> 16))
      keep = jnp.where(first, flag & (position < capacity),
                       listed & (position < list_capacity))
      wide = lambda v: jnp.broadcast_to(v, (2, plan.chunk))
      store(jnp.where(first, position, capacity + position), keep,
            wide(index), wide(x))

    pl.when(found > 0)(write)
    if listing:
      return (count + (found & (_LISTED - 1)), list_count + (found >> 16),
              outside, *above)
    return count + found, list_count, outside, *above

  lanes = lambda dtype: jnp.zeros((plan.chunk,), dtype)
  init = (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
          lanes(jnp.float32))
  if above_out:
    init += (lanes(jnp.int32), lanes(jnp.float32))

  def finish(count, list_count, outside, above):
    count_out[row, split] = count
    outside_out[row, split] = jnp.sum(outside)
    for out, value in zip(above_out, above):
      out[row, split] = jnp.sum(value)
    if listing:
      list_count_out[0][row, split] = list_count

  @pl.when(active & ~gather if gathering else active)
  def _():
    count, list_count, outside, *above = common.chunk_loop(
        plan, math, split * plan.split_len, vocab,
        common.row_chunk_loader(x_ref, row, plan.chunk),
        lambda carry, chunk, x: compact(carry, chunk.index, x), init)
    finish(count, list_count, outside, above)

  if not gathering:
    return

  @pl.when(active & gather)
  def _():  # rounds of one chunk: per_round listed segments each
    _, listed_ref, listed_count_ref = gather_refs
    per_round = plan.chunk // segment
    listed = listed_count_ref[row]
    rounds = (listed + per_round - 1) // per_round
    mine = (rounds + plan.num_splits - 1) // plan.num_splits
    slot = lax.broadcasted_iota(jnp.int32, (plan.chunk,), 0) // segment
    offset = lax.broadcasted_iota(jnp.int32, (plan.chunk,), 0) % segment
    last_entry = listed_ref.shape[1] - 1

    def body(r, carry):
      first = r * per_round
      start = jnp.zeros((plan.chunk,), jnp.int32)
      for j in range(per_round):
        entry = jnp.minimum(first + j, last_entry)
        start = jnp.where(slot == j, listed_ref[row, entry] * segment, start)
      index = start + offset
      load = (first + slot < listed) & (index < vocab)
      index = jnp.where(load, index, 0)
      x = plgpu.load(x_ref.at[row, index], mask=load, other=-jnp.inf)
      return compact(carry, index, x)

    count, list_count, _, *above = lax.fori_loop(
        jnp.minimum(split * mine, rounds),
        jnp.minimum((split + 1) * mine, rounds), body, init)
    finish(count, list_count, jnp.zeros((), jnp.float32), above)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
  """Rows (``gather`` ``[B]``) whose candidates come from listed segments
  alone: ``listed`` ``[B, N]`` segment indices (ascending), ``count`` ``[B]``
  of them (``<= N`` on ``gather`` rows); every element reaching the compact
  pass's filter lies in a listed segment (``RowBounds.listed``).  ``mass``
  ``[B]``: the row's mass relative to ``row_max`` (``RowBounds.mass``).
  Gather rows need no outside mass (top-k on, or the bound is ``t1``) or
  have min-p off: then it is ``mass`` less the candidates'."""

  gather: jax.Array
  listed: jax.Array
  count: jax.Array
  mass: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Candidates:
  """The candidate buffer of each row, in vocab order, ``[B, C]`` each
  (padding: ``y = race = -inf``, ``id = -1``), with ``count`` ``[B]`` (exact,
  possibly above ``C``) and ``outside_mass`` ``[B]``: the mass relative to
  ``row_max`` of min-p survivors below the bound, ``inside_mass`` ``[B]`` that
  of the candidates.  Windowed (``upper`` given):
  the candidates are ``{L <= y < U}`` and ``above_count``/``above_mass`` the
  count and mass of ``{y >= U}`` (else 0).  The buffers of rows not active
  are undefined (their counts and masses 0)."""

  y: jax.Array
  ids: jax.Array
  race: jax.Array
  count: jax.Array
  outside_mass: jax.Array
  inside_mass: jax.Array
  above_count: jax.Array
  above_mass: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Listing:
  """A window with no upper end that the compact pass fills beside the
  candidates, from the same loads: every element of ``rows`` (``[B]``
  bool) with ``y >= lower`` (``[B]``), in vocab order, ``capacity``
  slots."""

  rows: jax.Array
  lower: jax.Array
  capacity: int = dataclasses.field(metadata=dict(static=True))


def collect_candidates(logits, params: SamplingParams | jax.Array, active,
                       lower_bound, t1, row_max,
                       streams: rng.RowStreams | None, config: SamplerConfig,
                       *, upper=None, capacity: int | None = None,
                       segments: Segments | None = None,
                       listing: Listing | None = None):
  """Runs the compact pass on the ``active`` rows (``[B]`` bool or int32
  flags; ``params`` or their ``_param_table``: their temperatures) and
  packs each row's candidates into ``C`` slots (``capacity``, default ``config.max_candidates``); with ``upper`` ``[B]``
  (``>= lower_bound``, ``>= t1``), only the window ``[lower_bound, upper)``;
  with ``segments``, its ``gather`` rows read only their listed segments
  (``RowBounds.listed``); the outside mass of those with min-p off is the
  row's ``mass`` less the candidates'.  Without ``streams`` no noise is
  drawn (``Candidates.race`` is None).  With ``listing`` (not with
  ``segments``), the pass also lists its window (rows need not be
  ``active``) and returns ``(candidates, listed)``: ``listed`` holds the
  ``Listing``'s elements (``Candidates`` of ``{y >= lower}``; no race, no
  masses)."""
  batch, vocab = logits.shape
  capacity = capacity or config.max_candidates
  windowed = upper is not None
  upper_inputs = (upper,) if windowed else ()
  plan = _pass_plan(batch, vocab, logits.dtype, config, block=_COMPACT_BLOCK,
                    per_tile=_COMPACT_TILE, warps=_COMPACT_WARPS)
  shape = (batch, plan.num_splits)
  if listing is not None and (segments is not None or plan.chunk >= _LISTED):
    raise ValueError("a listing needs whole rows and chunks below 2^16")
  list_capacity = 0 if listing is None else listing.capacity
  param_table = _param_table(params)
  kernel = functools.partial(_compact_kernel, plan=plan, vocab=vocab,
                             capacity=capacity, list_capacity=list_capacity,
                             segment=_segment_size(vocab, plan.chunk),
                             windowed=windowed, gathering=segments is not None)
  flags = active.astype(jnp.int32)
  if listing is not None:
    flags = flags + 2 * listing.rows.astype(jnp.int32)
  list_inputs = () if listing is None else (listing.lower,)
  gather = () if segments is None else (segments.gather.astype(jnp.int32),)
  gather_inputs = gather and (*gather, segments.listed, segments.count)
  buffer = lambda dtype: jax.ShapeDtypeStruct(
      shape + (capacity + list_capacity,), dtype)
  split_values = lambda dtype: jax.ShapeDtypeStruct(shape, dtype)
  x, ids, count, outside, *outs = pl.pallas_call(
      kernel,
      out_shape=[buffer(jnp.float32), buffer(jnp.int32),
                 split_values(jnp.int32), split_values(jnp.float32)] + [
                     split_values(jnp.int32),
                     split_values(jnp.float32)] * windowed + [
                         split_values(jnp.int32)] * (listing is not None),
      grid=shape, compiler_params=plan.compiler_params(),
      interpret=plan.interpret, name="jaxsample_collect_candidates")(
          param_table, flags, lower_bound, t1, row_max, *upper_inputs,
          *list_inputs, *gather_inputs, logits)
  above, outs = outs[:2 * windowed], outs[2 * windowed:]
  pack = functools.partial(_pack, param_table=param_table, t1=t1,
                           row_max=row_max, splits=plan.num_splits,
                           generator=config.rng, interpret=plan.interpret)
  candidates = pack(
      active, lower_bound, x, ids, count, outside, capacity=capacity,
      streams=streams, window=upper_inputs and (upper, *above),
      gather=gather and (*gather, segments.mass))
  if listing is None:
    return candidates
  return candidates, pack(listing.rows, listing.lower, x, ids, outs[0],
                          jnp.zeros(shape, jnp.float32),
                          capacity=list_capacity, offset=capacity)


def _pack(active, lower, x, ids, count, outside, *, param_table, t1, row_max,
          splits: int, capacity: int, generator: str, interpret: bool,
          offset: int = 0, streams: rng.RowStreams | None = None, window=(),
          gather=()) -> Candidates:
  """``Candidates`` of the compact pass's split buffers, ``capacity`` slots
  from ``offset`` (``_pack_kernel``; ``window``: ``(U, above count, above
  mass)``; ``gather``: ``(Segments.gather, mass)``)."""
  batch = active.shape[0]
  raced = streams is not None
  kernel = functools.partial(_pack_kernel, splits=splits, capacity=capacity,
                             offset=offset, generator=generator, raced=raced,
                             windowed=bool(window), gathering=bool(gather),
                             interpret=interpret)
  row_shape = lambda dtype: jax.ShapeDtypeStruct((batch,), dtype)
  slots = lambda dtype: jax.ShapeDtypeStruct((batch, capacity), dtype)
  y, ids, *race, count, outside, inside_mass, above_count, above_mass, _ = (
      pl.pallas_call(
          kernel,
          out_shape=[slots(jnp.float32), slots(jnp.int32)] +
          [slots(jnp.float32)] * raced + [
              row_shape(jnp.int32), row_shape(jnp.float32),
              row_shape(jnp.float32), row_shape(jnp.int32),
              row_shape(jnp.float32),
              jax.ShapeDtypeStruct((batch, _pow2_ceil(splits)), jnp.int32)],
          grid=(batch,),
          compiler_params=plgpu.CompilerParams(
              num_warps=min(16, max(_PACK_WARPS, capacity // 256)),
              num_stages=1),
          interpret=interpret, name="jaxsample_pack_candidates")(
              param_table, active.astype(jnp.int32), lower, t1, row_max,
              *([rowwise.pack_rows(jax.tree.leaves(streams), batch)] if raced
                else []), x, ids, count,
              outside, *window, *gather))
  return Candidates(y, ids, race[0] if raced else None, count, outside,
                    inside_mass, above_count, above_mass)


def _pack_kernel(param_ref, active_ref, lower_ref, t1_ref, row_max_ref, *refs,
                 splits: int, capacity: int, offset: int, generator: str,
                 raced: bool, windowed: bool, gathering: bool,
                 interpret: bool):
  """One row's candidates (``Candidates``) from the compact pass's split
  buffers (``capacity`` slots from ``offset``): the splits' entries side by
  side (vocab order; split ``s``'s first at slot ``starts[s]``, the sum of
  the earlier splits' written counts, which the kernel writes to its last
  output and reads back), tempered with the reference's division, the
  filter's extra elements moved to the outside mass (``y < L``) or above the
  window (``y >= U``; ``windowed``: inputs ``U`` and the compact pass's
  above count and mass), and the race values of the rest with the noise of
  their ids (``raced``: inputs the row streams, output the race).
  ``gathering`` (inputs ``Segments.gather`` and ``mass``): the outside mass
  of gather rows with min-p off is the row's less the candidates'."""
  stream_refs, refs = refs[:raced], refs[raced:]
  x_ref, id_ref, count_ref, outside_ref, *refs = refs
  window_refs, refs = refs[:3 * windowed], refs[3 * windowed:]
  gather_refs, refs = refs[:2 * gathering], refs[2 * gathering:]
  y_out, id_out, *refs = refs
  race_out, refs = (refs[0], refs[1:]) if raced else (None, refs)
  (count_out, outside_out, inside_out, above_count_out, above_mass_out,
   starts_ref) = refs
  row = pl.program_id(0)
  upper, above_refs = ((window_refs[0][row], window_refs[1:]) if windowed
                       else (jnp.inf, ()))
  math = common.KernelMath(interpret)
  active = active_ref[row] != 0

  def pack():
    lanes = jnp.arange(_pow2_ceil(splits), dtype=jnp.int32)
    written = plgpu.load(count_ref.at[row, lanes], mask=lanes < splits,
                         other=0)
    written = jnp.minimum(written, capacity)
    starts_ref[row, :] = jnp.cumsum(written) - written
    if not interpret:  # the stores above are read by other threads
      plgpu.debug_barrier()
    slot = lax.broadcasted_iota(jnp.int32, (capacity,), 0)
    # Each slot's split: the last one starting at or before it (binary search).
    source = jnp.zeros((capacity,), jnp.int32)
    step = _pow2_ceil(splits) // 2
    while step:
      probe = source + step
      inside = probe < splits
      start = plgpu.load(starts_ref.at[row, jnp.where(inside, probe, 0)],
                         mask=inside, other=capacity)
      source = jnp.where(inside & (start <= slot), probe, source)
      step //= 2
    local = slot - plgpu.load(starts_ref.at[row, source])
    filled = local < jnp.minimum(plgpu.load(count_ref.at[row, source]),
                                 capacity)
    local = jnp.where(filled, local, 0) + offset
    x = plgpu.load(x_ref.at[row, source, local], mask=filled, other=-jnp.inf)
    ids = plgpu.load(id_ref.at[row, source, local], mask=filled, other=0)

    def split_sum(ref):  # one load of the row's per-split values
      return jnp.sum(plgpu.load(ref.at[row, lanes], mask=lanes < splits,
                                other=0))

    count, outside = split_sum(count_ref), split_sum(outside_ref)
    above_count, above_mass = (split_sum(ref) for ref in above_refs) if (
        windowed) else (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))
    t = _row_params(param_ref, row)[0].temperature
    y = jnp.where(x > -jnp.inf, math.temper(x, t), -jnp.inf)
    e = jnp.where(y > -jnp.inf, jnp.exp(y - row_max_ref[row]), 0.0)
    over = y >= upper
    inside = (y >= lower_ref[row]) & ~over
    t1 = t1_ref[row]
    extra = ~inside & ~over & (y >= t1)
    y = jnp.where(inside, y, -jnp.inf)
    ids = jnp.where(inside, ids, 0)
    y_out[row, :] = y
    id_out[row, :] = jnp.where(inside, ids, -1)
    if raced:
      stream = rng.RowStreams(*common.table_row(stream_refs[0], row,
                                                common.STREAM_DTYPES))
      race_out[row, :] = y + rng.gumbel(rng.uniform(rng.bits_at(
          generator, stream, ids, mulhilo=math.mulhilo)))
    count_out[row] = count
    inside_mass = jnp.sum(jnp.where(inside, e, 0.0))
    outside = outside + jnp.sum(jnp.where(extra, e, 0.0))
    if gathering:
      gather_ref, mass_ref = gather_refs
      outside = jnp.where((gather_ref[row] != 0) & (t1 == -jnp.inf),
                          jnp.maximum(mass_ref[row] - inside_mass, 0.0),
                          outside)
    outside_out[row] = outside
    inside_out[row] = inside_mass
    above_count_out[row] = above_count + jnp.sum(jnp.where(over, 1, 0))
    above_mass_out[row] = above_mass + jnp.sum(jnp.where(over, e, 0.0))

  # Rows not active skip the packing: their buffers stay undefined, their
  # counts and masses are 0.
  pl.when(active)(pack)

  @pl.when(~active)
  def _():
    count_out[row] = 0
    above_count_out[row] = 0
    for out in (outside_out, inside_out, above_mass_out):
      out[row] = 0.0


# ---------------------------------------------------------------------------
# Fixed-pass search: thresholds no buffer holds.
# ---------------------------------------------------------------------------

_PIVOT_BITS = 4  # key bits each pass resolves
_PIVOTS = 1 << _PIVOT_BITS  # pivots per pass
_PIVOT_PASSES = 32 // _PIVOT_BITS  # passes that resolve any uint32 key range
_SMALLEST_FINITE_KEY = 0x00800000  # order_key(-FLT_MAX)
_PIVOT_WARPS = 8  # one program walks the whole row (4, 16 and 32: slower)


def _bit_length(v: jax.Array) -> jax.Array:
  """Bits of the uint32 ``v`` up to its highest set bit (0 for 0), int32."""
  n = jnp.int32(0)
  for shift in (16, 8, 4, 2, 1):  # a binary search for the highest bit
    high = (v >> jnp.uint32(shift)) != 0
    v = jnp.where(high, v >> jnp.uint32(shift), v)
    n = jnp.where(high, n + shift, n)
  return jnp.where(v != 0, n + 1, n)


def _pivot_kernel(param_ref, active_ref, floor_ref, lower_ref,
                  row_max_ref, x_ref, threshold_out, *,
                  plan: common.KernelPlan, vocab: int, by_count: bool):
  """One row's ``pivot_threshold``: up to ``_PIVOT_PASSES`` passes over the
  row by one program, each summing the count (``by_count``) or the mass
  relative to ``row_max`` of the survivors ``y >= floor`` (finite) reaching
  each of ``_PIVOTS`` pivots (fp32 sums; counts stay exact below 2^24).
  Inactive rows write ``lower``.

  Survivors above ``hi`` (every pivot's) reach every pivot: one sum; a tile
  without survivors in ``[pivot 0, hi]`` skips the per-pivot sums."""
  row = pl.program_id(0)
  floor, row_max = floor_ref[row], row_max_ref[row]
  # A bound past row_max (a vacuous top-p bound at p = 0: NaN) is row_max,
  # the answer such rows have.
  lower = jnp.maximum(floor, lower_ref[row])
  lower = jnp.where(lower <= row_max, lower, row_max)

  @pl.when(active_ref[row] == 0)
  def _():
    threshold_out[row] = lower

  @pl.when(active_ref[row] != 0)
  def _():
    math = common.KernelMath(plan.interpret)
    params, _ = _row_params(param_ref, row)
    t, k, p = params.temperature, params.top_k, params.top_p
    lo = jnp.maximum(common.order_key(lower),
                     jnp.uint32(_SMALLEST_FINITE_KEY))
    hi = jnp.maximum(common.order_key(row_max), lo)

    def one_pass(i, state):
      lo, hi, goal = state
      width = hi - lo
      shift = jnp.maximum(_bit_length(width) - _PIVOT_BITS, 0).astype(
          jnp.uint32)
      # Pivots past hi sit at hi: where every pivot meets the goal (p = 0),
      # the answer is hi itself.  Every pivot is the key of a finite value or
      # of 0 (keys between those of -FLT_MAX and row_max), so y >= value iff
      # order_key(y) >= pivot.
      pivots = [lo + jnp.minimum(jnp.uint32(j) << shift, width)
                for j in range(_PIVOTS)]
      values = [common.key_value(pivot) for pivot in pivots]
      hi_value = common.key_value(hi)

      def tile_step(carry, tile, loaded):
        del tile
        total, above, reach = carry
        parts = []
        for x in loaded:
          y = math.temper(x.astype(jnp.float32), t)
          survives = (y >= floor) & (y > -jnp.inf)
          weight = jnp.where(survives, 1.0 if by_count else math.exp2_approx(
              (y - row_max) * _LOG2E), 0.0)
          inside = jnp.where(y <= hi_value, weight, 0.0)
          total, above = total + weight, above + (weight - inside)
          parts.append((y, inside))

        def add(reach):
          for y, inside in parts:
            reach = tuple(r + jnp.where(y >= value, inside, 0.0)
                          for r, value in zip(reach, values))
          return reach

        # One block reduction per tile: per chunk was 7-13% slower; no skip
        # 3-15% faster at B = 1, 10-24% slower at B = 128 (bench_pivot.py).
        hit = functools.reduce(jnp.maximum, [
            jnp.max(jnp.where((y >= values[0]) & (inside > 0), 1, 0))
            for y, inside in parts])
        return total, above, lax.cond(hit > 0, lambda: add(reach),
                                      lambda: reach)

      def search():
        lanes = jnp.zeros((plan.chunk,), jnp.float32)
        # A traced start: Pallas rejects static slices past the row's end.
        total, above, reach = common.tile_loop(
            plan, math, row * 0, vocab, common.row_chunk_loader(
                x_ref, row, plan.chunk), tile_step, (lanes, lanes,
                                                     (lanes,) * _PIVOTS))
        above = jnp.sum(above)
        reach = [jnp.sum(r) + above for r in reach]
        total = jnp.sum(total)  # reach(floor)
        if by_count:
          first_goal = jnp.where(
              k > 0, jnp.minimum(k.astype(jnp.float32), total), total)
        else:
          first_goal = p * total
        goal_now = jnp.where(i == 0, first_goal, goal)
        # reach is non-increasing; reach(lo) meets the goal (up to rounding).
        met = functools.reduce(lambda n, r: jnp.where(r >= goal_now, n + 1, n),
                               reach, jnp.int32(0))
        last = jnp.maximum(met - 1, 0)
        at = lambda j: functools.reduce(
            lambda picked, jp: jnp.where(j == jp[0], jp[1], picked),
            enumerate(pivots), pivots[0])
        new_hi = jnp.where(last == _PIVOTS - 1, hi,
                           at(jnp.minimum(last + 1, _PIVOTS - 1)) - 1)
        return at(last), new_hi, goal_now

      # A closed interval (lo == hi) is the answer: the passes left skip.
      return lax.cond(width > 0, search, lambda: (lo, hi, goal))

    lo, _, _ = lax.fori_loop(0, _PIVOT_PASSES, one_pass,
                             (lo, hi, jnp.zeros((), jnp.float32)))
    threshold_out[row] = common.key_value(lo)


def pivot_threshold(logits, params: SamplingParams, active, floor, row_max,
                    config: SamplerConfig, *,
                    by_count: bool, lower=None):
  """Exact threshold ``[B]`` of the ``active`` rows (valid, sampled) in at
  most ``_PIVOT_PASSES`` passes over the row, whatever the data: no buffer,
  no sample, no sort; one kernel, one program per row (inactive rows cost
  an idle program: callers need no ``lax.cond``).

  Over the survivors ``S = {y >= floor}`` (``floor <= row_max``), with
  ``reach(v)`` their count (``by_count``) or mass ``sum exp(y - row_max)``
  at order keys ``>= v``: the largest ``v`` with ``reach(v) >= goal``,
  ``goal = min(k, |S|)`` (the ``k``-th largest survivor, or the smallest;
  ``|S|`` where ``k = 0``) or ``p * reach(floor)`` (top-p's threshold on
  ``S``).  ``lower`` (default ``floor``): a value known not to exceed the
  answer.  Each pass splits the key interval ``[lo, hi]`` known to hold it
  (``reach(lo) >= goal``, ``hi`` the key of ``row_max`` or below a pivot
  that missed the goal) at ``_PIVOTS`` evenly spaced pivots and keeps the
  piece between the last pivot that meets the goal and the next:
  ``_PIVOT_BITS`` key bits per pass, so 32-bit keys resolve in
  ``_PIVOT_PASSES`` passes, ties or not; a row whose interval has closed
  skips the passes left (all of them when ``lower`` is the answer).  A
  pass's partial results are per-pivot sums, so vocab shards would combine
  them by a sum.  Masses are fp32 sums in a fixed order (monotone in
  ``v``).  Inactive rows: ``max(floor, lower)`` (or ``row_max`` below it).
  """
  batch, vocab = logits.shape
  plan = _pass_plan(batch, vocab, logits.dtype, config)
  plan = dataclasses.replace(plan, num_splits=1,
                             steps=-(-vocab // plan.tile),
                             num_warps=config.num_warps or _PIVOT_WARPS)
  kernel = functools.partial(_pivot_kernel, plan=plan, vocab=vocab,
                             by_count=by_count)
  lower = floor if lower is None else lower
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((batch,), jnp.float32),
      grid=(batch,), compiler_params=plan.compiler_params(),
      interpret=plan.interpret, name="jaxsample_pivot_threshold")(
          _param_table(params), active.astype(jnp.int32), floor, lower,
          row_max, logits)


# ---------------------------------------------------------------------------
# The truncated sampler.
# ---------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Truncation:
  """Per-row result of the truncated sampler (``[B]`` each unless noted).

  ``token``, ``logprob``, ``threshold``, ``count``, ``log_kept`` and
  ``ordered_ids`` are meaningful where ``complete``; ``complete`` is
  False for inactive and invalid rows and for rows whose kept set did not fit
  the candidate buffer.  ``row_max``, ``lse``: of the tempered row;
  ``threshold``, ``count``: the kept set ``{y >= threshold}`` and its size;
  ``log_kept`` = ``log sum_K exp(y - row_max)``; ``candidates`` holds ``K``
  (``y >= threshold`` entries); ``ordered_ids`` ``[B, W]`` (when asked for):
  ``K``'s ids by descending ``y``, smallest id first on ties, -1 padded;
  where ``top_listed`` (``large`` rows, with ``order_width <= C / 2``),
  instead the row's ``order_width`` largest survivors (``y >= t1``) in that
  order: the first ids of any kept set of the row (it is upward closed);
  ``finite``: the row's number of finite entries; ``gathered``: the row's
  candidates came from its listed segments (``Segments``); ``large`` (int32
  flags, ``RowBounds.large``): the row's kept set is left to
  ``sample_large``;
  ``t1``, ``bound``, ``mass``, ``stats`` and ``sample``: ``RowBounds``'.
  """

  token: jax.Array
  logprob: jax.Array
  complete: jax.Array
  row_max: jax.Array
  lse: jax.Array
  threshold: jax.Array
  count: jax.Array
  log_kept: jax.Array
  candidates: Candidates
  ordered_ids: jax.Array | None
  top_listed: jax.Array
  finite: jax.Array
  gathered: jax.Array
  large: jax.Array
  t1: jax.Array
  bound: jax.Array
  mass: jax.Array
  stats: RowStats

  @property
  def sample(self) -> jax.Array:
    return self.stats.sample

  def unfinished(self, params: SamplingParams) -> jax.Array:
    """``[B]``: the valid rows, sampled with a filter on, left incomplete
    (``large`` rows, and rows whose candidates overflowed the buffer):
    ``sample_large``'s rows."""
    return (params.truncates() & (params.temperature > 0) &
            jnp.isfinite(self.row_max) & ~self.complete)


def sample_truncated(logits, params: SamplingParams,
                     streams: rng.RowStreams, config: SamplerConfig, *,
                     order_width: int = 0,
                     finish_large: bool = True) -> Truncation:
  """Truncated Gumbel-max (fp32 noise) of the rows of canonical ``params``
  that are sampled with a filter on (other rows: not ``complete``); with
  ``order_width``, also the kept ids in probability order (``min(order_width,
  C)`` wide; with ``order_width <= C / 2`` also the first ids of ``large``
  rows: ``Truncation.top_listed``).

  Rows with ``k > C / 2``, and rows without top-k whose candidates ``{y >=
  L}`` would overflow the buffer (estimated from ``RowBounds.sample``), are
  ``large``: ``sample_large`` samples them and the rows whose candidates
  overflowed (``Truncation.unfinished``), here (``finish_large``, without
  ``order_width``) or by the caller (the rows stay incomplete).  With
  ``order_width <= C / 2``, the narrow pass (compact, pack, select) takes
  ``large`` rows too, as top-k = ``order_width`` rows (min-p kept): the
  launches that skip them otherwise list their ids for the mask.
  """
  interpret = jax.default_backend() != "gpu"
  capacity = config.max_candidates
  top_width = order_width if order_width <= capacity // 2 else 0
  stats = row_bounds(logits, params, config, top_width=top_width)
  safe_max, t1, mass = stats.safe_max, stats.t1, stats.mass
  large = stats.large != 0
  candidates = collect_candidates(
      logits, stats.pass_table, stats.narrow, stats.pass_bound, t1, safe_max,
      streams, config, segments=Segments(stats.gather, stats.listed,
                                         stats.listed_count, mass))
  (threshold, count, kept_mass, certified, token, token_y,
   *ordered) = select_threshold(
      candidates.y, safe_max, t1, stats.pass_table, candidates.outside_mass,
      bound=False, interpret=interpret, ids=candidates.ids,
      race=candidates.race,
      scan=candidates.count,  # rows that overflow the buffer are not ranked
      order_width=min(order_width, capacity), active=stats.narrow)
  log_kept = jnp.log(kept_mass)
  logprob = (token_y - safe_max) - log_kept
  # Exact iff every kept element and every top-k survivor is a candidate
  # (pass_bound == t1: the candidates are all min-p survivors).
  exact = ((stats.narrow != 0) & (candidates.count <= capacity) &
           (threshold >= stats.pass_bound) &
           ((certified != 0) | (stats.pass_bound == t1)))
  trunc = Truncation(token, logprob, exact & ~large, stats.row_max, stats.lse,
                     threshold, count, log_kept, candidates,
                     ordered[0] if ordered else None, exact & large,
                     stats.finite, stats.gather != 0, stats.large, t1,
                     stats.bound, mass, stats.stats)
  if not finish_large or order_width:
    return trunc
  left = trunc.unfinished(params)
  # Behind a cond, as in ``jaxsample.sample``: idle, the route costs more.
  found = rowwise.where_rows(
      left, rowwise.only_if(left, lambda: sample_large(
          logits, params, trunc, streams, config, left)),
      (token, logprob, trunc.complete, threshold, count, log_kept))
  return dataclasses.replace(trunc, **dict(zip(
      ("token", "logprob", "complete", "threshold", "count", "log_kept"),
      found)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeptSets:
  """Per-row kept sets, ``[B]`` each: ``{y >= threshold}`` (-inf: every
  entry); where ``measured``, also ``row_max = max(y)``, ``log_kept = log
  sum_K exp(y - row_max)`` and ``count = |K|`` (rows whose kept set the
  candidate buffer held, ``Truncation``'s, or whose threshold a window
  search found), so ``logsumexp`` of the processed row is ``row_max +
  log_kept``; undefined elsewhere.  From ``kept_sets``, also ``lse`` and
  ``finite``: the tempered row's logsumexp and number of finite entries
  (``Truncation``'s); ``count`` where measured; and ``ordered_ids`` ``[B,
  W]`` (when asked for): the first ids of each kept set by descending ``y``
  (``Truncation.ordered_ids``' order; undefined past the set's size)."""

  threshold: jax.Array
  row_max: jax.Array
  log_kept: jax.Array
  measured: jax.Array
  lse: jax.Array | None = None
  finite: jax.Array | None = None
  ordered_ids: jax.Array | None = None
  count: jax.Array | None = None


def untruncated_sets(shape: tuple[int, ...],
                     order_width: int = 0) -> KeptSets:
  """Kept sets of rows of ``shape`` without a filter (threshold -inf, none
  measured), with every field of ``kept_sets``' (``order_width``: theirs,
  ``shape + (order_width,)``)."""
  none = jnp.full(shape, -jnp.inf)
  zeros = jnp.zeros(shape, jnp.int32)
  return KeptSets(
      none, none, none, zeros != 0, none, zeros,
      jnp.zeros(shape + (order_width,), jnp.int32) if order_width else None,
      zeros)


def kept_sets(logits, params: SamplingParams, config: SamplerConfig, *,
              order_width: int = 0, measure_all: bool = False) -> KeptSets:
  """The kept set of each valid row of canonical ``params`` sampled with a
  filter on (``reference.keep_threshold``'s threshold); threshold -inf for
  the other rows.  With ``order_width``, also the first ``min(order_width,
  V)`` ids of each kept set by descending ``y`` (``KeptSets.ordered_ids``,
  ``[B, order_width]``); with ``measure_all``, every kept set is measured
  (a sampling mask's count and mass).

  ``sample_truncated``'s passes (its race rides along on fixed streams over
  the candidates; its tokens are not used), then ``large_thresholds`` (and
  ``large_kept_ids``) for the rows it leaves, without a race (with
  ``order_width``, behind a cond taken when some row is left; their
  kernels skip the other rows); with ``measure_all``, the kept sets no
  window search measured (min-p alone, pivot searches) are counted by the
  Gumbel kernel with a floor there (``floored_race``).  Traced in 32 bits
  also inside an x64 scope (the FP64 Gumbel path's).
  """
  return joint_kept_sets([KeptSetQuery(logits, params, order_width,
                                       measure_all)], config)[0]


@dataclasses.dataclass(frozen=True)
class KeptSetQuery:
  """One batch of ``joint_kept_sets``: ``kept_sets``' arguments."""

  logits: jax.Array
  params: SamplingParams
  order_width: int = 0
  measure_all: bool = False


def joint_kept_sets(queries, config: SamplerConfig) -> list[KeptSets]:
  """``kept_sets`` of each ``KeptSetQuery``, the large-set routes of all
  behind one cond where one asks for ids (one predicate's trip to the host
  on a GPU, where a cond per batch would cost one each)."""
  with jax.enable_x64(False):
    config = dataclasses.replace(config, use_fp64_gumbel=False)
    streams = [rng.RowStreams(*(jnp.zeros((q.logits.shape[0],),
                                          jnp.uint32),) * 4) for q in queries]
    truncs = [sample_truncated(q.logits, q.params, s, config,
                               order_width=q.order_width, finish_large=False)
              for q, s in zip(queries, streams)]
    lefts = [t.unfinished(q.params) for q, t in zip(queries, truncs)]

    def finish_left(q: KeptSetQuery, trunc: Truncation, left, streams):
      """``left`` rows' ``KeptSets`` (and ids by probability)."""
      width = min(q.order_width, q.logits.shape[1])
      large, listed = large_thresholds(
          q.logits, q.params, trunc, config, left,
          list_width=width if _listing_width(width, config) else 0)
      if q.measure_all:
        counted = left & ~large.measured
        _, count, log_kept = floored_race(q.logits, q.params, streams, config,
                                          counted, large.threshold,
                                          trunc.row_max)
        large = dataclasses.replace(
            large, measured=large.measured | counted,
            count=jnp.where(counted, count, large.count),
            log_kept=jnp.where(counted, log_kept, large.log_kept))
      return large, large_kept_ids(
          q.logits, q.params, trunc, config, left, large.threshold, width,
          listed) if q.order_width else None

    finish = lambda: [finish_left(*args)
                      for args in zip(queries, truncs, lefts, streams)]
    # With ids to order (a mask), behind a cond: idle, that route costs
    # more.  Without, the searches' idle launches cost less than the cond's
    # trip, and more when they run inside one (top-p 0.95 kept sets of
    # 110k ids: 8-20 us at B = 1, 15-27 at B = 128 on an H200,
    # benchmarks/results/2026-11-26e-h200-kept-sets).
    finished = (rowwise.only_if(lefts, finish)
                if any(q.order_width for q in queries) else finish())
    return [_combine_sets(q.order_width, t, left, *f)
            for q, t, left, f in zip(queries, truncs, lefts, finished)]


def _combine_sets(order_width: int, trunc: Truncation, left,
                  large: KeptSets, large_ids) -> KeptSets:
  """``KeptSets`` of ``trunc``'s complete rows and the ``left`` rows'
  ``large`` sets (``joint_kept_sets``)."""
  threshold = jnp.where(trunc.complete, trunc.threshold,
                        jnp.where(left, large.threshold, -jnp.inf))
  sets = KeptSets(threshold, trunc.row_max,
                  jnp.where(trunc.complete, trunc.log_kept, large.log_kept),
                  trunc.complete | (left & large.measured), trunc.lse,
                  trunc.finite,
                  count=jnp.where(trunc.complete, trunc.count, large.count))
  if not order_width:
    return sets
  pad = lambda ids, n: jnp.pad(ids, ((0, 0), (0, n - ids.shape[1])),
                               constant_values=-1)
  return dataclasses.replace(sets, ordered_ids=jnp.where(
      left[:, None], pad(large_ids, order_width),
      pad(trunc.ordered_ids, order_width)))


def _place_window(params: SamplingParams, trunc: Truncation, rows, floor,
                  capacity: int, *, by_count: bool, **listing):
  """``(search, lower, upper, *list_lower)``: the params of a window search
  (``by_count``: top-p off; else top-k off) and the window
  ``threshold_window`` places for ``rows``, from their sample (``listing``:
  its ``list_*`` arguments)."""
  search = dataclasses.replace(params, **(
      dict(top_p=jnp.ones_like(params.top_p)) if by_count else
      dict(top_k=jnp.zeros_like(params.top_k))))
  return search, *threshold_window(
      trunc.sample, _safe(trunc.row_max), floor, search, trunc.mass, capacity,
      rows, by_count=by_count, interpret=jax.default_backend() != "gpu",
      **listing)


def _window_threshold(window: Candidates, search: SamplingParams, rows, floor,
                      lower, upper, row_max, capacity: int, *,
                      by_count: bool):
  """``(threshold, kept mass, kept count, held)`` of a collected window
  (``_window_search``)."""
  total = window.above_mass + window.outside_mass + window.inside_mass
  if by_count:
    reached = window.above_count < search.top_k
    search = dataclasses.replace(search, top_k=jnp.maximum(
        search.top_k - window.above_count, 0))
  else:
    reached = window.above_mass < search.top_p * total
  threshold, window_count, window_mass, _ = select_threshold(
      window.y, _safe(row_max), floor, search, total, bound=True,
      interpret=jax.default_backend() != "gpu", above=window.above_mass,
      bits=32, num_warps=_WINDOW_WARPS, active=rows, window=(lower, upper))
  return (threshold, window.above_mass + window_mass,
          window.above_count + window_count,
          (window.count <= capacity) & reached & (threshold >= lower))


def _safe(row_max):
  return jnp.where(jnp.isfinite(row_max), row_max, 0.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Listed:
  """A collected ``Listing`` (``large_thresholds``): the listing, placed by
  the row's first window search, and its buffer (``Candidates``)."""

  listing: Listing
  window: Candidates


def _window_search(logits, params: SamplingParams, trunc: Truncation,
                   config: SamplerConfig, rows, floor, *, by_count: bool,
                   lists=None, list_width: int = 0):
  """``(threshold, kept mass, kept count, held, listed)`` of ``rows``
  (``large`` rows of ``trunc``; other rows' entries undefined): top-k's
  threshold
  (``by_count``: the ``k``-th largest survivor ``y >= floor``) or top-p's
  above the survivors' ``floor``, found in the window (``Candidates``,
  ``_TOP_K_WINDOW_BUFFERS`` or ``_WINDOW_BUFFERS`` candidate buffers)
  ``threshold_window`` places from the row's sample; the kept mass
  ``sum_{y >= threshold} exp(y - row_max)`` and count; ``held``: the window
  held the
  threshold and fit its buffer.  With ``lists`` (rows whose ``floor`` is
  ``t1``), the same window kernel places those rows' ``Listing`` for a mask
  of ``list_width`` ids and the same compact pass fills it: ``listed`` is
  that ``_Listed`` (None without ``lists``)."""
  capacity = config.max_candidates * (
      _TOP_K_WINDOW_BUFFERS if by_count else _WINDOW_BUFFERS)
  list_capacity = 0 if lists is None else _listing_capacity(list_width,
                                                            config)
  search, lower, upper, *list_lower = _place_window(
      params, trunc, rows, floor, capacity, by_count=by_count,
      **({} if lists is None else dict(list_rows=lists, list_width=list_width,
                                       list_capacity=list_capacity)))
  listing = list_lower and Listing(lists, list_lower[0], list_capacity)
  found = collect_candidates(logits, params, rows, lower, floor,
                             _safe(trunc.row_max), None, config, upper=upper,
                             capacity=capacity, listing=listing or None)
  window, listed = found if listing else (found, None)
  return (*_window_threshold(window, search, rows, floor, lower, upper,
                             trunc.row_max, capacity, by_count=by_count),
          _Listed(listing, listed) if listing else None)


def _listing_width(width: int, config: SamplerConfig) -> bool:
  """Whether a mask of ``width`` ids lists large kept sets from a ``Listing``
  (``large_thresholds``): ``width > C / 2`` (narrower masks come from the
  candidate buffer of top-k = ``width``) and within half a window of the top,
  so that the window has no upper end."""
  return (width > config.max_candidates // 2 and width // _SAMPLE_STRIDE
          <= _window_half(_listing_capacity(width, config)))


def large_thresholds(logits, params: SamplingParams, trunc: Truncation,
                     config: SamplerConfig, rows, *, list_width: int = 0
                     ) -> tuple[KeptSets, _Listed | None]:
  """The exact kept sets of ``rows`` (valid rows of ``trunc``, sampled with a
  filter on; other entries undefined), measured where a window search found
  the threshold.

  Each threshold comes from a window search (``_window_search``):
  ``threshold_window`` places a window ``[lower, upper)`` around it, from the
  row's sample; the windowed compact pass writes the window's elements and
  sums the count and mass above it and the mass below it; a 32-bit
  bound-mode search over the window finds the exact threshold (held iff the
  window held it and fit its buffer), and the kept mass is the mass above
  the window plus that of the window's kept elements.  With top-k on, a
  first search finds ``max(t1, t2)``: the ``(k - above)``-th largest
  survivor in the window.  With top-p, a search on the survivors ``y >=
  max(t1, t2)`` (the distribution top-p renormalizes) finds ``t3``.  min-p
  alone keeps ``{y >= t1}`` (not measured).  A threshold no window holds
  (ties spanning the window, a misleading sample, or a row not ``large``
  whose candidates overflowed their buffer) comes from ``pivot_threshold``
  instead, ``_PIVOT_PASSES`` more passes per search, and is not measured.

  ``list_width`` (``_listing_width``): the window kernel and compact pass
  of each ``large`` row's first search (top-k's, else top-p's; a min-p
  row's run for it alone) also place and fill the row's ``Listing``: a
  window by count (``k = list_width``) with no upper end, which holds the
  row's ``list_width`` largest survivors (``large_kept_ids``), so a mask
  costs no pass or kernel of its own.  Returns the ``KeptSets`` and the collected listing (None without
  ``list_width``).
  """
  large, t1 = trunc.large != 0, trunc.t1
  row_max = _safe(trunc.row_max)
  counted = rows & (params.top_k > 0)
  topped = rows & (params.top_p < 1)
  if list_width:
    list_rows = rows & large
    first_lists = list_rows & (counted | ~topped)

  def search(rows, floor, by_count: bool, lists=None, lower=trunc.bound):
    """``(threshold, kept mass, kept count, measured, listed)`` of ``rows``:
    a window search where the row has a sample and its window holds the
    threshold (mass and count measured), else the pivot search (``lower``: a value not above the
    threshold); ``lists``: the rows whose listing its pass places and
    fills."""
    windowed = rows & large
    threshold, mass, count, held, listed = _window_search(
        logits, params, trunc, config, windowed, floor, by_count=by_count,
        lists=lists, list_width=list_width)
    measured = windowed & held
    missed = rows & ~measured
    exact = pivot_threshold(logits, params, missed, floor, row_max, config,
                            by_count=by_count, lower=lower)
    return jnp.where(missed, exact, threshold), mass, count, measured, listed

  floor, mass, count, measured, listed = search(
      counted, t1, by_count=True, lists=first_lists if list_width else None)
  floor = jnp.where(counted, floor, t1)
  threshold, topped_mass, topped_count, topped_measured, second = search(
      topped, floor, by_count=False,
      lists=list_rows & ~first_lists if list_width else None)
  threshold = jnp.where(topped, threshold, floor)
  mass = jnp.where(topped, topped_mass, mass)
  count = jnp.where(topped, topped_count, count)
  measured = jnp.where(topped, topped_measured, measured)
  sets = KeptSets(threshold, trunc.row_max, jnp.log(mass), measured,
                  count=count)
  if list_width:
    listed = rowwise.where_rows(first_lists, listed, second)
  return sets, listed


def _top_width(params: SamplingParams, width: int) -> SamplingParams:
  """``params`` with top-k = ``width`` and top-p off (min-p kept)."""
  return SamplingParams(params.temperature,
                        jnp.full_like(params.top_k, width),
                        jnp.ones_like(params.top_p), params.min_p)


def sample_large(logits, params: SamplingParams, trunc: Truncation,
                 streams: rng.RowStreams, config: SamplerConfig, rows=None, *,
                 order_width: int = 0):
  """``(token, logprob, complete, threshold, count, log_kept)`` of ``rows``
  (default ``trunc.large``; valid rows of ``trunc``, sampled with a filter
  on), every one of them complete (``Truncation``'s fields); other rows
  skip every kernel (their entries are undefined).  With ``order_width``,
  also the first ``min(order_width, V)`` ids of each kept set by descending
  ``y`` (``large_kept_ids``).

  ``large_thresholds`` finds each threshold (and fills the mask's listing);
  then the Gumbel kernel races the kept set ``{y >= threshold}``
  (``floor``), which also gives its count and mass: three passes over the
  row (four with both top-k and top-p).
  """
  rows = trunc.large != 0 if rows is None else rows
  width = min(order_width, logits.shape[1])
  sets, listed = large_thresholds(
      logits, params, trunc, config, rows,
      list_width=width if _listing_width(width, config) else 0)
  result, count, log_kept = floored_race(logits, params, streams, config,
                                         rows, sets.threshold, trunc.row_max)
  found = (result.tokens, result.logprobs, rows, sets.threshold, count,
           log_kept)
  if not width:
    return found
  return found + (large_kept_ids(logits, params, trunc, config, rows,
                                 sets.threshold, width, listed),)


def floored_race(logits, params: SamplingParams, streams: rng.RowStreams,
                 config: SamplerConfig, rows, floor, row_max):
  """Gumbel-max over each of ``rows``' kept set ``{y >= floor}`` (the Gumbel
  kernel with a floor; FP64 noise where ``config`` asks): ``(SampleResult,
  kept count, log sum_K exp(y - row_max))`` (``row_max`` of the row; other
  rows' entries undefined)."""
  partials = gumbel.gumbel_partials(logits, params.temperature, streams,
                                    config, active=rows, floor=floor)
  result, _, (shift, log_sum) = gumbel.finish_sampling(logits, params,
                                                       partials)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  return (result, jnp.sum(partials.kept, axis=-1),
          (shift - row_max) + log_sum)


def _listing_capacity(width: int, config: SamplerConfig) -> int:
  """Slots of the window that lists a row's ``width`` largest values: the
  fewest (a power of 2, at most the top-k window's) whose window, ``H =
  _window_half * _SAMPLE_STRIDE`` elements each way, has no upper end at
  rank ``width`` (``H >= width``) and whose lower end, about ``width + H``
  elements down, lies below rank ``width`` by 5 standard deviations of the
  sample's count there (``sqrt(_SAMPLE_STRIDE * (width + H))``); the
  expected fill is then at most 0.7."""
  capacity = 16
  while True:
    reach = _window_half(capacity) * _SAMPLE_STRIDE
    if reach >= width and reach**2 >= 25 * _SAMPLE_STRIDE * (width + reach):
      break
    capacity *= 2
  return min(capacity, config.max_candidates * _TOP_K_WINDOW_BUFFERS)


def large_kept_ids(logits, params: SamplingParams, trunc: Truncation,
                   config: SamplerConfig, rows, threshold, width: int,
                   listed: _Listed | None = None) -> jax.Array:
  """``[B, width]``: the first ``width`` ids of each of ``rows``' kept set
  ``{y >= threshold}`` by descending ``y``, smallest id first on ties
  (``reference.top_ids``' order; undefined past the set's size).

  A kept set of more than ``width`` ids holds the row's ``width`` largest
  values (it is upward closed), so its ``width``-th largest is the
  ``width``-th largest min-p survivor ``v``; a smaller kept set is ``{y >=
  v}`` or lies inside it.  Either way the ids listed from ``last = max(v,
  threshold)`` start with the kept set's.

  With ``width <= C / 2``, ``trunc`` (from ``sample_truncated(...,
  order_width=width)``) holds them: its narrow pass listed the ``width``
  largest survivors of its ``large`` rows (``Truncation.top_listed``).
  Wider masks take ``listed``
  (``large_thresholds``' listing for ``list_width = width``, whose window
  holds every ``y >= lower`` of its rows in vocab order): a bound-mode
  search by count finds ``v`` in it, and the ids come from
  ``reference.top_ids`` on that buffer, not the ``[B, V]`` row.  Rows left
  (candidates overflowing the buffer, rows not ``large`` in ``trunc``, a
  listing window that missed ``v`` or overflowed, rows without a sample,
  masks too wide for a listing) take
  ``v`` from ``pivot_threshold`` (by count) and ``reference.top_ids`` on the
  whole row, behind a ``lax.cond``.  (Callers run this function behind a
  cond of its own: its XLA listing, over every row, would cost more on
  every call than the cond.)
  """
  t = params.temperature
  top_width = _top_width(params, width)
  ids = jnp.zeros((logits.shape[0], width), jnp.int32)
  listed_rows = jnp.zeros_like(rows)
  if width <= config.max_candidates // 2:
    ids, listed_rows = trunc.ordered_ids[:, :width], rows & trunc.top_listed
  elif listed is not None:
    window, lower = listed.window, listed.listing.lower
    last, _, _, held = _window_threshold(
        window, top_width, listed.listing.rows, trunc.t1, lower,
        jnp.full_like(lower, jnp.inf), trunc.row_max,
        listed.listing.capacity, by_count=True)
    ids = jnp.take_along_axis(window.ids, reference.top_ids(
        window.y, jnp.maximum(last, threshold), width), axis=-1)
    listed_rows = rows & listed.listing.rows & held
  missed = rows & ~listed_rows

  def row_ids():
    last = pivot_threshold(logits, top_width, missed, trunc.t1,
                           _safe(trunc.row_max), config, by_count=True)
    y = reference.temper(reference.sanitize(logits), t)
    return reference.top_ids(y, jnp.maximum(last, threshold), width)

  return jnp.where(listed_rows[:, None], ids,
                   rowwise.only_if(missed, row_ids, pack=False))
