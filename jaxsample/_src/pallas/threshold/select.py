"""The exact threshold over a bounded candidate buffer: the select kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxsample._src.pallas import common
from jaxsample._src import tuning
from jaxsample._src.pallas.threshold.base import (pack_param_table, pow2_ceil,
                                             row_params)
from jaxsample._src.pallas.threshold.search import BOUND_KEY_BITS, kept_bound
from jaxsample._src.params import SamplingParams

__all__ = ["select_threshold"]

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
      above = above + common.indicator(alive & (yj > y))
      mass = mass + jnp.where(alive & (yj >= y), ej, 0.0)
      if with_ties:
        ties = ties + common.indicator(alive & (yj == y)
                                       & (j * step + t < lanes))
    return (above, mass, ties), upcoming

  zeros = jnp.zeros((size,), jnp.int32)
  (above, mass, ties), _ = common.fori_loop(
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
  then ``lower`` and ``upper`` if ``has_window``): ``kept_bound``.
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
  params, _ = row_params(param_ref, row)
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
      threshold, k_found = kept_bound(y, row_max, t1, k, p, mass_ref[row],
                                      refs[0][row] if has_above else 0.0, bits,
                                      window)
    else:
      above, mass, ties = _rank(y_ref, row, scan, y, t1, row_max,
                                with_ties=bool(width), step=step)
      k_found = common.count(survives) >= k
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
    count = common.count(kept)
    threshold_ref[row] = threshold
    count_ref[row] = count
    kept_mass_ref[row] = jnp.sum(jnp.where(kept, e, 0.0))
    certified_ref[row] = common.indicator((k <= 0) | k_found)
    if not bound:
      token_ref, token_y_ref, *order_ref = extra_refs
      race = jnp.where(kept, race_ref[row, pl.ds(0, size)], -jnp.inf)
      lanes = jnp.arange(size, dtype=jnp.int32)
      first = lanes == jnp.min(jnp.where(race == jnp.max(race), lanes, size))
      token_ref[row] = jnp.sum(jnp.where(first, ids_ref[row, pl.ds(0, size)],
                                         0), dtype=jnp.int32)
      token_y_ref[row] = jnp.sum(jnp.where(first, y, 0.0))
    if width:  # K fills positions 0 .. count - 1; the rest are -1.
      (order,) = order_ref
      position = above + ties
      plgpu.store(order.at[row, position], ids_ref[row, pl.ds(0, size)],
                  mask=kept & (position < width))
      slots = jnp.arange(pow2_ceil(width), dtype=jnp.int32)
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


def select_threshold(y, row_max, t1, params: SamplingParams | jax.Array,
                     mass, *,
                     bound: bool, interpret: bool, ids=None, race=None,
                     scan=None, order_width: int = 0, above=None,
                     bits: int = BOUND_KEY_BITS,
                     launch: tuning.Launch | None = None, active=None,
                     window=None):
  """Thresholds of ``y`` ``[B, N]`` (N a power of 2, -inf padded), no sort,
  under ``params`` (or their ``pack_param_table``).

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
  bits of ``[lower, upper]``'s (``_bound_thresholds``).  ``launch``: its
  compiler parameters (default: the device's ``tuning.SelectLaunch``).
  """
  launch = launch or tuning.resolve().select
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
  return common.pallas_call(
      kernel, out_shape=out_shape, grid=(batch,),
      compiler_params=launch.compiler_params(),
      interpret=interpret, name="jaxsample_select_threshold")(
          y, row_max, t1, pack_param_table(params), mass,
          *([] if active is None else [active.astype(jnp.int32)]),
          *(([] if above is None else [above]) + list(window or ()) if bound
            else [scan.astype(jnp.int32), ids, race]))
