"""Vocab-parallel sampling: logits split along the vocabulary (tensor parallel).

``sample_sharded``, ``extract_sampling_mask_sharded`` and
``rejection_sample_sharded`` run inside ``jax.shard_map`` on one shard
``[B, V / n]`` of the logits (shard ``i`` holds global ids ``[i V / n, (i +
1) V / n)``, ``n`` the size of ``axis_name``), drawing the noise of the
global ids; collectives of ``O(B)`` values finish each row:

* rows without a filter: each shard races its slice (``_reference_race``,
  or the Gumbel kernel's partials: ``_kernel_race``), one all-gather of a
  few values per row (``_gather_rows``) picks the winner, and on the XLA
  paths one integer ``psum`` sums the normalizer's digits;
* a batch with a truncating row: the sort-free search with a ``Split``
  (``search_split``: candidates all-gathered, counts and digit sums
  ``psum``'d); on ``implementation="xla"`` the batch gathers the vocabulary
  and samples it whole (exact, not parallel).

``vocab_mesh_call`` is how ``sample``, ``extract_sampling_mask`` and
``rejection_sample`` reach these under ``jax.jit``.  What is exact, and each
path's collectives: ``docs/multi_device.md``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax.sharding import PartitionSpec as P

from jaxsample._src import (backends, dispatch, reference, rng, rowwise,
                            sampling_mask, spec_reference, xla_search)
from jaxsample._src.parallel.batch import (batch_split_over, explicit_axes,
                                           manual_rows, shard_config)
from jaxsample._src.backends import xla_reference
from jaxsample._src.backends.pallas import (race_vocab_shard,
                                            untruncated_facts, with_mask)
from jaxsample._src.params import SamplerConfig, SamplingParams, as_config
from jaxsample._src.reference import SampleResult
from jaxsample._src.sampling_mask import SamplingMask
from jaxsample._src.spec_reference import SpecResult

__all__ = ["extract_sampling_mask_sharded", "rejection_sample_sharded",
           "sample_sharded", "search_split", "vocab_mesh_call"]


def sample_sharded(logits: jax.Array, params: SamplingParams, key: jax.Array,
                   *, axis_name: str, positions: jax.Array | None = None,
                   config: SamplerConfig | str | None = None,
                   return_mask: bool = False
                   ) -> SampleResult | tuple[SampleResult, SamplingMask]:
  """``jaxsample.sample`` of logits split along the vocabulary over the
  ``jax.shard_map`` axis ``axis_name`` (``docs/multi_device.md``: the
  collectives and what is exact).

  Args:
    logits: this shard's ``[B, V / n]`` columns, shard ``i`` of ``n`` holding
      global ids from ``i V / n`` (``P(..., axis_name)`` in ``in_specs``).
    params, key, positions, config: as for ``jaxsample.sample``, replicated
      over ``axis_name`` (the batch may be split over other axes: one batch
      key then counts rows globally, as ``sample`` does).
    return_mask: static; also return the ``SamplingMask`` of the kept sets
      (``sample``'s, ``config.max_mask_ids`` wide): from the race's
      collectives (one more int32 per row: the count of finite entries), or
      from the search's (only the kept candidates' ids move).

  Returns:
    ``SampleResult`` ``[B]`` (with ``return_mask``, the pair ``(SampleResult,
    SamplingMask)``), the same on every shard of ``axis_name``.
  """
  config = as_config(config)
  logits = jnp.asarray(logits)
  params = dispatch.check_logits(logits, params)
  batch, local = logits.shape
  vocab = local * lax.axis_size(axis_name)
  offset = lax.axis_index(axis_name) * local
  batch_shards, first_row = manual_rows(logits, batch, exclude=axis_name)
  streams, _ = rng.row_streams(key, positions, batch, vocab,
                               first_row=first_row)
  with jax.ensure_compile_time_eval():  # concrete params stay concrete
    params = params.canonical(vocab)
    truncating = jnp.any(params.truncates() & (params.temperature > 0))

  width = config.max_mask_ids if return_mask else 0
  # A batch shard's kernels plan as for the whole batch.
  config = shard_config(config, batch_shards)

  def parallel():
    race = _kernel_race if backends.backend_name(config) == "pallas" else (
        _reference_race)
    result, row_max, lse, finite = race(logits, params, streams, config,
                                        offset, axis_name, bool(width))
    return with_mask(result, untruncated_facts(row_max, lse, finite, width),
                     params, width)

  def truncated():
    if backends.backend_name(config) == "xla":
      whole = _join(logits.astype(jnp.float32), axis_name)
      return xla_reference.sample_rows(whole, params, streams, config,
                                       bool(width))
    split = search_split(axis_name, vocab, offset)
    result, proc = xla_search.sample(
        logits, params, streams, generator=config.rng,
        fp64=config.use_fp64_gumbel, order_width=width, split=split)
    return result, sampling_mask.from_processed(
        proc, params, width, split) if width else None

  with dispatch.x64_scope(config.use_fp64_gumbel, logits, key, positions,
                          *jax.tree.leaves(params)):
    result, kept = rowwise.cond(truncating, truncated, parallel)
  if not return_mask:
    return result
  # Valid rows' tokens are in their kept sets: listed even on overflow.
  return result, sampling_mask.with_token(kept, result.tokens, result.valid)


def extract_sampling_mask_sharded(
    logits: jax.Array, params: SamplingParams, *, axis_name: str,
    config: SamplerConfig | str | None = None) -> sampling_mask.SamplingMask:
  """``jaxsample.extract_sampling_mask`` of logits split along the
  vocabulary over the ``jax.shard_map`` axis ``axis_name`` (``logits`` and
  ``params`` as for ``sample_sharded``), on the sort-free search
  (``implementation="xla_search"``, ``"pallas"`` or ``"auto"``): the
  search's collectives (module doc), the kept ids listed from the joined
  candidates (``config.max_mask_ids`` wide: only they move), counts and
  digit sums ``psum``'d.  Bit-identical to the one-device call on
  ``"xla_search"`` (the kernel path's one-device masks match it up to fp32
  rounding); the same on every shard.

  Raises:
    ValueError: ``implementation="xla"`` (gather the vocabulary,
      ``lax.all_gather(logits, axis_name, axis=1, tiled=True)``, then call
      ``extract_sampling_mask``, or pass ``"xla_search"``).
  """
  config = as_config(config)
  if backends.backend_name(config) == "xla":
    raise ValueError(
        "vocab-parallel masks run on the sort-free search; got "
        "implementation='xla': pass config='xla_search', or gather the "
        "vocabulary (lax.all_gather(logits, axis_name, axis=1, tiled=True)) "
        "and call jaxsample.extract_sampling_mask")
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


def rejection_sample_sharded(
    target_logits: jax.Array, draft_tokens: jax.Array, num_draft: jax.Array,
    params: SamplingParams, key: jax.Array, *, axis_name: str,
    draft_logits: jax.Array | None = None,
    synthetic_rates: jax.Array | None = None,
    positions: jax.Array | None = None,
    config: SamplerConfig | str | None = None, return_mask: bool = False
) -> SpecResult | tuple[SpecResult, SamplingMask]:
  """``spec.rejection_sample`` of target (and draft) logits split along the
  vocabulary over the ``jax.shard_map`` axis ``axis_name``.

  ``target_logits`` ``[B, k + 1, V / n]`` and ``draft_logits`` ``[B, k, V /
  n]`` are this shard's columns (shard ``i`` holding global ids from ``i V
  / n``); ``draft_tokens`` (global ids), ``num_draft``, ``params``, ``key``,
  ``positions`` and ``synthetic_rates`` are replicated over ``axis_name``
  (the batch may be split over other axes), as for ``rejection_sample``.

  Every backend runs the XLA reference (``spec_reference.reject_xla``) on
  the sort-free search's kept sets split over the shards
  (``xla_search.search`` with ``search_split``: candidates of ``B (2k + 1)``
  rows all-gathered ``W`` wide, counts and digit sums ``psum``'d); the
  draft tokens' logprobs, the greedy and race argmaxes, the residual's race
  and the emitted token's logprob each move ``O(B k)`` values; the
  vocabulary never moves.  Outputs (and masks) are bit-identical to the
  one-device ``rejection_sample(..., config=dataclasses.replace(config,
  implementation="xla_search"))``, the same on every shard; the kernels'
  one-device logprobs differ from them by fp32 rounding (and a top-p
  crossing within rounding of ``p`` may keep a neighbouring set).
  ``processors`` are not taken: apply them before splitting.
  """
  config = as_config(config)
  target_logits, draft_tokens, num_draft, draft_logits, synthetic_rates, \
      positions = (None if a is None else jnp.asarray(a) for a in (
          target_logits, draft_tokens, num_draft, draft_logits,
          synthetic_rates, positions))
  shards = lax.axis_size(axis_name)
  spec_reference.check_inputs(target_logits, draft_tokens, num_draft, params,
                              draft_logits, synthetic_rates, positions,
                              shards=shards)
  batch, k1, local = target_logits.shape
  vocab = local * shards
  params = SamplingParams.rows(params, batch)
  if rng.key_words(key).ndim == 2 or positions is not None:
    positions = rng.check_positions(positions, batch)
  positions = jnp.zeros((batch,), jnp.int32) if positions is None else (
      positions)
  n = jnp.clip(num_draft, 0, k1 - 1).astype(jnp.int32)
  with jax.ensure_compile_time_eval():  # concrete params stay concrete
    params = params.canonical(vocab)
  key = spec_reference.request_keys(key, batch, manual_rows(
      target_logits, batch, exclude=axis_name)[1])
  if k1 == 1:
    return spec_reference.without_drafts(
        functools.partial(sample_sharded, axis_name=axis_name, config=config),
        target_logits, params, key, positions, return_mask)
  split = search_split(axis_name, vocab, lax.axis_index(axis_name) * local)
  with dispatch.x64_scope(config.use_fp64_gumbel, target_logits, key,
                          positions, *jax.tree.leaves(params)):
    result, rows = spec_reference.reject_xla(
        target_logits, draft_tokens, n, params, key, draft_logits,
        synthetic_rates, positions, config.rng, config.use_fp64_gumbel,
        config.max_mask_ids * return_mask,
        functools.partial(xla_search.process, split=split), split)
  if not return_mask:
    return result
  return result, spec_reference.emitted_masks(result, rows)


def vocab_mesh_call(fn, *, split, rows, keys=None, whole=None,
                    processors=None, out_batch_dims=0):
  """``fn(**split, **rows, **keys, axis_name=a)`` inside ``jax.shard_map``
  over the mesh of ``split["logits"]`` or ``split["target_logits"]``, whose
  last dimension is split over one Explicit mesh axis ``a`` (vocab-sharded
  logits under ``jax.jit``): how ``sample``, ``extract_sampling_mask`` and
  ``rejection_sample`` reach the ``*_sharded`` functions from ``jit``.

  ``split``: arrays ``[B, ..., V]``, split along the vocabulary over ``a``
  and along the batch as the logits are; ``rows``: pytrees of ``[B, ...]``
  arrays (None allowed), split along the batch; ``keys``: ``key`` (with
  ``positions``), per request (``[B]`` keys) following the batch, else
  replicated; ``whole``: arrays replicated on every device;
  ``out_batch_dims``: the batch axis of ``fn``'s outputs (a pytree prefix
  of them).

  Raises:
    ValueError: for ``processors`` (apply them before splitting the
      vocabulary), or a vocabulary split over several mesh axes.
  """
  split = {name: a for name, a in split.items() if a is not None}
  logits = split.get("logits", split.get("target_logits"))
  vocab_axes = explicit_axes(logits, logits.ndim - 1)
  if processors is not None:
    raise ValueError(
        "processors are not taken for logits split along the vocabulary "
        f"(mesh axes {vocab_axes}): apply them (jaxsample.apply_processors) "
        "before the vocabulary is split, or reshard it unsharded")
  if len(vocab_axes) != 1:
    raise ValueError(
        f"the vocabulary is split over mesh axes {vocab_axes}: split it over "
        "one axis, or call sample_sharded inside jax.shard_map")
  axis_name = vocab_axes[0]
  batch = explicit_axes(logits, 0) or None
  keys, whole = dict(keys or {}), dict(whole or {})
  if keys and rng.key_words(keys["key"]).ndim == 1:  # one key: replicated
    whole["key"] = keys.pop("key")
  rows = {**rows, **keys}
  split_spec = lambda a: P(batch, *(None,) * (a.ndim - 2), axis_name)
  split_specs = {name: split_spec(a) for name, a in split.items()}
  reshard = lambda tree, spec: jax.tree.map(
      lambda a: jax.sharding.reshard(a, spec), tree)
  split = {name: reshard(a, split_specs[name]) for name, a in split.items()}
  rows, whole = reshard(rows, P(batch)), reshard(whole, P())
  def body(split, rows, whole):
    with batch_split_over(batch or ()):
      return fn(**split, **rows, **whole, axis_name=axis_name)

  mesh = jax.typeof(logits).sharding.mesh
  # check_vma off: the kernels' interpret mode cannot lower with it (JAX
  # 0.11.2); batch_split_over tells manual_rows the batch split instead.
  out_specs = jax.tree.map(lambda d: P(*(None,) * d, batch), out_batch_dims)
  return jax.shard_map(body, mesh=mesh, in_specs=(split_specs, P(batch), P()),
                       out_specs=out_specs, check_vma=False)(split, rows, whole)


def _gather_rows(arrays, axis_name: str) -> list[jax.Array]:
  """``all_gather`` of ``[B, ...]`` arrays of any 8- to 64-bit dtype as one
  uint32 block ``[B, F]`` (narrower values widened, wider ones split into
  words; bits unchanged): each comes back ``[n, B, ...]``."""
  words = [_to_words(a) for a in arrays]
  flat = jnp.concatenate([w.reshape(w.shape[0], math.prod(w.shape[1:]))
                          for w in words], axis=1)
  # A psum of each shard's block in its own slot: an all-gather whose result
  # is typed the same on every shard (shard_map's check_vma).
  slots = jnp.zeros((lax.axis_size(axis_name),) + flat.shape, jnp.uint32)
  block = lax.psum(slots.at[lax.axis_index(axis_name)].set(flat), axis_name)
  cuts = np.cumsum([math.prod(w.shape[1:]) for w in words])[:-1]
  return [_from_words(part.reshape(part.shape[:1] + w.shape), a.dtype)
          for part, w, a in zip(jnp.split(block, cuts, axis=2), words, arrays)]


def _to_words(a: jax.Array) -> jax.Array:
  """``a``'s bits as uint32: a narrower value zero-extended, a 64-bit one
  as two words (a trailing axis)."""
  bits = 8 * a.dtype.itemsize
  if bits >= 32:
    return lax.bitcast_convert_type(a, jnp.uint32)
  return lax.bitcast_convert_type(a, jnp.dtype(f"uint{bits}")).astype(
      jnp.uint32)


def _from_words(words: jax.Array, dtype) -> jax.Array:
  """``_to_words`` undone."""
  bits = 8 * jnp.dtype(dtype).itemsize
  if bits >= 32:
    return lax.bitcast_convert_type(words, dtype)
  return lax.bitcast_convert_type(
      words.astype(jnp.dtype(f"uint{bits}")), dtype)


def _join(a: jax.Array, axis_name: str) -> jax.Array:
  """Every shard's ``[B, W]`` block side by side: ``[B, n W]`` in id order."""
  (blocks,) = _gather_rows([a], axis_name)
  return jnp.moveaxis(blocks, 0, 1).reshape(a.shape[0],
                                             blocks.shape[0] * a.shape[1])


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


