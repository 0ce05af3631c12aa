"""Shared by every stage of the truncated sampler: the pass plan, the param
table, and the constants the stages agree on."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsample._src import rowwise
from jaxsample._src.pallas import common
from jaxsample._src import tuning
from jaxsample._src.params import SamplingParams

__all__ = ["FILTER_SLACK", "LOG2E", "ONE_BITS", "pack_param_table", "pass_plan",
           "pow2_ceil", "row_params", "SAMPLE_STRIDE", "sanitize",
           "segment_size", "TOP_K_FIELD", "TOP_P_FIELD"]

LOG2E = 1.4426950408889634
# |x * (1 / T) - x / T| <= 2 ulp: the filter widens the candidate test by this.
FILTER_SLACK = 2.0**-21
_SEGMENTS_PER_ROW = 2048  # segment maxima per row (about), before padding
_MIN_SEGMENT = 16


def pass_plan(batch: int, vocab: int, launch: tuning.PassLaunch |
              tuning.PivotLaunch,
              occupancy: tuning.Occupancy) -> common.KernelPlan:
  """The plan of a pass over the row (``tuning.PassLaunch``).  A chunk holds
  whole groups of the sample's stride.  Interpret mode (CPU) walks one chunk per step: the tile only
  schedules the loads (the results do not depend on it beyond fp32
  summation order), and interpreting it would multiply the compiled loop
  body."""
  chunk = max(launch.block_size, SAMPLE_STRIDE)
  plan = common.make_plan(
      batch, vocab, chunk=chunk, tile=chunk, num_warps=launch.num_warps,
      num_splits=launch.num_splits,
      num_stages=launch.num_stages, occupancy=occupancy)
  per_step = launch.chunks_per_step
  if per_step == 1 or plan.interpret:
    return plan
  tiles = -(-vocab // (plan.chunk * per_step))
  splits = min(plan.num_splits, tiles)
  steps = -(-tiles // splits)
  return dataclasses.replace(plan, tile=plan.chunk * per_step,
                             num_splits=-(-tiles // steps), steps=steps)


def sanitize(x):
  x = x.astype(jnp.float32)
  return jnp.where(x != x, jnp.inf, x)


def segment_size(vocab: int, chunk: int) -> int:
  """Ids per segment: about ``_SEGMENTS_PER_ROW`` segments per row, a power of
  2 between ``_MIN_SEGMENT`` and the chunk."""
  return min(chunk, max(_MIN_SEGMENT, pow2_ceil(-(-vocab // _SEGMENTS_PER_ROW))))


_PARAM_DTYPES = (jnp.float32, jnp.int32, jnp.float32, jnp.float32,
                 jnp.float32)
TOP_K_FIELD, TOP_P_FIELD = 1, 2  # rows of a pack_param_table
ONE_BITS = 0x3F800000  # fp32 1.0 as int32: a param table's top-p off


def pack_param_table(params: SamplingParams | jax.Array) -> jax.Array:
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


def row_params(param_ref, row) -> tuple[SamplingParams, jax.Array]:
  """Row ``row``'s ``SamplingParams`` (scalars) and ``log(min_p)``, read in
  a kernel from a ``pack_param_table``."""
  *fields, log_min_p = common.table_row(param_ref, row, _PARAM_DTYPES)
  return SamplingParams(*fields), log_min_p


def pow2_ceil(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


# Every ``SAMPLE_STRIDE``-th element of a row is its sample.  The window
# spans ``2 * half`` sample ranks around the estimate, with ``half`` sized so
# the window's expected count is about 0.7 of its buffer.
SAMPLE_STRIDE = 32
