"""Large kept sets: a window around the threshold, from a sample."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxsample._src.pallas import common
from jaxsample._src import tuning
from jaxsample._src.pallas.threshold.base import (SAMPLE_STRIDE, pack_param_table,
                                             pow2_ceil, row_params, sanitize)
from jaxsample._src.pallas.threshold.search import (BOUND_KEY_BITS, NEG_INF_KEY,
                                               count_reaches, largest_key,
                                               largest_keys)
from jaxsample._src.params import SamplingParams

__all__ = ["threshold_window", "TOP_K_WINDOW_BUFFERS", "WINDOW_BUFFERS",
           "window_half"]


# ---------------------------------------------------------------------------
# Large kept sets: a window around the threshold, from a sample.
# ---------------------------------------------------------------------------

# The window's buffer, in candidate buffers.  A top-p estimate from the
# sample's mass is tight; the top-k estimate ``k / SAMPLE_STRIDE`` misses
# the ``k``-th largest by about ``sqrt(SAMPLE_STRIDE * V / 4)`` elements (one
# standard deviation, at k = V / 2), so its window is twice as wide: with
# V = 151936, 5 standard deviations (a simulation of 2000 random-normal rows
# missed 0.8% of them at 8 buffers).
WINDOW_BUFFERS = 8
TOP_K_WINDOW_BUFFERS = 16


def window_half(capacity: int) -> int:
  return max(1, capacity * 11 // (16 * 2 * SAMPLE_STRIDE))


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
    lanes = jnp.arange(pow2_ceil(width), dtype=jnp.int32)
    x = plgpu.load(sample_ref.at[row, jnp.where(lanes < width, lanes, 0)],
                   mask=lanes < width, other=-jnp.inf)
    params, _ = row_params(param_ref, row)
    y = common.KernelMath(interpret).temper(sanitize(x), params.temperature)
    t1 = t1_ref[row]
    finite = y > -jnp.inf
    survives = finite & (y >= t1)
    key = common.order_key(y)
    if by_count:
      rank = params.top_k // SAMPLE_STRIDE
    else:
      p = params.top_p
      e = jnp.where(finite, jnp.exp(y - row_max_ref[row]),
                    0.0) * SAMPLE_STRIDE
      # The mass below the threshold is (1 - p) of the survivors' mass, made
      # of many small terms: the sample estimates it well.
      below_t1 = jnp.sum(jnp.where(finite & ~survives, e, 0.0))
      target = (1 - p) * mass_ref[row] + p * below_t1
      threshold_key = largest_key(
          lambda v: jnp.sum(jnp.where(key < v, e, 0.0)) <= target,
          BOUND_KEY_BITS)
      rank = common.count(survives & (key >= threshold_key))

    # The (rank - half)-th and (rank + half)-th largest survivors (rounded
    # down; -inf if none), and the listing's, searched together.
    ranks = (rank - half, rank + half) + (
        (list_rank + list_half,) if list_half else ())
    found = largest_keys(tuple(count_reaches(key, survives, n)
                               for n in ranks), BOUND_KEY_BITS)
    ranked = [jnp.where(f > NEG_INF_KEY, common.key_value(f), -jnp.inf)
              for f in found]
    # The upper end rounds up (the search's next key): rounded down, it
    # could leave its rank's tie group above the window, and a threshold
    # there to the pivot search (bf16 rows: groups of ~1000 equal values).
    upper = jnp.where(
        rank <= half, jnp.inf,
        jnp.where(found[0] > NEG_INF_KEY, common.key_value(
            found[0] + jnp.uint32(1 << (32 - BOUND_KEY_BITS))), -jnp.inf))
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
                     list_capacity: int = 0,
                     launch: tuning.WindowLaunch | None = None):
  """``(lower, upper)`` ``[B]`` of the ``active`` rows (others undefined):
  a window that likely holds the threshold
  (``by_count``: the ``k``-th largest min-p survivor; else top-p's, on the
  min-p survivors ``y >= t1``) and fewer than ``capacity`` elements (the
  caller checks both), from the rows' ``sample`` (``RowBounds.sample``,
  tempered here by ``params.temperature`` as the kernels temper logits).
  ``mass``: the row's mass relative to ``row_max``.  Two or three searches of
  ``BOUND_KEY_BITS`` block reductions over the sample.

  With ``list_rows``, also ``list_lower`` ``[B]`` of those rows (a
  ``Listing``'s lower end, ``_listing_capacity(list_width)`` slots): the
  lower end of the by-count window of ``k = list_width`` (whose upper end
  is ``inf``: ``route.listing_width``), found in the last search at no extra
  pass; ``t1`` must be the rows' min-p threshold.  ``launch``: its compiler
  parameters (default: the device's ``tuning.WindowLaunch``)."""
  launch = launch or tuning.resolve().window
  batch = sample.shape[0]
  listing = list_rows is not None
  rows = active | list_rows if listing else active
  kernel = functools.partial(
      _window_kernel, half=window_half(capacity), by_count=by_count,
      list_rank=list_width // SAMPLE_STRIDE,
      list_half=window_half(list_capacity) if listing else 0,
      interpret=interpret)
  shape = jax.ShapeDtypeStruct((batch,), jnp.float32)
  return common.pallas_call(
      kernel, out_shape=[shape] * (2 + listing), grid=(batch,),
      compiler_params=launch.compiler_params(),
      interpret=interpret, name="jaxsample_threshold_window")(
          pack_param_table(params), sample, row_max, t1, mass,
          rows.astype(jnp.int32))
