"""Backend ``"pallas"``: the routing of the Pallas kernels (``jaxsample._src.
pallas``), which rows take which kernels, and the masks of their kept sets.
The kernels and their thin wrappers stay in ``pallas/``; every cond over
the batch and every choice of route is here."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxsample._src import rng, rowwise, sampling_mask, tuning
from jaxsample._src.pallas import common, gumbel, spec, threshold
from jaxsample._src.pallas.bitmask import MaskedLogits
from jaxsample._src.params import SamplerConfig, SamplingParams
from jaxsample._src.processors import LogitsProcessors, maybe_apply
from jaxsample._src.reference import SampleResult
from jaxsample._src.sampling_mask import SamplingMask
from jaxsample._src.spec_reference import per_row_params, stream_keys

__all__ = ["extract_rows", "joint_kept_sets", "kept_floors", "kept_set_masks",
           "kept_sets", "KeptSetQuery", "process_logits", "race_vocab_shard",
           "sample_rows",
           "untruncated_facts", "verify_rows", "with_mask"]


def process_logits(logits: jax.Array,
                   processors: LogitsProcessors | None,
                   config: SamplerConfig):
  """The rows the kernels read: ``MaskedLogits`` where
  ``config.kernel_bitmask`` is on and the bitmask is the only processor
  that changes logits (a non-empty batch: the kernels read the bitmask in
  their passes); otherwise
  ``processors.maybe_apply``'s XLA pre-pass (or ``logits`` as they are)."""
  if (processors is not None and config.kernel_bitmask and isinstance(
      processors, LogitsProcessors) and
      _bitmask_only(processors) and jnp.ndim(logits) == 2 and
      jnp.shape(logits)[0]):
    processors.check(*jnp.shape(logits))
    return MaskedLogits(jnp.asarray(logits),
                        jnp.asarray(processors.bitmask).astype(jnp.int32))
  return maybe_apply(logits, processors)


def sample_rows(logits, params: SamplingParams, streams: rng.RowStreams,
                config: SamplerConfig, return_mask: bool):
  """``sample``'s ``(SampleResult, mask or None)`` on the kernels.

  A batch without truncating rows runs the Gumbel kernel alone.  Otherwise
  each row takes its route, and every route's kernels skip the rows of the
  others: the truncation kernels (``jaxsample._src.pallas.threshold``)
  sample the truncating rows; the Gumbel kernel rows with no filter (greedy rows
  included) and invalid rows; and one branch, taken only when some row
  needs it (``lax.cond``), rows with large kept sets or overflowed
  candidate buffers (``threshold.sample_large``, with their masks; inside
  it only the mask listing's fallback conds).
  Where the caller's ``jit`` closes over the params, a batch without
  truncating rows compiles the Gumbel route alone (``rowwise.cond``);
  traced params run every route rather than a cond on the batch.  A
  ``lax.cond`` costs every step the trip of its predicate (6-10 us of a
  decode loop's step on an H100, ``scripts/measure_host_gaps.py`` at
  d785b4c): less than running the large-set route idle; a cond on the
  batch would save steps without filters about what it would cost
  filtered ones (``benchmarks/results/2026-11-24-idle-skips``).

  The FP64 path finds every kept set's threshold (``kept_sets``;
  with a mask, also the kept ids by probability) and races the kept set with
  FP64 noise (one more pass, which also counts the set and sums its mass).
  No path sorts the vocabulary.
  """
  # 1. processors: applied by ``process_logits``.
  # 2. parameters: which rows truncate (known while tracing for concrete
  #    params) and the mask's width.
  with jax.ensure_compile_time_eval():  # known for concrete params
    truncating = params.truncates() & (params.temperature > 0)
    any_truncating = jnp.any(truncating)
  width = config.max_mask_ids if return_mask else 0
  untruncated_rows = functools.partial(_untruncated_rows, logits, params,
                                       streams, config, width)

  def floored_fp64_batch():
    """FP64 noise: the kept sets (with their ids by probability, for the
    mask), then one FP64 race per row, which also counts the kept set and
    sums its mass."""
    # 3. kept sets
    sets = kept_sets(logits, params, config, order_width=width)
    floor = sets.threshold
    floored = floor > -jnp.inf  # a threshold of -inf keeps every finite y
    # 4. race
    result, count, log_kept = threshold.floored_race(
        logits, params, streams, config, floored, floor, sets.row_max)
    return _choose(floored, (result, _kept_facts(
        count, log_kept, sets.ordered_ids, sets, width)),
                   untruncated_rows(~floored), width)

  def any_batch():
    """Every row, by its route (rows skip the kernels of other routes)."""
    # 3. + 4. kept sets and race: the truncation kernels, then the large
    # kept sets behind their cond.
    trunc, unfinished, large_outputs = _threshold_route(
        logits, params, streams, config, width)
    done = trunc.complete
    rows = (SampleResult(trunc.token, trunc.logprob, done),
            _kept_facts(trunc.count, trunc.log_kept, trunc.ordered_ids, trunc,
                        width))
    # invalid rows: the argmax, as without a filter
    plain = ~truncating | ~jnp.isfinite(trunc.row_max)
    token, logprob, _, _, count, log_kept, *ordered = large_outputs
    large = (SampleResult(token, logprob, unfinished),
             _kept_facts(count, log_kept, ordered[0] if ordered else None,
                         trunc, width))
    return _choose(done, rows, _choose(unfinished, large,
                                       untruncated_rows(plain), width), width)

  # Params known while tracing (closed over by the caller's jit) compile
  # one route; otherwise every route's kernels run, skipping the rows of
  # other routes, rather than a cond on the batch (the FP64 path: a cond).
  if config.use_fp64_gumbel:
    routes = rowwise.cond(any_truncating, floored_fp64_batch,
                          untruncated_rows)
  else:
    routes = rowwise.cond(any_truncating, any_batch, untruncated_rows,
                          unknown=any_batch)
  # 5. outputs: the mask assembled once from the routes' facts.
  return with_mask(*routes, params, width)


