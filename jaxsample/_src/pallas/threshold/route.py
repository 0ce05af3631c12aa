"""The truncated sampler: the stages in order (the kept sets built on them,
and the choice of route per row: ``jaxsample._src.backends.pallas``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsample._src import reference, rng, rowwise
from jaxsample._src.pallas import bitmask, gumbel
from jaxsample._src import tuning
from jaxsample._src.pallas.threshold.base import SAMPLE_STRIDE
from jaxsample._src.pallas.threshold.stats import StatsPartials, row_bounds
from jaxsample._src.pallas.threshold.select import select_threshold
from jaxsample._src.pallas.threshold.window import (TOP_K_WINDOW_BUFFERS,
                                               WINDOW_BUFFERS,
                                               threshold_window, window_half)
from jaxsample._src.pallas.threshold.candidates import (Candidates, Listing,
                                                   Segments, collect_candidates)
from jaxsample._src.pallas.threshold.pivot import pivot_threshold
from jaxsample._src.params import SamplerConfig, SamplingParams

__all__ = ["floored_race", "KeptSets", "large_kept_ids", "large_thresholds",
           "listing_width", "place_window", "sample_large", "sample_truncated",
           "top_width_params", "Truncation", "untruncated_sets", "window_threshold"]


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
  stats: StatsPartials

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
      order_width=min(order_width, capacity), active=stats.narrow,
      launch=tuning.resolve(config.tuning).select)
  log_kept = reference.holding_token(jnp.log(kept_mass), token_y - safe_max)
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
  none = jnp.full(shape, -jnp.inf, jnp.float32)
  zeros = jnp.zeros(shape, jnp.int32)
  return KeptSets(
      none, none, none, zeros != 0, none, zeros,
      jnp.zeros(shape + (order_width,), jnp.int32) if order_width else None,
      zeros)


def place_window(params: SamplingParams, trunc: Truncation, rows, floor,
                  capacity: int, launch: tuning.WindowLaunch, *,
                  by_count: bool, **listing):
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
      launch=launch, **listing)


def window_threshold(window: Candidates, search: SamplingParams, rows, floor,
                      lower, upper, row_max, capacity: int,
                      launch: tuning.WindowLaunch, *, by_count: bool):
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
      bits=32, launch=launch, active=rows, window=(lower, upper))
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
  ``TOP_K_WINDOW_BUFFERS`` or ``WINDOW_BUFFERS`` candidate buffers)
  ``threshold_window`` places from the row's sample; the kept mass
  ``sum_{y >= threshold} exp(y - row_max)`` and count; ``held``: the window
  held the
  threshold and fit its buffer.  With ``lists`` (rows whose ``floor`` is
  ``t1``), the same window kernel places those rows' ``Listing`` for a mask
  of ``list_width`` ids and the same compact pass fills it: ``listed`` is
  that ``_Listed`` (None without ``lists``)."""
  capacity = config.max_candidates * (
      TOP_K_WINDOW_BUFFERS if by_count else WINDOW_BUFFERS)
  list_capacity = 0 if lists is None else _listing_capacity(list_width,
                                                            config)
  launch = tuning.resolve(config.tuning).window
  search, lower, upper, *list_lower = place_window(
      params, trunc, rows, floor, capacity, launch, by_count=by_count,
      **({} if lists is None else dict(list_rows=lists, list_width=list_width,
                                       list_capacity=list_capacity)))
  listing = list_lower and Listing(lists, list_lower[0], list_capacity)
  found = collect_candidates(logits, params, rows, lower, floor,
                             _safe(trunc.row_max), None, config, upper=upper,
                             capacity=capacity, listing=listing or None)
  window, listed = found if listing else (found, None)
  return (*window_threshold(window, search, rows, floor, lower, upper,
                             trunc.row_max, capacity, launch,
                             by_count=by_count),
          _Listed(listing, listed) if listing else None)


def listing_width(width: int, config: SamplerConfig) -> bool:
  """Whether a mask of ``width`` ids lists large kept sets from a ``Listing``
  (``large_thresholds``): ``width > C / 2`` (narrower masks come from the
  candidate buffer of top-k = ``width``) and within half a window of the top,
  so that the window has no upper end."""
  return (width > config.max_candidates // 2 and width // SAMPLE_STRIDE
          <= window_half(_listing_capacity(width, config)))


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

  ``list_width`` (``listing_width``): the window kernel and compact pass
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


def top_width_params(params: SamplingParams, width: int) -> SamplingParams:
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
      list_width=width if listing_width(width, config) else 0)
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
  return (result, jnp.sum(partials.kept, axis=-1, dtype=jnp.int32),
          (shift - row_max) + log_sum)


def _listing_capacity(width: int, config: SamplerConfig) -> int:
  """Slots of the window that lists a row's ``width`` largest values: the
  fewest (a power of 2, at most the top-k window's) whose window, ``H =
  window_half * SAMPLE_STRIDE`` elements each way, has no upper end at
  rank ``width`` (``H >= width``) and whose lower end, about ``width + H``
  elements down, lies below rank ``width`` by 5 standard deviations of the
  sample's count there (``sqrt(SAMPLE_STRIDE * (width + H))``); the
  expected fill is then at most 0.7."""
  capacity = 16
  while True:
    reach = window_half(capacity) * SAMPLE_STRIDE
    if reach >= width and reach**2 >= 25 * SAMPLE_STRIDE * (width + reach):
      break
    capacity *= 2
  return min(capacity, config.max_candidates * TOP_K_WINDOW_BUFFERS)


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
  top_width = top_width_params(params, width)
  ids = jnp.zeros((logits.shape[0], width), jnp.int32)
  listed_rows = jnp.zeros_like(rows)
  if width <= config.max_candidates // 2:
    ids, listed_rows = trunc.ordered_ids[:, :width], rows & trunc.top_listed
  elif listed is not None:
    window, lower = listed.window, listed.listing.lower
    last, _, _, held = window_threshold(
        window, top_width, listed.listing.rows, trunc.t1, lower,
        jnp.full_like(lower, jnp.inf), trunc.row_max,
        listed.listing.capacity, tuning.resolve(config.tuning).window,
        by_count=True)
    ids = jnp.take_along_axis(window.ids, reference.top_ids(
        window.y, jnp.maximum(last, threshold), width), axis=-1)
    listed_rows = rows & listed.listing.rows & held
  missed = rows & ~listed_rows

  def row_ids():
    last = pivot_threshold(logits, top_width, missed, trunc.t1,
                           _safe(trunc.row_max), config, by_count=True)
    y = reference.temper(reference.sanitize(bitmask.unmasked(logits)), t)
    return reference.top_ids(y, jnp.maximum(last, threshold), width)

  return jnp.where(listed_rows[:, None], ids,
                   rowwise.only_if(missed, row_ids, pack=False))
