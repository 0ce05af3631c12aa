"""Speculative rejection on the kernels: the kept floors, the one-hot and the
draft-logits verifiers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsample._src import reference, rng, spec_reference
from jaxsample._src.pallas import common, gumbel, threshold
from jaxsample._src.pallas.spec.stats import (combine_stats, log_probs_at,
                                         stats_partials)
from jaxsample._src.pallas.spec.emit import (EmitRequest, GREEDY, RACE, RESIDUAL,
                                        SKIP, emit_partials)
from jaxsample._src.params import SamplerConfig, SamplingParams

__all__ = ["KeptFloors", "reject"]


def _race_winner(race, index):
  """``(top, token)`` of per-split race partials ``[B, S]`` (first split wins
  ties), as ``gumbel.combine_partials``."""
  top = jnp.max(race, axis=-1)
  token = jnp.min(jnp.where(race == top[:, None], index,
                            jnp.iinfo(jnp.int32).max), axis=-1)
  return top, token


# ---------------------------------------------------------------------------
# The whole sampler.
# ---------------------------------------------------------------------------


def _at(a, j):
  """``a[b, j[b]]`` for ``a`` ``[B, m]``."""
  return jnp.take_along_axis(a, j[:, None], axis=1)[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeptFloors:
  """``threshold.KeptSets`` of the target rows (``[B, k + 1]`` each) and of
  the draft rows (``[B, k]``; None without draft logits), without their
  ``ordered_ids``; ``target_ids``: the target rows' (``[B, k + 1, W]``, or
  None)."""

  target: threshold.KeptSets
  draft: threshold.KeptSets | None
  target_ids: jax.Array | None = None


def _reject_one_hot(target_logits, d, n, params: SamplingParams, noise_keys,
                    accept_keys, positions, synthetic_rates,
                    config: SamplerConfig,
                    floors: KeptFloors | None) -> spec_reference.SpecResult:
  """``reject`` for one-hot drafts in one pass: the Gumbel kernel races every
  target row ``i <= n`` with the noise of position ``p + i``, leaving the
  draft ``d_i`` out of sampled rows ``i < n`` (the one-hot residual), and
  sums it (module doc, "One-hot drafts")."""
  batch, k1, vocab = target_logits.shape
  k = k1 - 1
  t = params.temperature
  greedy = t == 0
  slots = jnp.arange(k1, dtype=jnp.int32)
  drafted = (slots[:k] < n[:, None]) & ~greedy[:, None]  # d_i left out
  exclude = jnp.concatenate([jnp.where(drafted, d, -1),
                             jnp.full((batch, 1), -1, jnp.int32)], axis=1)
  streams, _ = rng.row_streams(
      jnp.repeat(noise_keys, k1, axis=0),
      (positions[:, None] + slots.astype(jnp.uint32)).reshape(-1),
      batch * k1, vocab)
  floor_t = (floors.target.threshold if floors is not None else
             jnp.full((batch, k1), -jnp.inf, jnp.float32))
  target2d = target_logits.reshape(batch * k1, vocab)
  partials = gumbel.gumbel_partials(
      target2d, jnp.repeat(t, k1), streams,
      config, active=(slots <= n[:, None]).reshape(-1),
      floor=floor_t.reshape(-1) if floors is not None else None,
      exclude=exclude.reshape(-1))
  per_slot = lambda a: a.reshape(batch, k1)
  token, race_max, shift, log_sum = map(per_slot, jax.tree.leaves(
      gumbel.combine_partials(partials)))
  top = per_slot(_race_winner(partials.race, partials.index)[0])

  # Add the left-out drafts back into their rows' normalizers and validity.
  first_row = jnp.arange(batch, dtype=jnp.int32) * k1
  x_d = reference.sanitize(target2d[first_row[:, None] + slots[:k], d])
  y_d = reference.divide(x_d, jnp.where(greedy, 1.0, t)[:, None])
  pad = lambda a, v: jnp.concatenate([a, jnp.full((batch, 1), v, a.dtype)], 1)
  y_out = pad(jnp.where(drafted & (y_d >= floor_t[:, :k]), y_d, -jnp.inf),
              -jnp.inf)
  back = y_out > -jnp.inf
  new_shift = jnp.where(back, jnp.maximum(shift, y_out), shift)
  log_sum = jnp.where(back, jnp.log(jnp.exp(log_sum + (shift - new_shift)) +
                                    jnp.exp(y_out - new_shift)), log_sum)
  valid = ((race_max < jnp.inf) & (y_out < jnp.inf) &
           (jnp.isfinite(race_max) | jnp.isfinite(y_out)))

  lt_d = jnp.where(greedy[:, None], jnp.where(d == token[:, :k], 0.0, -jnp.inf),
                   log_probs_at(x_d, new_shift[:, :k], log_sum[:, :k],
                                t[:, None], floor_t[:, :k]))
  lt_d = jnp.where(valid[:, :k], lt_d, -jnp.inf).astype(jnp.float32)
  j = jnp.zeros((batch,), jnp.int32)
  if k:
    u = spec_reference.acceptance_uniforms(accept_keys, positions, k, vocab,
                                           config.rng)
    j = spec_reference.accepted_count(u, lt_d, jnp.zeros_like(lt_d),
                                      d == token[:, :k], greedy, valid[:, :k],
                                      n, synthetic_rates)

  # The token at slot j: its row's race (without d_j after a rejection).
  token_j, top_j, valid_j = _at(token, j), _at(top, j), _at(valid, j)
  d_j = _at(pad(d, 0), j)
  left_out = _at(exclude, j) >= 0
  # d_j wins when nothing else is left (a zero residual) and, on an invalid
  # row, when it is the first of the row's +inf (reference.race_tokens).
  inf_first = (~valid_j & (_at(y_out, j) == jnp.inf) &
               ((d_j < token_j) | (top_j < jnp.inf)))
  token_j = jnp.where(left_out & ((valid_j & (top_j == -jnp.inf)) | inf_first),
                      d_j, token_j).astype(jnp.int32)
  x_token = reference.sanitize(target2d[first_row + j, token_j])
  lp = jnp.where(greedy, 0.0, log_probs_at(
      x_token, _at(new_shift, j), _at(log_sum, j), t, _at(floor_t, j)))
  lp = jnp.where(valid_j, lp, -jnp.inf).astype(jnp.float32)
  return spec_reference.assemble(d, j, token_j, lt_d, lp)


def reject(target_logits, d, n, params: SamplingParams, noise_keys,
           accept_keys, positions, draft_logits, synthetic_rates,
           config: SamplerConfig,
           floors: KeptFloors | None = None) -> spec_reference.SpecResult:
  """``rejection_sample`` by the kernels for canonical params; ``d`` clipped
  drafts, ``n`` clipped counts, raw stream keys ``[B, 2]``
  (``spec.stream_keys``) and uint32 positions.  ``floors``: ``backends.pallas.kept_floors``
  (a batch with filters on), or None where no request truncates."""
  if draft_logits is None or target_logits.shape[1] == 1:
    return _reject_one_hot(target_logits, d, n, params, noise_keys,
                           accept_keys, positions, synthetic_rates, config,
                           floors)
  return _reject_with_draft_logits(target_logits, d, n, params, noise_keys,
                                   accept_keys, positions, draft_logits,
                                   synthetic_rates, config, floors)


def _reject_with_draft_logits(target_logits, d, n, params: SamplingParams,
                              noise_keys, accept_keys, positions, draft_logits,
                              synthetic_rates, config: SamplerConfig,
                              floors: KeptFloors | None
                              ) -> spec_reference.SpecResult:
  """``reject`` with draft logits (``k >= 1``): passes 1 and 2."""
  batch, k1, vocab = target_logits.shape
  k = k1 - 1
  t = params.temperature
  greedy = t == 0
  target2d = target_logits.reshape(batch * k1, vocab)
  draft2d = draft_logits.reshape(batch * k, vocab)
  rows = jnp.arange(batch, dtype=jnp.int32)
  floored = floors is not None
  kept_t = floors.target if floored else threshold.untruncated_sets((batch, k1))
  kept_d = floors.draft if floored else threshold.untruncated_sets((batch, k))
  floor_t, floor_d = kept_t.threshold, kept_d.threshold

  kept_t_slots = jax.tree.map(lambda a: a[:, :k], kept_t)
  row_kept = None
  if floored:
    row_kept = jax.tree.map(
        lambda *a: jnp.concatenate([x.reshape(-1) for x in a]),
        kept_t_slots, kept_d)
  m, arg, sumexp = stats_partials(target_logits, draft_logits, t, n, config,
                                  kept=row_kept)
  split = lambda a: a.reshape(-1, batch, k, a.shape[-1])
  m, arg, sumexp = split(m), split(arg), split(sumexp)
  ts = combine_stats(m[0], arg[0], sumexp[0], t,
                     kept_t_slots if floored else None)
  ds = combine_stats(m[1], arg[1], sumexp[1], t, kept_d if floored else None)
  # The logits at the drafts, gathered from the flat rows (no slice copy).
  slots = jnp.arange(k, dtype=jnp.int32)
  x_t = reference.sanitize(target2d[rows[:, None] * k1 + slots, d])
  lt_d = jnp.where(greedy[:, None],
                   jnp.where(d == ts.argmax, 0.0, -jnp.inf),
                   log_probs_at(x_t, ts.shift, ts.log_sum, t[:, None],
                                floor_t[:, :k]))
  lt_d = jnp.where(ts.valid, lt_d, -jnp.inf).astype(jnp.float32)
  x_d = reference.sanitize(draft2d[rows[:, None] * k + slots, d])
  ld_d = jnp.where(ds.valid, log_probs_at(x_d, ds.shift, ds.log_sum,
                                          t[:, None], floor_d), 0.0)
  u = spec_reference.acceptance_uniforms(accept_keys, positions, k, vocab,
                                         config.rng)
  j = spec_reference.accepted_count(u, lt_d, ld_d, d == ts.argmax, greedy,
                                    ts.valid, n, synthetic_rates)
  jc = jnp.minimum(j, k - 1)
  # A greedy rejection emits row j's argmax: pass 1 has it.
  known = greedy & (j < n)
  known_token = _at(ts.argmax, jc)
  known_lp = jnp.where(_at(ts.valid, jc), 0.0, -jnp.inf)
  rejected = (j < n) & ~greedy & _at(ts.valid, jc)
  d_j = _at(d, jc)
  use_draft = rejected & _at(ds.valid, jc)
  norms = (_at(ts.shift, jc), _at(ts.log_sum, jc), _at(ds.shift, jc),
           _at(ds.log_sum, jc))

  emit_floors = ()
  if floored:
    emit_floors = (_at(floor_t, j), _at(floor_d, jc))
  streams, _ = rng.row_streams(noise_keys, positions + j.astype(jnp.uint32),
                               batch, vocab)
  mode = jnp.where(known, SKIP, jnp.where(
      greedy, GREEDY, jnp.where(use_draft, RESIDUAL, RACE)))
  req = EmitRequest(mode.astype(jnp.int32), rows * k1 + j, rows * k + jc,
                    jnp.where(rejected & ~use_draft, d_j, -1).astype(jnp.int32),
                    norms, streams, emit_floors)
  partials, plain = emit_partials(target2d, draft2d, t, req, config)

  # The plain race's token and logprob: as jaxsample.sample's kernel path.
  token, row_max, lse = gumbel.combine_partials(partials)
  top, _ = _race_winner(partials.race, partials.index)
  _, plain_token = _race_winner(*plain)
  token = jnp.where((mode == RESIDUAL) & (top == -jnp.inf), plain_token, token)
  # A one-hot residual with no mass: d_j is the target's only token.
  token = jnp.where(rejected & ~use_draft & (top == -jnp.inf), d_j, token)
  x_token = reference.sanitize(target2d[req.row_t, token])
  plain_lp = reference.finalize(x_token, params, token, lse, row_max).logprobs
  residual_lp = log_probs_at(x_token, norms[0], norms[1], t, _at(floor_t, j))
  lp = jnp.where(rejected, residual_lp, plain_lp)
  token = jnp.where(known, known_token, token).astype(jnp.int32)
  lp = jnp.where(known, known_lp, lp).astype(jnp.float32)
  return spec_reference.assemble(d, j, token, lt_d, lp)