def extract_rows(logits, params: SamplingParams,
                 config: SamplerConfig) -> SamplingMask:
  """``extract_sampling_mask`` on the kernels: the kept sets with their ids
  by probability and every set measured (``kept_sets``), then
  ``kept_set_masks``; no race.  Params known while tracing to truncate no
  row compile the Gumbel kernel alone (as ``sample``)."""
  # 1. processors: applied by ``process_logits``.
  # 2. parameters: whether any row truncates (known for concrete params).
  with jax.ensure_compile_time_eval():  # known for concrete params
    truncating = jnp.any(params.truncates() & (params.temperature > 0))
  width = config.max_mask_ids
  # 3. kept sets
  kept = lambda: kept_sets(logits, params, config, order_width=width,
                           measure_all=True)
  sets = rowwise.cond(truncating, kept, lambda: threshold.untruncated_sets(
      logits.shape[:1], width), unknown=kept)
  # 5. outputs (no race)
  return kept_set_masks(logits, params, sets, config)


def verify_rows(target_logits, draft_tokens, n, params: SamplingParams, key,
                positions, draft_logits, synthetic_rates,
                config: SamplerConfig, return_mask: bool):
  """``rejection_sample`` on the fused kernels (``jaxsample._src.pallas.
  spec``), after the threshold kernels' kept sets (``kept_floors``) in a
  batch where some sampled request truncates: ``(SpecResult, the target
  rows' masks or None)``."""
  # 1. processors: applied by ``rejection_sample`` (every target and draft
  #    row).
  # 2. parameters: which requests truncate, the draft tokens clipped, the
  #    streams' keys.
  batch, k1, vocab = target_logits.shape
  with jax.ensure_compile_time_eval():  # known for concrete params
    truncating = jnp.any(params.truncates() & (params.temperature > 0))
  noise_keys, accept_keys = stream_keys(key, batch)
  d = jnp.clip(draft_tokens, 0, vocab - 1).astype(jnp.int32)
  width = config.max_mask_ids if return_mask else 0

  def floored():
    # 3. kept sets
    floors = kept_floors(target_logits, draft_logits, n, params, config,
                         order_width=width)
    return fused(floors), dataclasses.replace(
        floors.target, ordered_ids=floors.target_ids) if width else None

  # 4. race: acceptance, then the emitted token's race.
  fused = lambda floors: spec.reject(
      target_logits, d, n, params, noise_keys, accept_keys,
      positions.astype(jnp.uint32), draft_logits, synthetic_rates, config,
      floors)
  # With traced params a lax.cond (its predicate's trip on every call):
  # the threshold kernels of an untruncated batch would cost more, idle
  # (scripts/measure_host_gaps.py at d785b4c).
  result, sets = rowwise.cond(
      truncating, floored, lambda: (fused(None), threshold.untruncated_sets(
          (batch, k1), width) if width else None))
  # 5. outputs: slots past num_draft are never emitted: greedy, their
  # masks cost an argmax (and are blanked).
  return result, kept_set_masks(
      target_logits.reshape(batch * k1, vocab),
      per_row_params(params, k1, jnp.arange(k1, dtype=jnp.int32) <= n[:, None]),
      jax.tree.map(lambda a: a.reshape((batch * k1,) + a.shape[2:]),
                   sets), config) if width else None


