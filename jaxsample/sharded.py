"""Vocab-parallel sampling: logits split along the vocabulary (tensor parallel).

``sample_sharded`` runs inside ``jax.shard_map`` on one shard ``[B, V / n]``
of the logits (shard ``i`` holds global ids ``[i V / n, (i + 1) V / n)``,
``n`` the size of ``axis_name``).  Each shard races its slice with the noise
of the *global* ids and reduces it to a few values per row; collectives of
``O(B)`` values finish the row, never moving the vocabulary.

Rows without top-k, top-p or min-p (a batch where no sampled row truncates):

1. one all-gather (``_gather_rows``) of each shard's per-row summary: the XLA
   path's race maximum and its id, the max of ``y = x / T`` and its id and
   the logits at both ids; the kernel path's per-split partials
   (``gumbel.GumbelPartials``, a few splits per shard) and the logit at the
   shard's winner.  Every device then picks the same winner: the largest
   race value, the smallest id on ties (shards are in id order), as on one
   device.
2. XLA paths only: one ``psum`` of five int32 per row, the fixed-point digit
   sums of ``exp(y - max y)`` (``reference.fixed_point_limbs``): integer
   sums, so the log-normalizer has the same bits as on one device.

A batch with a truncating row, on the sort-free XLA search
(``implementation="xla_search"``, or ``"auto"`` off GPU): ``xla_search``
with a ``Split`` (``search_split``): each shard's ``lax.top_k`` candidates
all-gathered (``B x W`` values and ids per shard, ``W`` = 64, 256 or 1024)
and cut to the row's top ``W``; counts and mass digit sums of the count and
mass searches ``psum``'d (``B x 5`` int32 per pass, at most 32 passes per
search, only when some row needs one); the whole-row race and argmax
fallbacks all-gather each shard's best.  On ``implementation="xla"`` (the
sort-based reference) and ``"pallas"`` a truncating batch gathers the
vocabulary (``_gather_rows``) and samples it as ``jaxsample.sample`` would:
exact, not parallel.

Exactness: tokens, logprobs and validity equal the single-device ``sample``
(same config, same keys) bit for bit, with every generator (philox,
threefry, FP64 noise), but for the kernel path's logprobs of untruncated
batches: bit for bit when the single-device kernel's vocab splits fall on
shard boundaries (``V / n`` a multiple of its split length; this path then
launches those same splits), else within a few fp32 ulps (partials summed in
another grouping).

``extract_sampling_mask_sharded``: the masks of vocab-sharded logits on the
sort-free search, from the same collectives (only the joined candidates, the
listed ids among them, move).  Not here: speculative verification of
vocab-sharded logits (gather the vocabulary, then call
``spec.rejection_sample``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsample import (dispatch, partition, reference, rng, rowwise, sampling,
                       sampling_mask, xla_search)
from jaxsample.pallas import common, gumbel, tuning
from jaxsample.params import SamplerConfig, SamplingParams, as_config
from jaxsample.reference import SampleResult

__all__ = ["extract_sampling_mask_sharded", "sample_sharded", "search_split"]


def sample_sharded(logits: jax.Array, params: SamplingParams, key: jax.Array,
                   *, axis_name: str, positions: jax.Array | None = None,
                   config: SamplerConfig | str | None = None) -> SampleResult:
  """``jaxsample.sample`` of logits split along the vocabulary over the
  ``jax.shard_map`` axis ``axis_name`` (module doc: the collectives and what
  is exact).

  Args:
    logits: this shard's ``[B, V / n]`` columns, shard ``i`` of ``n`` holding
      global ids from ``i V / n`` (``P(..., axis_name)`` in ``in_specs``).
    params, key, positions, config: as for ``jaxsample.sample``, replicated
      over ``axis_name`` (the batch may be split over other axes: one batch
      key then counts rows globally, as ``sample`` does).

  Returns:
    ``SampleResult`` ``[B]``, the same on every shard of ``axis_name``.
  """
  config = as_config(config)
  logits = jnp.asarray(logits)
  params = dispatch.check_logits(logits, params)
  batch, local = logits.shape
  shards = lax.axis_size(axis_name)
  vocab = local * shards
  offset = lax.axis_index(axis_name) * local
  _, first_row = partition.manual_rows(logits, batch, exclude=axis_name)
  streams, _ = rng.row_streams(key, positions, batch, vocab,
                               first_row=first_row)
  with jax.ensure_compile_time_eval():  # concrete params stay concrete
    params = params.canonical(vocab)
    truncating = jnp.any(params.truncates() & (params.temperature > 0))

  def parallel():
    race = _race_pallas if dispatch.use_pallas(config) else _race_xla
    return race(logits, params, streams, config, offset, axis_name)

  def truncated():
    if dispatch.backend(config) == "xla_search":
      return xla_search.sample(
          logits, params, streams, generator=config.rng,
          fp64=config.use_fp64_gumbel,
          split=search_split(axis_name, vocab, offset))[0]
    whole = _join(logits.astype(jnp.float32), axis_name)
    return sampling.sample_rows(whole, params, streams, config, False)[0]

  with dispatch.x64_scope(config.use_fp64_gumbel, logits, key, positions,
                          *jax.tree.leaves(params)):
    with common.planned_as_shards(
        partition.manual_rows(logits, batch, exclude=axis_name)[0]):
      return rowwise.cond(truncating, truncated, parallel)


def extract_sampling_mask_sharded(
    logits: jax.Array, params: SamplingParams, *, axis_name: str,
    config: SamplerConfig | str | None = None) -> sampling_mask.SamplingMask:
  """``jaxsample.extract_sampling_mask`` of logits split along the
  vocabulary over the ``jax.shard_map`` axis ``axis_name`` (``logits`` and
  ``params`` as for ``sample_sharded``), on the sort-free search
  (``implementation="xla_search"`` or ``"auto"`` off GPU): the search's
  collectives (module doc), the kept ids listed from the joined candidates
  (``config.max_mask_ids`` wide: only they move), counts and digit sums
  ``psum``'d.  Bit-identical to the one-device call; the same on every
  shard.

  Raises:
    ValueError: another backend (gather the vocabulary, ``lax.all_gather(
      logits, axis_name, axis=1, tiled=True)``, then call
      ``extract_sampling_mask``).
  """
  config = as_config(config)
  if dispatch.backend(config) != "xla_search":
    raise ValueError(
        "vocab-parallel masks run on implementation='xla_search'; got "
        f"{dispatch.backend(config)!r}: pass config='xla_search', or gather "
        "the vocabulary (lax.all_gather(logits, axis_name, axis=1, "
        "tiled=True)) and call jaxsample.extract_sampling_mask")
  logits = jnp.asarray(logits)
  params = dispatch.check_logits(logits, params)
  local = logits.shape[1]
  vocab = local * lax.axis_size(axis_name)
  with jax.ensure_compile_time_eval():  # concrete params stay concrete
    params = params.canonical(vocab)
  split = search_split(axis_name, vocab, lax.axis_index(axis_name) * local)
  found = xla_search.search(logits, params, order_width=config.max_mask_ids,
                            split=split)
  return sampling_mask.from_processed(found.processed(), params,
                                      config.max_mask_ids, split)


def _gather_rows(arrays, axis_name: str) -> list[jax.Array]:
  """``all_gather`` of ``[B, ...]`` arrays of 32- or 64-bit dtypes as one
  uint32 block ``[B, F]``: each comes back ``[n, B, ...]``."""
  words = [lax.bitcast_convert_type(a, jnp.uint32) for a in arrays]
  flat = jnp.concatenate([w.reshape(w.shape[0], -1) for w in words], axis=1)
  # A psum of each shard's block in its own slot: an all-gather whose result
  # is typed the same on every shard (shard_map's check_vma).
  slots = jnp.zeros((lax.axis_size(axis_name),) + flat.shape, jnp.uint32)
  block = lax.psum(slots.at[lax.axis_index(axis_name)].set(flat), axis_name)
  cuts = np.cumsum([w[0].size for w in words])[:-1]
  return [lax.bitcast_convert_type(part.reshape(part.shape[:1] + w.shape), a.dtype)
          for part, w, a in zip(jnp.split(block, cuts, axis=2), words, arrays)]


def _join(a: jax.Array, axis_name: str) -> jax.Array:
  """Every shard's ``[B, W]`` block side by side: ``[B, n W]`` in id order."""
  (blocks,) = _gather_rows([a], axis_name)
  return jnp.moveaxis(blocks, 0, 1).reshape(a.shape[0], -1)


