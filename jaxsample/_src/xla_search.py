"""Sorting-free XLA sampler: the reference's kept sets and tokens without a sort.

``jaxsample._src.reference`` defines the sampler and finds the kept sets by
sorting every row; this backend (``SamplerConfig(implementation=
"xla_search")``, the default off GPU) gives the same kept sets and the same
tokens from ``lax.top_k`` candidates, exactness checks and counting searches.

Per row, with tempered logits ``y`` (``reference.sanitize`` and ``temper``,
-0 read as +0), row max ``m`` and the ``K`` candidates ``c_1 >= ... >= c_K``
of ``lax.top_k(y, K)`` (equal values in id order, as the reference's order;
for fp32 logits without a mask, the top-k of the logits, tempered after:
``x / T`` is monotone in ``x``, so they hold the same values, and one read of
the row finds NaN, which that top-k may rank last):

* a set ``{y >= t}`` lies *inside* the candidates iff ``c_K < t``, ``c_K =
  -inf`` or ``K = V``: every other entry is ``<= c_K``;
* min-p: ``t1 = m + log(min_p)`` (closed form, the reference's expression);
* top-k ``k``: ``t12 = max(t1, c_k)`` for ``k <= K`` (if fewer than ``k``
  entries reach ``t1``, both keep ``{y >= t1}``); for ``k > K``, ``t1`` when
  ``{y >= t1}`` is inside, else a count search (below);
* top-p ``p`` on the survivors ``S = {y >= t12, y > -inf}``: their mass ``Z =
  sum_S exp(y - m)`` (from the candidates when ``S`` is inside, else one pass
  over the row); the first candidate ``c_j`` of ``S`` whose cumulative mass
  reaches ``p * Z`` gives ``t3 = c_j``; if none does, a mass search;
* kept set ``{y >= max(t1, t12, t3), y > -inf}``; ``logsumexp`` over it from
  the candidates when it is inside, else from one pass over the row.

Searches (``reaching_key``) run on the monotone uint32 order keys of ``y``
(``order_keys``): 32 steps, each counting ``#{y >= v}`` or summing the mass
``sum exp(y - m)`` over ``{y >= v}`` of the survivors, one bit of the largest
``v`` that still reaches the goal (``k``, or ``p * Z``) per step: that ``v``
is the reference's threshold.  They, and every pass over the whole row, run
behind a ``lax.cond`` that only a row needing them takes.

Tokens: the Gumbel race over the kept candidates with noise drawn for their
ids alone (``rng.bits_at``, the reference's bits) is the reference's race
when the kept set is inside the candidates, or when no kept entry outside
them can win: ``c_K + G < best`` for ``G`` above any Gumbel value the
generator gives (``GUMBEL_BOUND``; fp32 rounding is monotone).  Other rows
(no filter, large kept sets) race the whole row behind a ``lax.cond``.

A batch where no sampled row truncates (and no ``order`` is asked for)
takes no candidates: a ``lax.switch`` branch (``_untruncated``) reads the
rows for their max, sums their mass in one pass and leaves the race (and
greedy rows' argmax) to the whole rows (on CPU, B = 8, V = 32000: the
reference's plain path's CPU time, half ``jax.random.categorical``'s).

Differences from the reference: sums of mass and ``logsumexp`` run in
another order, so a top-p crossing within fp32 rounding of ``p`` may land on
a neighbouring token, and logprobs and mask ``logz`` differ by a few ulps.
Greedy and invalid rows take no search (their kept sets are a point or
empty whatever the filters): their ``Processed.keep`` is every finite entry.

Sums of mass (``masked_sum``, the candidates' mass) are ``reference.
exact_sum``'s fixed-point sums: the same bits for any batch size and any
split of the vocabulary.

Vocab-sharded callers (``jaxsample._src.parallel.vocab``) pass a ``Split``: every count
and mass over the vocabulary goes through its ``reduce`` hook (e.g.
``lambda a: lax.psum(a, "vocab")`` inside ``shard_map``), so ``reaching_key``
and ``masked_sum`` combine per-shard partials; the candidates of the shards
combine by a ``lax.top_k`` over their concatenation (``join``), and the
whole-row argmax and race fallbacks combine each shard's best.  The result
is the unsplit call's, bit for bit, on every shard.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxsample._src import reference, rng, rowwise
from jaxsample._src.params import SamplingParams
from jaxsample._src.reference import Processed, SampleResult

__all__ = ["CANDIDATE_WIDTHS", "GUMBEL_BOUND", "Search", "Split", "key_value",
           "masked_sum", "order_keys", "process", "reaching_key", "sample",
           "search"]

Reduce = Callable[[jax.Array], jax.Array]

CANDIDATE_WIDTHS = (64, 256, 1024)
"""``lax.top_k`` widths: a batch takes the narrowest that holds its largest
top-k (at least the mask width); wider top-k rows take the count search."""

GUMBEL_BOUND = {jnp.dtype(jnp.float32): 16.0, jnp.dtype(jnp.float64): 37.0}
"""Above every Gumbel value of ``rng.gumbel(rng.uniform(bits))``: the largest
uniforms are ``1 - 2^-23`` and ``1 - 2^-52``, whose noise is ``23 ln 2 =
15.94`` and ``52 ln 2 = 36.04``."""

_TOP = jnp.uint32(0x80000000)


def _identity(a: jax.Array) -> jax.Array:
  return a


def order_keys(y: jax.Array) -> jax.Array:
  """uint32 keys of fp32 ``y`` in value order (``a <= b`` iff ``key(a) <=
  key(b)``, with -0 as +0); every non-NaN value's key is >= 1."""
  bits = lax.bitcast_convert_type(jnp.where(y == 0, 0.0, y), jnp.uint32)
  return jnp.where(bits >= _TOP, ~bits, bits | _TOP)