def kept_floors(target_logits, draft_logits, n, params: SamplingParams,
                config: SamplerConfig, *,
                order_width: int = 0) -> spec.KeptFloors:
  """``kept_sets`` of the target rows and the draft rows that the kernels
  may read (target slots ``<= n``, draft slots ``< n``; one cond:
  ``joint_kept_sets``); threshold -inf, not measured, for the
  other rows.  ``order_width``: also the target rows' ids by probability
  (``KeptSets.ordered_ids``, ``[B, k + 1, W]``), and every target kept set
  measured (their masks' counts and masses)."""
  batch, k1, vocab = target_logits.shape

  def query(logits, live, width=0):
    m = live.shape[1]
    rows = per_row_params(params, m, live)  # greedy rows: no floor
    return KeptSetQuery(logits.reshape(batch * m, vocab), rows, width,
                        measure_all=bool(width))

  slots = jnp.arange(k1, dtype=jnp.int32)
  queries = [query(target_logits, slots <= n[:, None], order_width)]
  if draft_logits is not None and k1 > 1:
    queries.append(query(draft_logits, slots[:-1] < n[:, None]))
  # One cond for the large-set routes of both (one predicate's trip).
  target, *draft = [
      jax.tree.map(lambda a, m=q.logits.shape[0] // batch: a.reshape(
          (batch, m) + a.shape[1:]), sets)
      for q, sets in zip(queries, joint_kept_sets(queries, config))]
  return spec.KeptFloors(dataclasses.replace(target, ordered_ids=None),
                            draft[0] if draft else None, target.ordered_ids)


def kept_sets(logits, params: SamplingParams, config: SamplerConfig, *,
              order_width: int = 0,
              measure_all: bool = False) -> threshold.KeptSets:
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