def search_split(axis_name: str, vocab: int, offset) -> xla_search.Split:
  """The ``xla_search.Split`` of rows split over ``axis_name`` (this shard's
  columns from global id ``offset``): counts and digit sums ``psum``'d,
  candidates and per-shard bests all-gathered."""
  return xla_search.Split(vocab=vocab, offset=offset,
                          reduce=lambda a: lax.psum(a, axis_name),
                          join=lambda a: _join(a, axis_name))


def _first_max(values: jax.Array):
  """``(max, shard)`` over the leading shard axis of ``[n, B]`` values: the
  first shard reaching the max (ids grow with the shard)."""
  top = jnp.max(values, axis=0)
  return top, jnp.argmax(values == top[None], axis=0)


def _pick(values: jax.Array, shard: jax.Array) -> jax.Array:
  return jnp.take_along_axis(values, shard[None], axis=0)[0]


def _race_xla(logits, params: SamplingParams, streams: rng.RowStreams,
              config: SamplerConfig, offset, axis_name: str) -> SampleResult:
  """The reference race of this shard, one gather, one integer psum."""
  x = reference.sanitize(logits)
  y = reference.temper(x, params.temperature)
  keep = y > -jnp.inf
  noise = rng.gumbel_noise(config.rng, streams, logits.shape[1],
                           fp64=config.use_fp64_gumbel, first_id=offset)
  race = jnp.where(keep, y.astype(noise.dtype) + noise, -jnp.inf)
  at = lambda a, i: jnp.take_along_axis(a, i[:, None], axis=-1)[:, 0]
  race_id, y_id = jnp.argmax(race, axis=-1), jnp.argmax(y, axis=-1)
  race_max, race_id, y_max, y_id, x_race, x_y = _gather_rows(
      [jnp.max(race, axis=-1), race_id.astype(jnp.int32) + offset,
       jnp.max(y, axis=-1), y_id.astype(jnp.int32) + offset, at(x, race_id),
       at(x, y_id)], axis_name)
  _, race_shard = _first_max(race_max)
  row_max, y_shard = _first_max(y_max)
  plain = (params.temperature == 0) | ~jnp.isfinite(row_max)
  tokens = jnp.where(plain, _pick(y_id, y_shard), _pick(race_id, race_shard))
  x_token = jnp.where(plain, _pick(x_y, y_shard), _pick(x_race, race_shard))
  # reference.logsumexp_where with the row's max: integer digit sums.
  shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  limbs = lax.psum(reference.fixed_point_limbs(
      jnp.where(keep, jnp.exp(y - shift[:, None]), 0.0)), axis_name)
  log_sum = jnp.log(reference.limbs_to_float(limbs))
  return reference.finalize(x_token, params, tokens, (shift, log_sum),
                            row_max)