def key_value(key: jax.Array) -> jax.Array:
  """The fp32 value of an order key; key 0 (below every value) is -inf."""
  bits = jnp.where(key >= _TOP, key ^ _TOP, ~key)
  return jnp.where(key == 0, -jnp.inf, lax.bitcast_convert_type(
      bits, jnp.float32))


def masked_sum(where: jax.Array, values, reduce: Reduce = _identity):
  """``sum_v where[b, v] * values[b, v]`` ``[B]`` over the row's devices
  (``reduce``; ``values`` may be a scalar): counts in int32, float values
  (in [0, 1]: masses) by ``reference.fixed_point_limbs`` (their integer
  digit sums are what ``reduce`` adds), the same bits for any grouping."""
  values = jnp.broadcast_to(values, where.shape)
  if jnp.issubdtype(values.dtype, jnp.integer):
    return reduce(jnp.sum(jnp.where(where, values, 0), axis=-1))
  return reference.limbs_to_float(reduce(reference.fixed_point_limbs(
      jnp.where(where, values, 0.0))))


def reaching_key(keys: jax.Array, weights: jax.Array, goal: jax.Array,
                 reduce: Reduce = _identity) -> jax.Array:
  """Per row, the largest key ``u`` with ``sum_{keys >= u} weights >= goal``
  (``[B]`` uint32; 0 if even all the weight falls short).

  ``keys`` ``[B, V]`` from ``order_keys``, ``weights`` ``[B, V]`` >= 0 (1 to
  count, ``exp(y - m)`` for mass; 0 outside the entries searched).  Sums run
  in one fixed order, so they fall as ``u`` rises and the bit-by-bit search
  (32 passes, one bit per pass, from the top) is exact for them; the result
  is the key of an entry.
  """
  def step(i, found):
    trial = found | (jnp.uint32(1) << jnp.asarray(31 - i, jnp.uint32))
    reached = masked_sum(keys >= trial[:, None], weights, reduce) >= goal
    return jnp.where(reached, trial, found)

  # The first step outside the loop: its result is typed as the loop's
  # (inside shard_map, varying over the axes of the reduced sums).
  return lax.fori_loop(1, 32, step,
                       step(0, jnp.zeros(keys.shape[:1], jnp.uint32)))


