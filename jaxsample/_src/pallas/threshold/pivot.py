"""Fixed-pass search: thresholds no buffer holds."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsample._src.pallas import bitmask, common
from jaxsample._src import tuning
from jaxsample._src.pallas.threshold.base import (LOG2E, pack_param_table, pass_plan,
                                             row_params)
from jaxsample._src.pallas.threshold.search import bit_length
from jaxsample._src.params import SamplerConfig, SamplingParams

__all__ = ["pivot_threshold"]


# ---------------------------------------------------------------------------
# Fixed-pass search: thresholds no buffer holds.
# ---------------------------------------------------------------------------

_PIVOT_BITS = 4  # key bits each pass resolves
_PIVOTS = 1 << _PIVOT_BITS  # pivots per pass
_PIVOT_PASSES = 32 // _PIVOT_BITS  # passes that resolve any uint32 key range
_SMALLEST_FINITE_KEY = 0x00800000  # order_key(-FLT_MAX)


def _pivot_kernel(param_ref, active_ref, floor_ref, lower_ref,
                  row_max_ref, x_ref, *refs, plan: common.KernelPlan,
                  vocab: int, by_count: bool, masked: bool):
  """One row's ``pivot_threshold``: up to ``_PIVOT_PASSES`` passes over the
  row by one program, each summing the count (``by_count``) or the mass
  relative to ``row_max`` of the survivors ``y >= floor`` (finite) reaching
  each of ``_PIVOTS`` pivots (fp32 sums; counts stay exact below 2^24).
  Inactive rows write ``lower``.

  Survivors above ``hi`` (every pivot's) reach every pivot: one sum; a tile
  without survivors in ``[pivot 0, hi]`` skips the per-pivot sums.
  ``masked``: a ``bitmask.MaskedLogits`` words ref follows ``x_ref``."""
  words_refs, (threshold_out,) = refs[:masked], refs[masked:]
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
    kmath = common.KernelMath(plan.interpret)
    params, _ = row_params(param_ref, row)
    t, k, p = params.temperature, params.top_k, params.top_p
    lo = jnp.maximum(common.order_key(lower),
                     jnp.uint32(_SMALLEST_FINITE_KEY))
    hi = jnp.maximum(common.order_key(row_max), lo)

    def one_pass(i, state):
      lo, hi, goal = state
      width = hi - lo
      shift = jnp.maximum(bit_length(width) - _PIVOT_BITS, 0).astype(
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
          y = kmath.temper(x.astype(jnp.float32), t)
          survives = (y >= floor) & (y > -jnp.inf)
          weight = jnp.where(survives, jnp.float32(1) if by_count else
                             kmath.exp2_approx((y - row_max) * LOG2E), 0.0)
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
            jnp.max(common.indicator((y >= values[0]) & (inside > 0)))
            for y, inside in parts])
        return total, above, lax.cond(hit > 0, lambda: add(reach),
                                      lambda: reach)

      def search():
        lanes = jnp.zeros((plan.chunk,), jnp.float32)
        # A traced start: Pallas rejects static slices past the row's end.
        total, above, reach = common.tile_loop(
            plan, kmath, row * 0, vocab, bitmask.row_loader(
                x_ref, words_refs, row, plan.chunk), tile_step, (lanes, lanes,
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

    lo, _, _ = common.fori_loop(0, _PIVOT_PASSES, one_pass,
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
  tuned = tuning.resolve(config.tuning)
  plan = pass_plan(batch, vocab, tuned.pivot, tuned.occupancy)
  kernel = functools.partial(
      _pivot_kernel, plan=plan, vocab=vocab, by_count=by_count,
      masked=isinstance(logits, bitmask.MaskedLogits))
  lower = floor if lower is None else lower
  return common.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((batch,), jnp.float32),
      grid=(batch,), compiler_params=plan.compiler_params(),
      interpret=plan.interpret, name="jaxsample_pivot_threshold")(
          pack_param_table(params), active.astype(jnp.int32), floor, lower,
          row_max, *bitmask.operands(logits))
