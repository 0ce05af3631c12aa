"""One speculative decode step for every slot (the serving loop's step).

Slot ``b`` (last token ``t`` at position ``p``, not yet cached) runs:

1. the drafter proposes ``k`` tokens ``d`` and a count ``n`` (0 for finished
   slots);
2. the target model reads ``[t, d_0 .. d_{k-1}]`` at positions ``p .. p + k``
   (one forward of ``k + 1`` tokens; row ``i`` scores position ``p + 1 + i``);
3. ``jaxsample._src.spec.rejection_sample`` verifies the drafts with the slot's
   key and parameters at positions ``p + 1 ..`` and emits ``j + 1`` tokens
   (``j`` accepted drafts, then a corrected or bonus token); with
   ``synthetic_rates`` acceptance is ``u_i < rate_i`` instead and every
   unfinished slot verifies all ``k`` drafts: the drafter's, its slots past
   ``n`` filled with the slot's last token ``t`` (benchmarks: the work of a
   drafter that always proposes ``k`` tokens, at a chosen acceptance:
   accepted lengths ``j`` with ``P(j >= i) = rate_0 .. rate_{i-1}``);
4. the emitted tokens are cut after the first stop token and at the slot's
   remaining budget; a token from an invalid target row (NaN, +inf, no finite
   logit, after the processors) is dropped and finishes the slot, as in
   ``emit``.

With ``DecodeState.processors`` every slot's target and draft rows are
processed with the request's history plus the drafts before them
(``processors.apply_to_slots``), and the emitted tokens are appended to the
history.

Cache entries past the new last token (rejected drafts) are stale and ignored
by the model, then overwritten.  The target cache (and the history) needs
``k`` positions beyond the longest sequence (``cache_len + k``).

Greedy slots emit exactly the plain greedy tokens; sampled slots emit tokens
distributed exactly as plain sampling (not the same tokens for the same key:
the verification draws from other streams, ``jaxsample._src.spec``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxsample.generation.lm import LanguageModel
from jaxsample.generation.step import DecodeState
from jaxsample._src.mask import SamplingMask
from jaxsample._src.params import SamplerConfig
from jaxsample._src.processors import apply_to_slots
from jaxsample._src.spec import rejection_sample

__all__ = ["SpecOutput", "SpecState", "spec_step", "write_history"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
  """A ``DecodeState`` plus what drafting needs.

  Attributes:
    decode: the slots' ``DecodeState`` (its cache has ``cache_len + k``
      positions).
    history: ``[B, H]`` int32, each slot's tokens by position (prompt and
      generated, the last one included; stale past it).
    draft: the drafter's own state (``drafters``), or None.
  """

  decode: DecodeState
  history: jax.Array
  draft: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecOutput:
  """Per slot: ``tokens`` ``[B, k + 1]`` (the first ``count`` emitted),
  ``logprobs`` ``[B, k + 1]``, ``count`` ``[B]`` int32, ``drafted`` and
  ``accepted`` ``[B]`` int32 (drafts proposed and accepted, before stop /
  budget cuts) and the ``[k + 1, B, ...]`` ``SamplingMask`` or None."""

  tokens: jax.Array
  logprobs: jax.Array
  count: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  mask: SamplingMask | None = None


def write_history(history: jax.Array, tokens: jax.Array, starts: jax.Array,
                  count: jax.Array) -> jax.Array:
  """``history`` with ``tokens[b, :count[b]]`` written at ``starts[b]`` ...
  (the other entries kept)."""
  width = tokens.shape[1]
  columns = starts[:, None] + jnp.arange(width)
  rows = jnp.arange(history.shape[0])[:, None]
  keep = jnp.arange(width)[None] < count[:, None]
  current = history[rows, jnp.minimum(columns, history.shape[1] - 1)]
  return history.at[rows, columns].set(jnp.where(keep, tokens, current),
                                       mode="drop")


def _valid_rows(logits: jax.Array) -> jax.Array:
  """``[..., V] -> [...]``: no NaN, no +inf and some finite entry."""
  return (~jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1) &
          jnp.any(jnp.isfinite(logits), axis=-1))


def spec_step(lm: LanguageModel, weights, drafter, draft_weights,
              state: SpecState, *, config: SamplerConfig | None = None,
              return_mask: bool = False,
              synthetic_rates: jax.Array | None = None
              ) -> tuple[SpecState, SpecOutput]:
  """One speculative step (module doc); pure and jit-able (``lm``,
  ``drafter``, ``config`` and ``return_mask`` static)."""
  d = state.decode
  k = drafter.num_draft
  drafts, num, draft_logits, own = drafter.propose(
      draft_weights, state.draft, state.history, d.positions, d.params, d.keys)
  if synthetic_rates is not None:  # always k drafts, padded with t
    drafts = jnp.where(jnp.arange(k) < num[:, None], drafts,
                       d.tokens[:, None])
    num = jnp.full_like(num, k)
  num = jnp.where(d.finished, 0, num)
  inputs = jnp.concatenate([d.tokens[:, None], drafts], axis=1)
  logits, cache = lm.apply(weights, inputs,
                           d.positions[:, None] + jnp.arange(k + 1), d.cache)
  verified = rejection_sample(
      logits, drafts, num, d.params, d.keys, draft_logits=draft_logits,
      synthetic_rates=synthetic_rates, positions=d.positions + 1,
      config=config, return_mask=return_mask, processors=d.processors)
  result, masks = verified if return_mask else (verified, None)
  j = result.num_accepted
  slots = jnp.arange(k + 1)
  processed, _ = apply_to_slots(d.processors, logits, drafts)
  emitting_valid = jnp.take_along_axis(_valid_rows(processed), j[:, None],
                                       axis=1)[:, 0]
  count = j + emitting_valid.astype(jnp.int32)
  stop_at = jnp.any(result.tokens[:, :, None] == d.stop_tokens[:, None, :],
                    axis=2) & (slots[None] < count[:, None])
  first_stop = jnp.argmax(stop_at, axis=1)
  stopped = jnp.any(stop_at, axis=1)
  count = jnp.where(stopped, first_stop + 1, count)
  count = jnp.where(d.finished, 0, jnp.minimum(count, d.remaining))
  remaining = d.remaining - count
  last = jnp.take_along_axis(result.tokens, jnp.maximum(count - 1, 0)[:, None],
                             axis=1)[:, 0]
  finished = (d.finished | stopped | ~emitting_valid | (remaining <= 0))
  processors = d.processors
  for i in range(k + 1 if processors is not None else 0):
    processors = processors.append_output(result.tokens[:, i], i < count)
  decode = dataclasses.replace(
      d, tokens=jnp.where(count > 0, last, d.tokens),
      positions=d.positions + count, finished=finished, remaining=remaining,
      cache=cache, processors=processors)
  history = write_history(state.history, result.tokens, d.positions + 1, count)
  emitted = slots[None] < count[:, None]
  out = SpecOutput(tokens=jnp.where(emitted, result.tokens, -1),
                   logprobs=jnp.where(emitted, result.logprobs, 0.0),
                   count=count, drafted=num, accepted=j, mask=masks)
  return SpecState(decode, history, own), out