def _reference_race(logits, params: SamplingParams, streams: rng.RowStreams,
                    config: SamplerConfig, offset, axis_name: str,
                    count_finite: bool):
  """The reference race of rows without a filter, one gather and one
  integer psum: ``(SampleResult, row_max, lse, finite)``, ``finite`` (the
  count of entries ``> -inf``, on the same psum) None without
  ``count_finite``."""
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
  terms = [reference.fixed_point_limbs(
      jnp.where(keep, jnp.exp(y - shift[:, None]), 0.0))]
  if count_finite:  # the mask's count of finite entries, on the same psum
    terms.append(jnp.sum(keep, axis=-1, dtype=jnp.int32)[:, None])
  sums = lax.psum(jnp.concatenate(terms, axis=1), axis_name)
  log_sum = jnp.log(reference.limbs_to_float(sums[:, :reference.LIMBS]))
  result = reference.finalize(x_token, params, tokens, (shift, log_sum),
                              row_max)
  finite = sums[:, reference.LIMBS] if count_finite else None
  return result, row_max, shift + log_sum, finite


def _kernel_race(logits, params: SamplingParams, streams: rng.RowStreams,
                 config: SamplerConfig, offset, axis_name: str,
                 count_finite: bool):
  """The kernels' race of rows without a filter split over ``axis_name``
  (``race_vocab_shard``, one all-gather): ``(SampleResult, row_max, lse,
  finite)`` (``finite`` None without ``count_finite``)."""
  return race_vocab_shard(
      logits, params, streams, config, offset=offset,
      shards=lax.axis_size(axis_name), count_finite=count_finite,
      gather=lambda arrays: _gather_rows(arrays, axis_name))
