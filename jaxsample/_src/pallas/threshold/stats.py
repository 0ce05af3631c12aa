"""Pass 1: the stats of each row, and the bound of its kept set."""

from __future__ import annotations

import dataclasses
import typing
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxsample._src.pallas import bitmask, common
from jaxsample._src import tuning
from jaxsample._src.pallas.threshold.base import (FILTER_SLACK, ONE_BITS,
                                             SAMPLE_STRIDE, TOP_K_FIELD,
                                             TOP_P_FIELD, pack_param_table,
                                             pass_plan, pow2_ceil, row_params,
                                             sanitize, segment_size)
from jaxsample._src.pallas.threshold.search import BOUND_KEY_BITS, kept_bound
from jaxsample._src.params import SamplerConfig, SamplingParams

__all__ = ["row_bounds", "RowBounds", "StatsPartials"]

# Top-p bounds from segment maxima aim this much above ``p * Z`` so fp32 sums
# never place the bound above the exact threshold.
_BOUND_MARGIN = 2.0**-10
# Rows whose bound is reached by at most this many segments read only those
# in the compact pass (``Segments``).
_LIST_CAP = 256


# ---------------------------------------------------------------------------
# Pass 1: stats, and the bound of the kept set.
# ---------------------------------------------------------------------------


def _row_flags(row, param_ref, capacity: int):
  """``(active, sampled)`` of a row: sampled with a filter on (canonical
  params), and also without top-k or with ``k > C / 2``, so that its kept
  set may be large and its sample is written."""
  params, _ = row_params(param_ref, row)
  active = (params.temperature > 0) & params.truncates()
  return active, active & (
      (params.top_k == 0) | (params.top_k > capacity // 2))


def _stats_kernel(param_ref, x_ref, *refs, plan: common.KernelPlan,
                  vocab: int, segment: int, capacity: int, masked: bool):
  """One (row, split) program (``masked``: a ``bitmask.MaskedLogits`` words
  ref follows ``x_ref``)."""
  words_refs, refs = refs[:masked], refs[masked:]
  max_ref, sumexp_ref, finite_ref, segment_ref, sample_ref = refs
  row, split = pl.program_id(0), pl.program_id(1)
  active, sampled = _row_flags(row, param_ref, capacity)

  @pl.when(active)
  def _():
    kmath = common.KernelMath(plan.interpret)
    per_chunk = plan.chunk // segment
    sampled_per_chunk = plan.chunk // SAMPLE_STRIDE
    first_in_group = lax.broadcasted_iota(
        jnp.int32, (plan.chunk,), 0) % SAMPLE_STRIDE == 0

    def fold(finite, chunk, x):
      """The chunk's segment maxima and sample (the first element of every
      ``SAMPLE_STRIDE``, on ``sampled`` rows); the finite count.  (A strided
      load of the sample from the row, in place of the reduction per group,
      made the pass 1.9x slower on an H100.)"""
      segment_ref[row, pl.ds(chunk.start // segment, per_chunk)] = jnp.max(
          x.reshape(per_chunk, segment), axis=1)

      @pl.when(sampled)
      def _():
        first = jnp.where(first_in_group, x, -jnp.inf)
        sample_ref[row, pl.ds(chunk.start // SAMPLE_STRIDE,
                              sampled_per_chunk)] = jnp.max(
                                  first.reshape(sampled_per_chunk,
                                                SAMPLE_STRIDE), axis=1)

      return finite + common.indicator(x > -jnp.inf)

    top, sumexp, finite = common.split_sumexp(
        plan, kmath, split * plan.split_len, vocab,
        bitmask.row_loader(x_ref, words_refs, row, plan.chunk),
        row_params(param_ref, row)[0].temperature,
        fold=(jnp.zeros((plan.chunk,), jnp.int32), fold))
    max_ref[row, split] = top
    sumexp_ref[row, split] = sumexp
    finite_ref[row, split] = jnp.sum(finite, dtype=jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StatsPartials:
  """The stats pass's results on the rows it read: per-split ``top`` (max
  of ``x``), ``sumexp`` and ``finite`` count ``[B, S]``, raw segment maxima
  ``segment_max`` ``[B, N]`` and ``sample`` ``[B, M]`` (``RowBounds``)."""

  top: jax.Array
  sumexp: jax.Array
  finite: jax.Array
  segment_max: jax.Array
  sample: jax.Array


def _stats_pass(logits, params: SamplingParams, plan, segment,
                capacity: int) -> StatsPartials:
  """The stats pass (``StatsPartials``) over the rows sampled with a filter on;
  it writes the sample of those ``_row_flags`` marks ``sampled``."""
  batch, vocab = logits.shape
  shape = (batch, plan.num_splits)
  padded = plan.num_splits * plan.split_len
  kernel = functools.partial(_stats_kernel, plan=plan, vocab=vocab,
                             segment=segment, capacity=capacity,
                             masked=isinstance(logits, bitmask.MaskedLogits))
  return StatsPartials(*common.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.int32),
                 jax.ShapeDtypeStruct((batch, padded // segment), jnp.float32),
                 jax.ShapeDtypeStruct((batch, padded // SAMPLE_STRIDE),
                                      jnp.float32)],
      grid=shape, compiler_params=plan.compiler_params(),
      interpret=plan.interpret, name="jaxsample_row_stats")(
          pack_param_table(params), *bitmask.operands(logits)))


class _BoundOutputs(typing.NamedTuple):
  """The bound select's per-row outputs, in ``pallas_call`` order
  (``RowBounds``' fields of the same names)."""

  row_max: jax.Array
  safe_max: jax.Array
  mass: jax.Array
  finite: jax.Array
  t1: jax.Array
  bound: jax.Array
  listed: jax.Array
  listed_count: jax.Array
  narrow: jax.Array
  gather: jax.Array
  large: jax.Array


_STATS_FIELDS = len(dataclasses.fields(StatsPartials))
_BOUND_OUTPUTS = len(_BoundOutputs._fields)


def _bound_kernel(param_ref, *refs, splits: int, segments: int, capacity: int,
                  top_width: int, interpret: bool):
  """One row's stats combined across splits, its bound and its route
  (``row_bounds``; ``top_width``: outputs ``pass_bound`` and the narrow
  pass's param table too).  ``refs``: the ``StatsPartials`` refs, the
  ``_BoundOutputs`` refs, then the narrow pass's outputs."""
  stats = StatsPartials(*refs[:_STATS_FIELDS])
  out = _BoundOutputs(*refs[_STATS_FIELDS:_STATS_FIELDS + _BOUND_OUTPUTS])
  pass_outs = refs[_STATS_FIELDS + _BOUND_OUTPUTS:]
  row = pl.program_id(0)
  kmath = common.KernelMath(interpret)
  active, sampled = _row_flags(row, param_ref, capacity)
  params, log_min_p = row_params(param_ref, row)
  t = jnp.where(active, params.temperature, 1.0)
  split = jnp.arange(pow2_ceil(splits), dtype=jnp.int32)
  use = active & (split < splits)
  top = plgpu.load(stats.top.at[row, split], mask=use, other=-jnp.inf)
  sumexp = plgpu.load(stats.sumexp.at[row, split], mask=use, other=0.0)
  x_max = jnp.max(top)
  row_max = jnp.max(kmath.temper(top, t))  # = temper(x_max): t > 0 is monotone
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  ref = jnp.where(jnp.isfinite(x_max), x_max, 0.0)
  mass = jnp.sum(jnp.where(top > -jnp.inf,
                           sumexp * jnp.exp((top - ref) * (1.0 / t)), 0.0))
  t1 = safe_max + log_min_p
  out.row_max[row] = row_max
  out.safe_max[row] = safe_max
  out.mass[row] = mass
  out.finite[row] = jnp.sum(plgpu.load(stats.finite.at[row, split], mask=use,
                                       other=0), dtype=jnp.int32)
  out.t1[row] = t1
  if top_width:
    pass_bound_out, pass_table_out = pass_outs
    for field in range(param_ref.shape[0]):
      pass_table_out[field, row] = param_ref[field, row]

  @pl.when(~active)
  def _():  # rows the truncation kernels skip: no search, no route
    out.bound[row] = t1
    out.listed_count[row] = 0
    out.narrow[row] = 0
    out.gather[row] = 0
    out.large[row] = 0
    if top_width:
      pass_bound_out[row] = t1

  @pl.when(active)
  def _():
    k = params.top_k
    lanes = jnp.arange(pow2_ceil(segments), dtype=jnp.int32)
    y = kmath.temper(plgpu.load(stats.segment_max.at[row, lanes],
                                mask=lanes < segments, other=-jnp.inf), t)
    bound, _ = kept_bound(y, safe_max, t1, k, params.top_p,
                          mass * (1 + _BOUND_MARGIN), 0.0, BOUND_KEY_BITS)
    valid = jnp.isfinite(row_max)
    # The sample's estimate is too noisy to trust a top-k row (k > C / 2)
    # with the buffer.
    large = valid & sampled & ((k > 0) | (_estimate_reaching(
        bound, row, stats.sample.shape[1], interpret, t, sampled,
        stats.sample) > capacity // 2))
    out.bound[row] = bound
    out.large[row] = common.indicator(large)
    pass_bound, pass_k = bound, k
    if top_width:  # large rows: the bound of their top_width largest
      pass_bound = lax.cond(large, lambda: kept_bound(
          y, safe_max, t1, jnp.int32(top_width), 1.0, mass, 0.0,
          BOUND_KEY_BITS)[0], lambda: bound)
      pass_k = jnp.where(large, top_width, k)
      pass_bound_out[row] = pass_bound
      pass_table_out[TOP_K_FIELD, row] = pass_k
      pass_table_out[TOP_P_FIELD, row] = jnp.where(
          large, ONE_BITS, param_ref[TOP_P_FIELD, row])
    narrow = valid if top_width else valid & ~large
    listed = _list_reaching(y, pass_bound, row, out.listed.shape[1],
                            out.listed)
    out.listed_count[row] = listed
    out.narrow[row] = common.indicator(narrow)
    # Rows whose outside mass is 0 (top-k on: unused; bound == t1: no
    # survivor lies below it) or the row's mass less the candidates' (no
    # min-p).
    out.gather[row] = common.indicator(
        narrow & (listed <= _LIST_CAP) & (
            (pass_k > 0) | (pass_bound == t1) | (t1 == -jnp.inf)))


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
  and ``pack_param_table``: ``L`` and the params, but on ``large`` rows with
  ``row_bounds``' ``top_width`` the bound of their ``top_width`` largest
  survivors (``y >= t1``) and top-k = ``top_width``, top-p off;
  ``listed`` ``[B, _LIST_CAP]`` the segments (``segment_size`` contiguous ids each) whose maximum reaches
  ``pass_bound`` (ascending; their number ``listed_count`` may exceed
  ``_LIST_CAP``); ``sample`` ``[B, M]``: every ``SAMPLE_STRIDE``-th
  sanitized logit ``x`` of the rows that may be large (-inf padded past V;
  undefined on other rows).  The route, int32 flags: valid rows are
  ``large`` (``k > C / 2``, or top-k off and the sample estimates more than
  ``C / 2`` elements reaching ``L``) or not; ``narrow`` rows' candidates
  (``{y >= pass_bound}``) go to the buffer: the rows not ``large``, and
  with ``top_width`` every valid row; ``gather`` narrow rows read only
  their listed segments (``Segments``).  ``stats``: the stats pass's
  ``StatsPartials``.
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
  stats: StatsPartials

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
  segment maxima (``kept_bound``; on ``large`` rows with ``top_width``, a
  second search by count) and routes it: one program per row
  (``tuning.BoundsLaunch``).
  """
  batch, vocab = logits.shape
  tuned = tuning.resolve(config.tuning)
  plan = pass_plan(batch, vocab, tuned.stats, tuned.occupancy)
  segment = segment_size(vocab, plan.chunk)
  stats = _stats_pass(logits, params, plan, segment, config.max_candidates)
  kernel = functools.partial(_bound_kernel, splits=plan.num_splits,
                             segments=stats.segment_max.shape[1],
                             capacity=config.max_candidates,
                             top_width=top_width, interpret=plan.interpret)
  f32, i32 = (jax.ShapeDtypeStruct((batch,), d) for d in (jnp.float32,
                                                          jnp.int32))
  table = pack_param_table(params)
  (row_max, safe_max, mass, finite, t1, bound, listed, listed_count, narrow,
   gather, large, *narrow_pass) = common.pallas_call(
       kernel,
       out_shape=[f32, f32, f32, i32, f32, f32,
                  jax.ShapeDtypeStruct((batch, _LIST_CAP), jnp.int32), i32,
                  i32, i32, i32] + [f32, jax.ShapeDtypeStruct(
                      table.shape, table.dtype)] * bool(top_width),
       grid=(batch,),
       compiler_params=tuned.bounds.compiler_params(),
       interpret=plan.interpret, name="jaxsample_row_bounds")(
           table, stats.top, stats.sumexp, stats.finite, stats.segment_max,
           stats.sample)
  return RowBounds(row_max, safe_max, mass, row_max + jnp.log(mass), finite,
                   t1, bound, *(narrow_pass or (bound, table)), listed,
                   listed_count, narrow, gather, large, stats)


def _estimate_reaching(threshold, row, width: int, interpret: bool, t,
                       sampled, sample_ref):
  """``SAMPLE_STRIDE`` times the number of the row's sample values, tempered
  by ``t``, reaching ``threshold`` (0 on rows not ``sampled``)."""
  lanes = jnp.arange(pow2_ceil(width), dtype=jnp.int32)
  use = (lanes < width) & sampled
  x = plgpu.load(sample_ref.at[row, jnp.where(use, lanes, 0)], mask=use,
                 other=-jnp.inf)
  y = common.KernelMath(interpret).temper(sanitize(x), t)
  return SAMPLE_STRIDE * common.count(use & (y >= threshold))


def _list_reaching(y, threshold, row, cap: int, listed_ref):
  """Writes the indices ``i`` (ascending, the first ``cap``) with ``y_i >=
  threshold`` less twice the candidate filter's slack, and returns their
  number: the segments that may hold candidates of the compact pass's
  filter."""
  reach = jnp.where(threshold > -jnp.inf,
                    threshold - 2 * FILTER_SLACK * jnp.abs(threshold),
                    -jnp.inf)
  flag = common.indicator(y >= reach)
  position = jnp.cumsum(flag, dtype=jnp.int32) - flag
  plgpu.store(listed_ref.at[row, position],
              jnp.arange(y.shape[0], dtype=jnp.int32),
              mask=(flag != 0) & (position < cap))
  return jnp.sum(flag, dtype=jnp.int32)