def joint_kept_sets(queries,
                    config: SamplerConfig) -> list[threshold.KeptSets]:
  """``kept_sets`` of each ``KeptSetQuery``, the large-set routes of all
  behind one cond where one asks for ids (one predicate's trip to the host
  on a GPU, where a cond per batch would cost one each)."""
  with jax.enable_x64(False):
    config = dataclasses.replace(config, use_fp64_gumbel=False)
    streams = [rng.RowStreams(*(jnp.zeros((q.logits.shape[0],),
                                          jnp.uint32),) * 4) for q in queries]
    truncs = [threshold.sample_truncated(
        q.logits, q.params, s, config, order_width=q.order_width,
        finish_large=False) for q, s in zip(queries, streams)]
    lefts = [t.unfinished(q.params) for q, t in zip(queries, truncs)]

    def finish_left(q: KeptSetQuery, trunc: threshold.Truncation, left,
                    streams):
      """``left`` rows' ``KeptSets`` (and ids by probability)."""
      width = min(q.order_width, q.logits.shape[1])
      large, listed = threshold.large_thresholds(
          q.logits, q.params, trunc, config, left,
          list_width=width if threshold.listing_width(width, config) else 0)
      if q.measure_all:
        counted = left & ~large.measured
        _, count, log_kept = threshold.floored_race(
            q.logits, q.params, streams, config, counted, large.threshold,
            trunc.row_max)
        large = dataclasses.replace(
            large, measured=large.measured | counted,
            count=jnp.where(counted, count, large.count),
            log_kept=jnp.where(counted, log_kept, large.log_kept))
      return large, threshold.large_kept_ids(
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


def _combine_sets(order_width: int, trunc: threshold.Truncation, left,
                  large: threshold.KeptSets, large_ids) -> threshold.KeptSets:
  """``KeptSets`` of ``trunc``'s complete rows and the ``left`` rows'
  ``large`` sets (``joint_kept_sets``)."""
  floor = jnp.where(trunc.complete, trunc.threshold,
                    jnp.where(left, large.threshold, -jnp.inf))
  sets = threshold.KeptSets(floor, trunc.row_max,
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


# The kernel path's mask is assembled once, from per-row facts:
# ``sampling_mask.assemble``'s keyword arguments but ``valid``, ``greedy``,
# ``token`` (the route's ``SampleResult``) and ``max_ids`` (``width`` =
# K_cap, or 0 without a mask: then the facts are None).


def _threshold_route(logits, params: SamplingParams, streams: rng.RowStreams,
                     config: SamplerConfig, width: int):
  """The threshold kernels' two stages: ``threshold.sample_truncated`` for
  every truncating row, then ``threshold.sample_large`` for the rows it
  leaves unfinished (large kept sets, overflowed buffers), behind the one
  cond (idle, that route's kernels and XLA glue cost more than the cond,
  ``scripts/measure_host_gaps.py`` at d785b4c).
  Returns ``(trunc, unfinished, sample_large's outputs)``."""
  trunc = threshold.sample_truncated(logits, params, streams, config,
                                     order_width=width, finish_large=False)
  unfinished = trunc.unfinished(params)
  large_outputs = rowwise.only_if(unfinished, lambda: threshold.sample_large(
      logits, params, trunc, streams, config, unfinished, order_width=width))
  return trunc, unfinished, large_outputs


def _untruncated_rows(logits, params: SamplingParams, streams: rng.RowStreams,
                      config: SamplerConfig, width: int, active=None):
  """``(SampleResult, facts)`` of ``active`` rows raced with no filter
  (``gumbel.sample_untruncated``): their kept set is every finite entry."""
  result, row_max, lse, *finite = gumbel.sample_untruncated(
      logits, params, streams, config, active=active, count_finite=bool(width))
  return result, untruncated_facts(row_max, lse, finite[0] if width else None,
                                   width)


def untruncated_facts(row_max, lse, finite, width: int):
  """Facts of rows raced with no filter (their kept set is every finite
  entry): ``row_max``, ``lse`` and ``finite`` (the count of entries ``>
  -inf``) ``[B]`` each; None without a mask (``width`` 0).  The kernel
  path's and the vocab-parallel races' (``jaxsample._src.parallel.vocab``)."""
  return dict(
      count=finite, finite=finite, logz=jnp.zeros_like(lse), lse=lse,
      row_max=row_max,
      ordered_ids=jnp.zeros((lse.shape[0], width), jnp.int32)
  ) if width else None


def race_vocab_shard(logits, params: SamplingParams, streams: rng.RowStreams,
                     config: SamplerConfig, *, offset, shards: int, gather,
                     count_finite: bool):
  """``gumbel.sample_untruncated`` of rows whose vocabulary is split into
  ``shards`` equal shards, run on each shard: ``logits`` ``[B, V / shards]``
  are this shard's columns, from global id ``offset``.

  The Gumbel kernel's partials of this shard (on the one-device plan's
  splits where the shard width is a multiple of their length), the logit
  at the shard's winner and, with ``count_finite``, the counts of entries
  ``> -inf`` go through one ``gather(arrays)`` (a list of ``[B, ...]``
  arrays -> each ``[shards, B, ...]`` in shard order, the same on every
  shard), then are finished as one device finishes its splits.

  Returns ``(SampleResult, row_max, lse, finite)`` as ``sample_untruncated``
  (``finite`` None without ``count_finite``).

  Raises:
    ValueError: ``V / shards`` is not a multiple of the plan's RNG tile.
  """
  batch, local = logits.shape
  tuned = tuning.resolve(config.tuning)
  plan = common.race_plan(batch, local * shards, tuned.gumbel,
                          tuned.occupancy, generator=config.rng,
                          fp64=config.use_fp64_gumbel)
  if local % plan.tile:
    raise ValueError(
        f"the kernels need vocab shards of a multiple of {plan.tile} ids (one "
        f"RNG tile); got {local}: pad the vocabulary with -inf logits to a "
        f"multiple of {plan.tile * shards}")
  if not local % plan.split_len:  # the one-device splits, shard by shard
    launch = dataclasses.replace(tuned.gumbel,
                                 num_splits=local // plan.split_len)
    config = dataclasses.replace(config, tuning=dataclasses.replace(
        config.tuning or tuning.Tuning(), gumbel=launch))
  partials = gumbel.gumbel_partials(logits, params.temperature, streams,
                                    config, vocab_offset=offset,
                                    count_finite=count_finite)
  token, _, _ = gumbel.combine_partials(partials)
  x_local = jnp.take_along_axis(logits, (token - offset)[:, None],
                                axis=-1)[:, 0].astype(jnp.float32)
  fields = [partials.race, partials.index, partials.max, partials.sumexp]
  fields += [partials.kept] if count_finite else []
  *gathered, x_shards = gather(fields + [x_local])
  # [n, B, S] -> [B, n S]: splits in id order.
  race, index, top, sumexp, *kept = [
      jnp.moveaxis(g, 0, 1).reshape(batch, -1) for g in gathered]
  whole = gumbel.GumbelPartials(race, index, top, sumexp)
  result, row_max, (shift, log_sum) = gumbel.finish_sampling(
      None, params, whole, logit_at=lambda t: jnp.take_along_axis(
          x_shards, (t // local)[None], axis=0)[0])
  finite = jnp.sum(kept[0], axis=-1) if count_finite else None
  return result, row_max, shift + log_sum, finite


def _kept_facts(count, log_kept, ordered_ids, rows, width: int):
  """Facts of kept sets ``ordered_ids``; ``rows`` (a ``Truncation`` or
  ``KeptSets``) gives each row's ``finite``, ``row_max`` and ``lse``."""
  if not width:
    return None
  return dict(count=count, finite=rows.finite,
              logz=(rows.row_max + log_kept) - rows.lse, lse=rows.lse,
              row_max=rows.row_max, ordered_ids=ordered_ids)


def _choose(where, a, b, width: int):
  """Per row, route ``a``'s or ``b``'s ``(SampleResult, facts)``."""
  if not width:
    return rowwise.where_rows(where, a[0], b[0]), None
  pad = lambda ids: jnp.pad(ids, ((0, 0), (0, width - ids.shape[1])),
                            constant_values=-1)
  a, b = ((r, dict(f, ordered_ids=pad(f["ordered_ids"]))) for r, f in (a, b))
  return rowwise.where_rows(where, a, b)


def with_mask(result, facts, params: SamplingParams, width: int):
  """``(result, mask)``: one ``sampling_mask.assemble`` of ``facts``, or
  ``(result, None)`` without a mask."""
  if not width:
    return result, None
  return result, sampling_mask.assemble(
      valid=result.valid, greedy=params.temperature == 0,
      token=result.tokens, max_ids=width, **facts)


def kept_set_masks(logits, params: SamplingParams, sets,
                   config: SamplerConfig) -> SamplingMask:
  """The masks of ``logits`` ``[B, V]`` under canonical ``params`` from
  their kept sets ``sets``, each measured (``kept_sets(logits,
  params, config, order_width=config.max_mask_ids, measure_all=True)``'s,
  in 32 bits), equal to ``sample``'s (``logz``/``lse`` up to fp32
  rounding).  Rows without a kept set (threshold -inf: greedy, no filter,
  invalid) take the Gumbel kernel.  ``extract_rows``' and ``verify_rows``'
  masks (its ``kept_floors`` found the sets)."""
  width = config.max_mask_ids
  config = dataclasses.replace(config, use_fp64_gumbel=False)
  zeros = jnp.zeros((logits.shape[0],), jnp.uint32)
  streams = rng.RowStreams(*(zeros,) * 4)
  kept = sets.threshold > -jnp.inf
  with jax.enable_x64(False):
    facts = _kept_facts(sets.count, sets.log_kept, sets.ordered_ids, sets,
                        width)
    return with_mask(*_choose(
        kept, (SampleResult(zeros.astype(jnp.int32),
                            jnp.zeros(zeros.shape, jnp.float32), kept), facts),
        _untruncated_rows(logits, params, streams, config, width, ~kept),
        width), params, width)[1]


def _bitmask_only(processors: LogitsProcessors) -> bool:
  """Whether a bitmask is the only processor that changes logits (static;
  histories and counts alone change nothing)."""
  return processors.bitmask is not None and not processors.penalizes and all(
      getattr(processors, name) is None for name in
      ("bias_ids", "allowed_ids", "banned_ids", "min_tokens"))
