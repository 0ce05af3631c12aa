"""The serving loop's slot state and its two jitted programs.

The device state is a ``DecodeState`` (plain decoding) or a ``SpecState``
(speculative) of ``slots`` rows whose shapes never change; ``empty_state``
builds it with every slot finished (free).

* ``admit``: prefills a batch of prompts on a fresh cache, samples each first
  token and scatters the rows into the chosen slots;
* ``step``: ``steps`` decode (or speculative) steps of every slot in a
  ``lax.scan``.

With logits processors every slot carries a ``LogitsProcessors`` row
(``admission.slot_processors``: fixed widths, neutral where unused); the
grammar ``bitmask`` rows of a step are the host's argument to ``step``.

Both return the new state (the old one is donated) and an ``Output``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxsample.generation.spec_step import SpecState, spec_step, write_history
from jaxsample.generation.step import DecodeState, decode_step, prefill
from jaxsample.logprobs import TokenLogprobs
from jaxsample.mask import SamplingMask
from jaxsample.params import SamplingParams

__all__ = ["Output", "admit", "empty_state", "scatter_rows", "step"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Output:
  """What one program emitted: ``tokens``/``logprobs`` ``[n, R, E]``,
  ``count``/``drafted``/``accepted`` ``[n, R]`` for ``n`` steps of ``R`` rows
  of up to ``E`` tokens, ``finished`` ``[R]`` after them, ``mask``
  ``[n, E, R, ...]`` or None, ``top`` ``[n, R, ...]`` or None (``E = 1``)."""

  tokens: jax.Array
  logprobs: jax.Array
  count: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  finished: jax.Array
  mask: SamplingMask | None
  top: TokenLogprobs | None


def scatter_rows(full, rows, slot_ids):
  """``full`` with ``rows`` (leading axis ``A``) written at ``slot_ids``
  (entries ``>= B`` dropped)."""
  return jax.tree.map(lambda f, r: f.at[slot_ids].set(r, mode="drop"),
                      full, rows)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(7,))
def admit(lm, drafter, config, outputs, cache_len, weights, draft_weights,
          state, slot_ids, tokens, lengths, params, keys, stop_ids, budgets,
          processors):
  return_mask, num_top, mode = outputs
  prompts = DecodeState(
      tokens=tokens, positions=lengths - 1, keys=keys, params=params,
      finished=budgets <= 0, stop_tokens=stop_ids, remaining=budgets,
      cache=lm.init_cache(weights, tokens.shape[0], cache_len),
      processors=processors)
  fresh, out = prefill(lm, weights, prompts, config=config,
                       return_mask=return_mask, num_top=num_top,
                       logprob_mode=mode)
  if drafter is not None:
    history = jnp.zeros((tokens.shape[0], cache_len), jnp.int32)
    history = write_history(history, tokens, jnp.zeros_like(lengths), lengths)
    history = write_history(history, out.tokens[:, None], lengths,
                            out.valid.astype(jnp.int32))
    own = drafter.prefill(draft_weights,
                          drafter.init(draft_weights, tokens.shape[0],
                                       cache_len), tokens, lengths)
    fresh = SpecState(fresh, history, own)
  state = scatter_rows(state, fresh, slot_ids)
  zeros = jnp.zeros(out.tokens.shape, jnp.int32)[None]
  mask = None if out.mask is None else jax.tree.map(
      lambda a: a[None, None], out.mask)
  return state, Output(out.tokens[None, :, None], out.logprobs[None, :, None],
                       out.valid.astype(jnp.int32)[None], zeros, zeros,
                       (fresh.decode if drafter else fresh).finished, mask,
                       jax.tree.map(lambda a: a[None], out.top))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(7,))
def step(lm, drafter, config, outputs, steps, weights, draft_weights,
         state, synthetic_rates, bitmask):
  return_mask, num_top, mode = outputs
  if bitmask is not None:  # plain decoding, one step: this step's masks
    state = dataclasses.replace(state, processors=dataclasses.replace(
        state.processors, bitmask=bitmask))

  def one(state, _):
    if drafter is None:
      state, out = decode_step(lm, weights, state, config=config,
                               return_mask=return_mask, num_top=num_top,
                               logprob_mode=mode)
      zeros = jnp.zeros(out.tokens.shape, jnp.int32)
      mask = None if out.mask is None else jax.tree.map(lambda a: a[None],
                                                        out.mask)
      return state, (out.tokens[:, None], out.logprobs[:, None],
                     out.valid.astype(jnp.int32), zeros, zeros, mask, out.top)
    state, out = spec_step(lm, weights, drafter, draft_weights, state,
                           config=config, return_mask=return_mask,
                           synthetic_rates=synthetic_rates)
    return state, (out.tokens, out.logprobs, out.count, out.drafted,
                   out.accepted, out.mask, None)

  state, (tokens, logprobs, count, drafted, accepted, mask, top) = (
      jax.lax.scan(one, state, None, length=steps))
  finished = (state if drafter is None else state.decode).finished
  return state, Output(tokens, logprobs, count, drafted, accepted, finished,
                       mask, top)


def empty_state(lm, weights, slots: int, max_stop_tokens: int, length: int,
                drafter=None, draft_weights=None, processors=None):
  """The state of ``slots`` free (finished) slots with caches of ``length``
  positions and the given neutral ``processors`` rows (or None); a
  ``SpecState`` with a ``drafter``."""
  state = DecodeState(
      tokens=jnp.zeros((slots,), jnp.int32),
      positions=jnp.zeros((slots,), jnp.int32),
      keys=jnp.zeros((slots, 2), jnp.uint32),
      params=SamplingParams.make(slots, temperature=0.0),
      finished=jnp.ones((slots,), bool),
      stop_tokens=jnp.full((slots, max_stop_tokens), -1, jnp.int32),
      remaining=jnp.zeros((slots,), jnp.int32),
      cache=lm.init_cache(weights, slots, length),
      processors=jax.tree.map(jnp.asarray, processors))
  if drafter is None:
    return state
  return SpecState(state, jnp.zeros((slots, length), jnp.int32),
                   drafter.init(draft_weights, slots, length))