def _race_pallas(logits, params: SamplingParams, streams: rng.RowStreams,
                 config: SamplerConfig, offset, axis_name: str) -> SampleResult:
  """The Gumbel kernel on this shard, its partials gathered and combined."""
  batch, local = logits.shape
  vocab = local * lax.axis_size(axis_name)
  tuned = tuning.resolve(config.tuning)
  plan = common.race_plan(batch, vocab, tuned.gumbel, tuned.occupancy,
                          generator=config.rng, fp64=config.use_fp64_gumbel)
  if local % plan.tile:
    raise ValueError(
        f"the kernels need vocab shards of a multiple of {plan.tile} ids (one "
        f"RNG tile); got {local}: pad the vocabulary with -inf logits to a "
        f"multiple of {plan.tile * lax.axis_size(axis_name)}")
  if not local % plan.split_len:  # the one-device splits, shard by shard
    launch = dataclasses.replace(tuned.gumbel,
                                 num_splits=local // plan.split_len)
    config = dataclasses.replace(config, tuning=dataclasses.replace(
        config.tuning or tuning.Tuning(), gumbel=launch))
  partials = gumbel.gumbel_partials(logits, params.temperature, streams,
                                    config, vocab_offset=offset)
  token, _, _ = gumbel.combine_partials(partials)
  x_local = jnp.take_along_axis(logits, (token - offset)[:, None],
                                axis=-1)[:, 0].astype(jnp.float32)
  fields = [partials.race, partials.index, partials.max, partials.sumexp]
  *gathered, x_shards = _gather_rows(fields + [x_local], axis_name)
  # [n, B, S] -> [B, n S]: splits in id order.
  joined = [jnp.moveaxis(g, 0, 1).reshape(batch, -1) for g in gathered]
  whole = gumbel.GumbelPartials(*joined, raced_tiles=joined[3])
  result, _, _ = gumbel.finish_sampling(
      None, params, whole, logit_at=lambda t: _pick(x_shards, t // local))
  return result
