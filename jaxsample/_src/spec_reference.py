"""The XLA reference of speculative-decoding rejection sampling
(``jaxsample._src.spec.rejection_sample``; ``jaxsample._src.spec``'s module doc is the
spec), and the pieces the fused kernels share with it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample._src import reference, rng, sampling_mask, xla_search
from jaxsample._src.params import SamplingParams
from jaxsample._src.sampling_mask import SamplingMask

__all__ = ["SpecResult", "acceptance_uniforms", "accepted_count", "assemble",
           "check_inputs", "emitted_masks", "per_row_params", "reject_xla",
           "request_keys", "residual_logits", "slot_masks", "stream_keys",
           "without_drafts"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecResult:
  """Emitted ``tokens`` ``[B, k + 1]`` int32 (-1 padded), ``num_accepted``
  ``[B]`` int32 and ``logprobs`` ``[B, k + 1]`` fp32 (0 padded)."""

  tokens: jax.Array
  num_accepted: jax.Array
  logprobs: jax.Array


def request_keys(key, batch_size: int, first_row=0) -> jax.Array:
  """Per-request keys, raw ``[B, 2]`` uint32: ``fold_in(key, b)`` for one
  batch key (``b`` from ``first_row``, a batch shard's first request), the
  keys themselves for per-request keys."""
  data = rng.key_words(key)
  if data.ndim == 1:
    base = jax.random.wrap_key_data(data, impl="threefry2x32")
    rows = jnp.arange(batch_size, dtype=jnp.uint32) + jnp.uint32(first_row)
    return jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(
        base, rows))
  if data.shape != (batch_size, 2):
    raise ValueError(f"key must be one key or {batch_size} per-request keys; "
                     f"got key data of shape {data.shape}")
  return data


def stream_keys(key, batch_size: int) -> tuple[jax.Array, jax.Array]:
  """``(noise_keys, accept_keys)``, raw ``[B, 2]`` uint32 (module doc)."""
  requests = jax.random.wrap_key_data(request_keys(key, batch_size),
                                      impl="threefry2x32")
  purpose = lambda i: jax.random.key_data(
      jax.vmap(jax.random.fold_in, (0, None))(requests, i))
  return purpose(0), purpose(1)


def _gather(a: jax.Array, index: jax.Array,
            split: xla_search.Split) -> jax.Array:
  """``a[b, i, index[b, i]]`` for ``a`` ``[B, m, V]`` and global ids
  ``index`` ``[B, m]`` (rows split over devices: ``split.take``)."""
  return split.take(a.reshape(-1, a.shape[-1]),
                    index.reshape(-1)).reshape(index.shape)


def _at(a: jax.Array, j: jax.Array) -> jax.Array:
  """Slot ``j[b]`` of each request of ``a`` ``[B, m, ...]``."""
  j = j.reshape(j.shape + (1,) * (a.ndim - 1))
  return jnp.take_along_axis(a, j, axis=1)[:, 0]


def per_row_params(params: SamplingParams, m: int,
                   live: jax.Array | None = None) -> SamplingParams:
  """The params of the ``B * m`` rows of ``[B, m, V]`` logits, request-major;
  ``live`` ``[B, m]``: rows outside it are greedy (no filter runs on them:
  rows no output reads)."""
  rows = jax.tree.map(lambda a: jnp.repeat(a, m), params)
  if live is None:
    return rows
  return dataclasses.replace(rows, temperature=jnp.where(
      live.reshape(-1), rows.temperature, 0.0))


def _process(logits, params, order_width: int, process,
             split: xla_search.Split):
  """``process`` (``reference.process`` or ``xla_search.process``, with
  ``order_width``; with a ``split``, ``xla_search.process`` split so) and
  ``log_probs`` of ``[B, m, V]`` rows, in one batch (equal target and draft
  rows get equal results)."""
  batch, m, vocab = logits.shape
  rows = per_row_params(params, m)
  proc = process(logits.reshape(batch * m, vocab), rows,
                 order_width=order_width)
  lq = reference.log_probs(proc, rows, argmax=split.argmax,
                           first_id=split.offset)
  return jax.tree.map(lambda a: a.reshape((batch, m) + a.shape[1:]),
                      (proc, lq))


def acceptance_uniforms(accept_keys, positions, k: int, vocab: int,
                        generator: str) -> jax.Array:
  """``u`` ``[B, k]``: vocab index 0 of stream ``(accept_b, p + i)`` (module doc)."""
  batch = accept_keys.shape[0]
  slots = jnp.arange(k, dtype=jnp.uint32)
  streams, _ = rng.row_streams(
      jnp.repeat(accept_keys, k, axis=0),
      (positions[:, None] + slots).reshape(-1), batch * k, vocab)
  ((_, bits), *_) = rng.tile_bits(generator, streams, 0, jnp.uint32(0))
  return rng.uniform(bits).reshape(batch, k)


def accepted_count(u, lt_d, ld_d, greedy_ok, greedy, valid_t, n,
                   synthetic_rates) -> jax.Array:
  """``num_accepted`` ``[B]`` from the per-slot quantities ``[B, k]`` (module
  doc): ``lt_d`` / ``ld_d`` the target / draft log-probabilities of the draft
  tokens, ``greedy_ok`` whether the draft is the target argmax."""
  k = u.shape[1]
  if synthetic_rates is None:
    ratio = jnp.where(ld_d > -jnp.inf, lt_d - ld_d, -jnp.inf)
    accept = jnp.where(greedy[:, None], greedy_ok, jnp.log(u) < ratio)
  else:
    accept = u < synthetic_rates.astype(jnp.float32)
  accept &= valid_t & (jnp.arange(k, dtype=jnp.int32) < n[:, None])
  return jnp.sum(jnp.cumprod(accept, axis=1, dtype=jnp.int32), axis=1,
                 dtype=jnp.int32)


def residual_logits(y, lt, ld) -> jax.Array:
  """The residual race's logits ``w = y + log1p(-exp(ld - lt))`` where
  ``ld < lt``, -inf elsewhere (module doc); ``w - y`` is ``log(1 - q_d / q_t)``."""
  return jnp.where(ld < lt, y + jnp.log1p(-jnp.exp(ld - lt)), -jnp.inf)


def assemble(d, j, token, lt_d, lp_token) -> SpecResult:
  """Outputs from the drafts ``d`` ``[B, k]``, ``num_accepted`` ``j``, the
  emitted ``token`` and the log-probabilities of the accepted drafts
  (``lt_d`` ``[B, k]``) and of the emitted token (``lp_token`` ``[B]``)."""
  batch, k = d.shape
  all_slots = jnp.arange(k + 1, dtype=jnp.int32)
  at_j = all_slots == j[:, None]
  tokens = jnp.concatenate([d, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  tokens = jnp.where(at_j, token[:, None], tokens)
  logprobs = jnp.concatenate([lt_d, jnp.zeros((batch, 1), jnp.float32)],
                             axis=1)
  logprobs = jnp.where(at_j, lp_token[:, None], logprobs)
  emitted = all_slots <= j[:, None]
  return SpecResult(jnp.where(emitted, tokens, -1), j,
                    jnp.where(emitted, logprobs, 0.0).astype(jnp.float32))


def slot_masks(rows: SamplingMask, j: jax.Array, k1: int) -> SamplingMask:
  """``[k + 1, B, ...]`` masks from ``rows``, those of the ``B * (k + 1)``
  target rows (request-major), blank past slot ``j`` ``[B]`` (module doc)."""
  batch = j.shape[0]
  emitted = jnp.arange(k1, dtype=jnp.int32)[:, None] <= j
  blank = SamplingMask(ids=-1, count=0, logz=-jnp.inf, lse=-jnp.inf,
                       truncated=True, overflow=False)

  def by_slot(a, fill):
    a = jnp.swapaxes(a.reshape((batch, k1) + a.shape[1:]), 0, 1)
    return jnp.where(emitted.reshape(emitted.shape + (1,) * (a.ndim - 2)), a,
                     fill)

  return jax.tree.map(by_slot, rows, blank)


def without_drafts(sample_fn, target_logits, params, key, positions,
                   return_mask: bool):
  """``rejection_sample`` with no draft slots (``k = 0``): ``num_accepted``
  0 and the plain sampler's token for target row 0 (module doc), drawn by
  ``sample_fn(logits, params, noise_keys, positions=, return_mask=)``
  (``jaxsample.sample`` or ``sharded.sample_sharded``) with the requests'
  noise keys.  The verification programs' zero-size arrays crash XLA:CPU's
  compiler under ``jax.shard_map``; this one has none."""
  batch = target_logits.shape[0]
  out = sample_fn(target_logits[:, 0], params, stream_keys(key, batch)[0],
                  positions=positions, return_mask=return_mask)
  sampled, rows = out if return_mask else (out, None)
  result = SpecResult(sampled.tokens[:, None].astype(jnp.int32),
                      jnp.zeros((batch,), jnp.int32),
                      sampled.logprobs[:, None].astype(jnp.float32))
  return (result, emitted_masks(result, rows)) if return_mask else result


def reject_xla(target_logits, draft_tokens, n, params, key, draft_logits,
               synthetic_rates, positions, generator, fp64, mask_ids: int,
               process=reference.process,
               split: xla_search.Split = xla_search.Split()):
  """The reference: ``(SpecResult, the target rows' masks)``, the masks
  ``mask_ids`` wide, or None for ``mask_ids = 0``; ``process`` finds the
  kept sets (``xla_search.process``: the same sets without a sort).

  ``split``: the rows' vocabulary split over devices (``jaxsample.
  sharded.rejection_sample_sharded``; the logits are this device's columns,
  ``process`` is ``xla_search.process`` with this split): every reduction
  over the vocabulary (argmax, the race, the logprob of a global id, the
  residual's mass test) goes through it, so the outputs are the unsplit
  call's, bit for bit, on every device."""
  batch, k1, local = target_logits.shape
  vocab = split.global_vocab(local)
  k = k1 - 1
  d = jnp.clip(draft_tokens, 0, vocab - 1).astype(jnp.int32)
  greedy = params.temperature == 0
  noise_keys, accept_keys = stream_keys(key, batch)
  positions = positions.astype(jnp.uint32)

  ids = jnp.arange(local) + split.offset
  one_hot = jnp.where(ids == d[..., None], jnp.float32(0),
                      jnp.float32(-jnp.inf))
  if draft_logits is None:
    target, lt = _process(target_logits, params, mask_ids, process, split)
    ld = one_hot
  else:
    both, lq = _process(jnp.concatenate([target_logits.astype(jnp.float32),
                                         draft_logits.astype(jnp.float32)],
                                        axis=1), params, mask_ids, process,
                        split)
    target, lt = jax.tree.map(lambda a: a[:, :k1], (both, lq))
    valid_d = jnp.isfinite(both.row_max[:, k1:])
    ld = jnp.where(valid_d[..., None], lq[:, k1:], one_hot)
  valid_t = jnp.isfinite(target.row_max)  # [B, k + 1]

  u = acceptance_uniforms(accept_keys, positions, k, vocab, generator)
  lt_d = _gather(lt[:, :k], d, split)
  argmax = split.argmax(target.y[:, :k].reshape(batch * k, local))
  j = accepted_count(u, lt_d, _gather(ld, d, split),
                     d == argmax.reshape(batch, k), greedy, valid_t[:, :k], n,
                     synthetic_rates)

  # Emission at slot j: residual draw after a rejection, else plain sampling.
  streams, _ = rng.row_streams(noise_keys, positions + j.astype(jnp.uint32),
                               batch, vocab)
  noise = rng.gumbel_noise(generator, streams, local, fp64=fp64,
                           first_id=split.first_id())
  target_j = jax.tree.map(lambda a: _at(a, j), target)
  plain = reference.race_tokens(target_j, params, noise, argmax=split.argmax)
  lt_j = _at(lt, j)
  ld_j = _at(ld, jnp.minimum(j, k - 1)) if k else jnp.full_like(lt_j, -jnp.inf)
  w = residual_logits(target_j.y, lt_j, ld_j)
  residual = split.argmax(w.astype(noise.dtype) + noise)
  some_mass = split.reduce(jnp.sum(w > -jnp.inf, axis=-1, dtype=jnp.int32))
  use_residual = ((j < n) & ~greedy & jnp.isfinite(target_j.row_max) &
                  (some_mass > 0))
  token = jnp.where(use_residual, residual, plain).astype(jnp.int32)
  result = assemble(d, j, token, lt_d, split.take(lt_j, token))
  if not mask_ids:
    return result, None
  rows = jax.tree.map(lambda a: a.reshape((batch * k1,) + a.shape[2:]), target)
  return result, sampling_mask.from_processed(
      rows, per_row_params(params, k1), mask_ids, split)


def emitted_masks(result: SpecResult, rows: SamplingMask) -> SamplingMask:
  """``rejection_sample``'s masks ``[k + 1, B, ...]`` from the target rows'
  ``rows`` (request-major): blank past ``num_accepted``, each emitted token
  listed (``sampling_mask.with_token``: even on overflow)."""
  return sampling_mask.with_token(
      slot_masks(rows, result.num_accepted, result.tokens.shape[1]),
      result.tokens.T, (result.logprobs > -jnp.inf).T)


def check_inputs(target_logits, draft_tokens, num_draft, params, draft_logits,
                 synthetic_rates, positions, *, shards: int = 1) -> None:
  """Raises ``ValueError`` for inputs ``rejection_sample`` rejects (its
  doc); ``shards``: the vocabulary of ``target_logits`` is one of that
  many equal shards (``jaxsample._src.parallel.vocab``), draft tokens index all of
  them."""
  if target_logits.ndim != 3 or target_logits.shape[1] < 1:
    raise ValueError("target_logits must be [B, k + 1, V] with k >= 0; got "
                     f"shape {target_logits.shape}")
  if not jnp.issubdtype(target_logits.dtype, jnp.floating):
    raise ValueError(f"target_logits must be floating point; got "
                     f"{target_logits.dtype}")
  batch, k1, vocab = target_logits.shape
  k = k1 - 1
  if vocab == 0:
    raise ValueError("target_logits must have a non-empty vocabulary (V >= 1)")
  checks = [("draft_tokens", draft_tokens, (batch, k), jnp.integer),
            ("num_draft", num_draft, (batch,), jnp.integer)]
  if positions is not None:
    checks.append(("positions", positions, (batch,), jnp.integer))
  if draft_logits is not None:
    checks.append(("draft_logits", draft_logits, (batch, k, vocab),
                   jnp.floating))
  if synthetic_rates is not None:
    checks.append(("synthetic_rates", synthetic_rates, (k,), jnp.floating))
  for name, a, shape, kind in checks:
    if a.shape != shape or not jnp.issubdtype(a.dtype, kind):
      raise ValueError(
          f"{name} must be {kind.__name__} of shape {shape} (B={batch}, "
          f"k={k}, V={vocab} from target_logits [B, k + 1, V]); got "
          f"{a.dtype}{list(a.shape)}")
  if not isinstance(num_draft, jax.core.Tracer):
    n = np.asarray(num_draft)
    if n.size and (n.min() < 0 or n.max() > k):
      raise ValueError(f"num_draft must be in [0, k={k}]; got values in "
                       f"[{n.min()}, {n.max()}]")
  if not isinstance(draft_tokens, jax.core.Tracer):
    d = np.asarray(draft_tokens)
    if d.size and (d.min() < 0 or d.max() >= vocab * shards):
      raise ValueError(f"draft_tokens must be in [0, V={vocab * shards}); got "
                       f"values in [{d.min()}, {d.max()}] (padding slots "
                       "past num_draft too: fill them with 0)")