def tempered(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """``reference.temper(reference.sanitize(logits), temperature)`` with -0
  as +0 (the reference's sort order has them equal)."""
  y = reference.temper(reference.sanitize(logits), temperature)
  return jnp.where(y == 0, 0.0, y)


@dataclasses.dataclass(frozen=True)
class Split:
  """How each row's vocabulary lies on devices; the default: whole on one.

  Split (``jaxsample._src.parallel.vocab``): this device holds the row's columns from
  global id ``offset`` (traced); ``vocab`` is the row's global size;
  ``reduce`` adds per-device ``[B, ...]`` partials (a ``psum``); ``join``
  concatenates per-device ``[B, W]`` arrays along the last axis in id order
  (an all-gather).
  """

  vocab: int | None = None
  offset: jax.Array | int = 0
  reduce: Reduce = _identity
  join: Reduce = _identity

  def global_vocab(self, local: int) -> int:
    return self.vocab or local

  def first_id(self):
    """``rng.gumbel_noise``'s ``first_id``: None on one device."""
    return None if self.vocab is None else self.offset

  def top(self, operand: jax.Array, width: int):
    """``lax.top_k(row, width)`` of the whole rows: ``(values, global
    ids)``, equal values in id order."""
    vals, ids = lax.top_k(operand, min(width, operand.shape[-1]))
    if self.vocab is None:
      return vals, ids
    vals, ids = self.join(vals), self.join(ids + self.offset)
    # Sorted again even uncut (width >= V): the join lists shard by shard.
    # The shards are in id order, so ties stay so.
    vals, at = lax.top_k(vals, min(width, vals.shape[-1]))
    return vals, jnp.take_along_axis(ids, at, axis=-1)

  def argmax(self, values: jax.Array) -> jax.Array:
    """int32 global id of each row's first largest value (no NaN)."""
    local = jnp.argmax(values, axis=-1).astype(jnp.int32)
    if self.vocab is None:
      return local
    best = self.join(jnp.max(values, axis=-1, keepdims=True))
    ids = self.join(local[:, None] + self.offset)
    return jnp.min(jnp.where(best == jnp.max(best, axis=-1, keepdims=True),
                             ids, self.vocab), axis=-1)

  def take(self, values: jax.Array, ids: jax.Array) -> jax.Array:
    """``values[b, ids[b]]`` for global ``ids`` ``[B]`` in range (moved
    unchanged from the device holding it)."""
    if self.vocab is None:
      return jnp.take_along_axis(values, ids[:, None], axis=-1)[:, 0]
    local = values.shape[-1]
    at = jnp.clip(ids - self.offset, 0, local - 1)
    mine = jnp.take_along_axis(values, at[:, None], axis=-1)
    return jnp.take_along_axis(self.join(mine), (ids // local)[:, None],
                               axis=-1)[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Search:
  """A batch's kept sets, found without a sort.

  ``logits`` ``[B, V]`` and ``temperature`` ``[B]`` as given (``y()``: the
  tempered logits, computed where used); ``row_max = max(y)`` (valid iff
  finite); ``threshold``: kept set ``{y >= threshold, y > -inf}`` (-inf on
  rows without a filter, greedy and invalid rows); ``logsumexp_K(y) = shift
  + log_sum`` on sampled valid rows; ``order`` ``[B, W]`` the first ids by
  descending ``y``, smallest id first among equal values
  (``reference.top_ids``); ``first`` ``[B]`` the smallest id of the largest
  value among the candidates (``argmax(y)`` on valid rows unless
  ``first_unsure``: the candidates are all that value); ``token`` the
  Gumbel-max over the kept candidates and ``decided`` whether it is the
  reference's token (both ``[B]``, only with noise).
  """

  logits: jax.Array
  temperature: jax.Array
  row_max: jax.Array
  threshold: jax.Array
  shift: jax.Array
  log_sum: jax.Array
  order: jax.Array
  first: jax.Array
  first_unsure: jax.Array
  token: jax.Array | None = None
  decided: jax.Array | None = None

  def y(self) -> jax.Array:
    return tempered(self.logits, self.temperature)

  def processed(self) -> Processed:
    """``reference.process``'s result for these kept sets."""
    y = self.y()
    keep = (y >= self.threshold[:, None]) & (y > -jnp.inf)
    return Processed(reference.sanitize(self.logits), y, keep, self.row_max,
                     self.shift, self.log_sum, self.order)


def _where_needed(needed: jax.Array, compute, default: jax.Array):
  """``compute()`` on the rows of ``needed``, ``default`` on the others; the
  computation runs only when some row needs it."""
  found = rowwise.cond(jnp.any(needed), compute, lambda: default)
  return jnp.where(needed, found, default)


def _candidate_search(logits, params: SamplingParams, width: int,
                      order_width: int, noise_at, split: Split):
  """The kept sets (module doc) from ``width`` candidates: ``(row_max,
  threshold, log_sum, order, first, first_unsure, token, decided)`` (the
  last two None without ``noise_at``).  The candidates are the top-k of
  the tempered logits, or of fp32 logits themselves without ``order`` (``x
  / T`` is monotone, so their top-k holds the top-k values of ``y``; ties
  may list other ids), then with a pass that finds NaN rows (their NaN may
  rank anywhere).  Sampled valid rows with a filter take it, sampled valid
  rows get ``log_sum`` and a token.  Passes over the row compute
  ``y`` where they run (inside their conds); sums over the row go through
  ``split.reduce``."""
  vocab = split.global_vocab(logits.shape[-1])
  reduce = split.reduce
  if logits.dtype == jnp.float32 and not order_width:
    # The top-k of the logits: no pass writes the tempered row; one reads
    # it for NaN.
    operand = logits
    nan_rows = reduce(jnp.sum(jnp.isnan(logits), axis=-1,
                              dtype=jnp.int32)) > 0
  else:
    operand, nan_rows = tempered(logits, params.temperature), None
  # The barrier keeps XLA:CPU's top-k a TopK call: folding the uses of its
  # slice of a sort into gathers would leave a full sort of every row.
  vals, ids = rowwise.barrier(split.top(operand, width))
  if nan_rows is not None:
    vals = tempered(vals, params.temperature)
  else:
    nan_rows = False
  row_max = jnp.where(nan_rows, jnp.inf, vals[:, 0])
  valid = jnp.isfinite(row_max)
  sampled = valid & (params.temperature > 0)
  active = sampled & params.truncates()
  head = (row_max,)
  row_max = jnp.where(valid, row_max, 0.0)
  last = vals[:, -1]
  inside = lambda t: (width >= vocab) | (last < t) | (last == -jnp.inf)
  y = lambda: tempered(logits, params.temperature)
  mass = lambda: jnp.exp(y() - row_max[:, None])
  above = lambda t: (y() > -jnp.inf) & (y() >= t[:, None])
  search_keys = lambda weights, goal: key_value(
      reaching_key(order_keys(y()), weights, goal, reduce))

  t1 = jnp.where(params.min_p > 0, row_max + jnp.log(params.min_p), -jnp.inf)
  k = params.top_k
  kth = jnp.take_along_axis(vals, jnp.clip(k - 1, 0, width - 1)[:, None],
                            axis=-1)[:, 0]
  t12 = _where_needed(
      active & (k > width) & ~inside(t1),
      lambda: jnp.maximum(t1, search_keys(above(t1).astype(jnp.int32), k)),
      jnp.where((k > 0) & (k <= width), jnp.maximum(t1, kth), t1))

  top_p = active & (params.top_p < 1)
  candidate_mass = jnp.where((vals > -jnp.inf) & (vals >= t12[:, None]),
                             jnp.exp(vals - row_max[:, None]), 0.0)
  cumulative = jnp.cumsum(candidate_mass, axis=-1)
  total = _where_needed(top_p & ~inside(t12),
                        lambda: masked_sum(above(t12), mass(), reduce),
                        reference.exact_sum(candidate_mass))
  goal = params.top_p * total
  reached = cumulative >= goal[:, None]
  t3 = _where_needed(
      top_p & ~reached[:, -1],
      lambda: search_keys(jnp.where(above(t12), mass(), 0.0), goal),
      jnp.take_along_axis(vals, jnp.argmax(reached, axis=-1)[:, None],
                          axis=-1)[:, 0])
  threshold = jnp.where(
      active, jnp.maximum(t12, jnp.where(top_p, t3, -jnp.inf)), -jnp.inf)

  kept = (vals > -jnp.inf) & (vals >= threshold[:, None])
  kept_inside = inside(threshold)
  log_sum = jnp.log(_where_needed(
      sampled & ~kept_inside, lambda: masked_sum(above(threshold), mass(),
                                                 reduce),
      reference.exact_sum(jnp.where(kept, jnp.exp(vals - row_max[:, None]),
                                    0.0))))
  top = vals == vals[:, :1]
  head += (threshold, log_sum, ids[:, :order_width],
           jnp.min(jnp.where(top, ids, vocab), axis=-1),
           top[:, -1] & (width < vocab))
  if noise_at is None:
    return head + (None, None)
  noise = noise_at(ids)
  race = jnp.where(kept, vals.astype(noise.dtype) + noise, -jnp.inf)
  best = jnp.max(race, axis=-1)
  token = jnp.min(jnp.where(race == best[:, None], ids, vocab), axis=-1)
  bound = last.astype(noise.dtype) + GUMBEL_BOUND[noise.dtype]
  return head + (token, kept_inside | (best > bound))


def _untruncated(logits, params: SamplingParams, noise_at, split: Split):
  """``_candidate_search``'s result (``order`` 0 wide) for a batch where no
  sampled row truncates (kept sets: every finite entry), from passes over
  the rows instead of candidates: the max of ``y`` and its mass; no
  ``first`` (``first_unsure``: ``sample`` takes the argmax of greedy rows)
  and, with ``noise_at``, no token (``decided`` False: ``sample`` races the
  whole rows)."""
  batch = logits.shape[0]
  y = tempered(logits, params.temperature)
  row_max = jnp.max(split.join(jnp.max(y, axis=-1, keepdims=True)), axis=-1)
  shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  log_sum = jnp.log(masked_sum(y > -jnp.inf, jnp.exp(y - shift[:, None]),
                               split.reduce))
  none = jnp.zeros((batch,), jnp.int32)
  head = (row_max, jnp.full((batch,), -jnp.inf, jnp.float32), log_sum,
          jnp.zeros((batch, 0), jnp.int32), none, jnp.ones((batch,), bool))
  if noise_at is None:
    return head + (None, None)
  return head + (none, jnp.zeros((batch,), bool))


def search(logits: jax.Array, params: SamplingParams, *, order_width: int = 0,
           noise_at=None, split: Split = Split()) -> Search:
  """The kept sets of ``logits`` ``[B, V]`` (``B >= 1``) under canonical
  ``params``, the reference's (module doc), with ``order`` ``min(
  order_width, V)`` wide.

  ``noise_at(ids)``: the Gumbel noise of ``ids`` ``[B, W]`` (the reference's
  for those ids) to race the kept candidates.  ``split``: how the rows lie
  on devices (module doc; ``logits`` is then this device's columns).
  A batch where no sampled row truncates and no ``order`` is asked for
  takes no candidates (``_untruncated``).
  """
  vocab = split.global_vocab(logits.shape[-1])
  order_width = min(order_width, vocab)
  widths = sorted({min(max(w, order_width), vocab) for w in CANDIDATE_WIDTHS})
  branches = [functools.partial(
      _candidate_search, logits, params, width=w,
      order_width=order_width, noise_at=noise_at, split=split)
              for w in widths]
  with jax.ensure_compile_time_eval():  # known for concrete params
    truncating = (params.temperature > 0) & params.truncates()
    top_k = truncating & (params.top_k <= widths[-1])
    branch = jnp.sum(jnp.max(jnp.where(top_k, params.top_k, 0)) >
                     jnp.asarray(widths[:-1], jnp.int32))
    # Inside jax.shard_map the branch crashes XLA:CPU's SPMD partitioner
    # (jax 0.11.2, a segmentation fault in its Shardy export): not taken.
    if not order_width and not jax.sharding.get_abstract_mesh().manual_axes:
      branches.insert(0, functools.partial(_untruncated, logits, params,
                                           noise_at, split))
      branch = jnp.where(jnp.any(truncating), branch + 1, 0)
  row_max, threshold, log_sum, *rest = rowwise.switch(branch, branches)
  return Search(logits, params.temperature, row_max, threshold, jnp.where(
      jnp.isfinite(row_max), row_max, 0.0), log_sum, *rest)


def process(logits: jax.Array, params: SamplingParams, *,
            order_width: int = 0, split: Split = Split()) -> Processed:
  """``reference.process`` without a sort (``B >= 1``, canonical params):
  the same kept sets on sampled rows (module doc); with a ``split``, this
  device's columns of them."""
  return search(logits, params, order_width=order_width,
                split=split).processed()


def sample(logits: jax.Array, params: SamplingParams,
           streams: rng.RowStreams, *, generator: str, fp64: bool = False,
           order_width: int = 0,
           split: Split = Split()) -> tuple[SampleResult, Processed]:
  """``reference.sample_reference`` without a sort (``B >= 1``, canonical
  params): the same tokens, and the ``Processed`` rows for a mask (this
  device's columns with a ``split``).

  Rows whose candidate race is not the reference's (``Search.decided``) race
  the whole row, behind a cond that only such rows take.
  """
  local = logits.shape[-1]
  columns = jax.tree.map(lambda a: a[:, None], streams)
  noise_at = lambda ids: rng.gumbel(rng.uniform(rng.bits_at(
      generator, columns, ids, wide=fp64)))
  found = search(logits, params, order_width=order_width, noise_at=noise_at,
                 split=split)
  valid = jnp.isfinite(found.row_max)
  greedy = params.temperature == 0
  # invalid rows: the first NaN, +inf or overflow; greedy rows: argmax
  tokens = _where_needed(
      ~valid | (greedy & found.first_unsure),
      lambda: split.argmax(found.y()),
      jnp.where(greedy, found.first, found.token))
  tokens = _where_needed(
      valid & ~greedy & ~found.decided, lambda: reference.race_tokens(
          found.processed(), params, rng.gumbel_noise(
              generator, streams, local, fp64=fp64,
              first_id=split.first_id()), argmax=split.argmax), tokens)
  x_token = reference.sanitize(split.take(logits, tokens))
  return reference.finalize(x_token, params, tokens,
                            (found.shift, found.log_sum),
                            found.row_max), found.processed()
