"""The decode state and the pure decode step (``jaxsample.serve_loop``).

A ``DecodeState`` describes ``B`` slots.  Slot ``b`` holds a request whose
last token ``tokens[b]`` sits at sequence position ``positions[b]`` and is not
yet in the cache.  ``decode_step`` feeds it to the model (writing its cache
entry at ``positions[b]``), samples the token at position ``positions[b] + 1``
with the request's key and that position as the noise counter, and advances
the slot.  The sampled token depends only on the slot's key, position,
parameters and sequence, so a replay with the same keys reproduces every
token, and neither the slot index nor the other slots matter.

Finished slots (``finished[b]``) still run through the model (fixed shapes)
but emit nothing and keep their state; they are free for a new request,
installed by writing the slot's entries (``DecodeState.replace_slots``).

With ``processors`` (``jaxsample._src.processors``) every step samples from the
processed logits (``sample(..., processors=...)``) and appends each emitted
token to the slot's output history (``LogitsProcessors.append_output``), so
penalties and min tokens see what the slot generated.  ``emit``'s
``num_top`` and ``logprob_mode`` add top-n logprobs (``jaxsample._src.logprobs``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxsample._src import rng
from jaxsample.generation.lm import LanguageModel
from jaxsample._src.logprobs import TokenLogprobs, token_logprobs
from jaxsample._src.mask import SamplingMask
from jaxsample._src.params import SamplerConfig, SamplingParams
from jaxsample._src.processors import LogitsProcessors
from jaxsample._src.sampling import sample

__all__ = ["DecodeState", "StepOutput", "decode_step", "emit", "prefill",
           "prompt_logits"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Per-slot decode state; every field has the slot axis first.

  Attributes:
    tokens: ``[B]`` int32, each slot's last token (the next model input).
    positions: ``[B]`` int32, the sequence position of ``tokens``.
    keys: ``[B, 2]`` uint32, each request's raw key data (typed keys:
      ``jax.random.key_data``).
    params: ``SamplingParams`` with ``[B]`` fields.
    finished: ``[B]`` bool; finished slots emit nothing.
    stop_tokens: ``[B, S]`` int32 stop ids per slot, -1 padding.
    remaining: ``[B]`` int32, tokens the slot may still emit (the slot
      finishes when it reaches 0).
    cache: the model's cache pytree (``[B, ...]`` leaves).
    processors: per-slot ``LogitsProcessors`` (``[B, ...]`` leaves; build
      them with ``LogitsProcessors.make(..., history_width=W)`` so the
      output history has room and ``num_output`` is tracked), or None.
  """

  tokens: jax.Array
  positions: jax.Array
  keys: jax.Array
  params: SamplingParams
  finished: jax.Array
  stop_tokens: jax.Array
  remaining: jax.Array
  cache: Any
  processors: LogitsProcessors | None = None

  def replace_slots(self, where: jax.Array, other: "DecodeState"
                    ) -> "DecodeState":
    """This state with the slots where ``where`` ``[B]`` is True taken from
    ``other`` (same shapes): how a serving loop admits requests between
    steps without changing any shape."""
    def pick(mine, theirs):
      mask = where.reshape(where.shape + (1,) * (mine.ndim - 1))
      return jnp.where(mask, theirs, mine)
    return jax.tree.map(pick, self, other)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
  """What one step emitted, per slot.

  Attributes:
    tokens: ``[B]`` int32 sampled tokens (meaningful where ``valid``).
    logprobs: ``[B]`` fp32 log-probability of each token under the slot's
      processed (tempered, truncated, renormalized) distribution.
    valid: ``[B]`` bool, the slot was active and emitted ``tokens[b]``.
    mask: the ``SamplingMask`` of the kept sets (with ``return_mask``), else
      None.
    top: ``TokenLogprobs`` of the tokens (with ``num_top``: the token's
      value and rank and the top ``num_top`` in ``logprob_mode``), else None.
  """

  tokens: jax.Array
  logprobs: jax.Array
  valid: jax.Array
  mask: SamplingMask | None = None
  top: TokenLogprobs | None = None


def emit(state: DecodeState, logits: jax.Array, *,
         config: SamplerConfig | None = None, return_mask: bool = False,
         num_top: int = 0, logprob_mode: str | None = None
         ) -> tuple[DecodeState, StepOutput]:
  """Samples each slot's next token from ``logits`` ``[B, V]`` and advances.

  The token is drawn at noise position ``positions + 1`` with the slot's key
  from the logits processed by ``state.processors``.
  An active slot emits it (``valid``), moves ``tokens``/``positions`` to it,
  spends one unit of ``remaining``, appends it to the processors' output
  history, and finishes on a stop token, an empty budget, or invalid
  (processed) logits (NaN / +inf / no finite entry: nothing emitted).
  ``logprob_mode`` (static, a ``jaxsample._src.logprobs.MODES`` entry) with
  ``num_top`` (static, 0 to 20) fills ``StepOutput.top``.
  """
  new_position = state.positions + 1
  drawn = sample(logits, state.params, state.keys, positions=new_position,
                 config=config, return_mask=return_mask,
                 processors=state.processors)
  result, mask = drawn if return_mask else (drawn, None)
  top = None if logprob_mode is None else token_logprobs(
      logits, state.params, result.tokens, num_top=num_top,
      mode=logprob_mode, processors=state.processors)
  emitted = ~state.finished & result.valid
  remaining = state.remaining - emitted.astype(jnp.int32)
  stopped = jnp.any(state.stop_tokens == result.tokens[:, None], axis=1)
  finished = state.finished | ~result.valid | stopped | (remaining <= 0)
  next_state = dataclasses.replace(
      state,
      tokens=jnp.where(emitted, result.tokens, state.tokens),
      positions=jnp.where(emitted, new_position, state.positions),
      finished=finished,
      remaining=remaining,
      processors=None if state.processors is None else
      state.processors.append_output(result.tokens, emitted))
  return next_state, StepOutput(result.tokens, result.logprobs, emitted, mask,
                                top)


def decode_step(lm: LanguageModel, weights, state: DecodeState, *,
                config: SamplerConfig | None = None,
                return_mask: bool = False, num_top: int = 0,
                logprob_mode: str | None = None
                ) -> tuple[DecodeState, StepOutput]:
  """One decode step for every slot: model forward, then ``emit``.

  Pure and jit-able (``lm``, ``config``, ``return_mask``, ``num_top`` and
  ``logprob_mode`` static); no host
  synchronization.  The caller keeps every active slot's ``positions`` below
  the cache length (``generate`` caps ``remaining`` accordingly).

  Returns:
    ``(next_state, StepOutput)``.
  """
  logits, cache = lm.apply(weights, state.tokens[:, None],
                           state.positions[:, None], state.cache)
  state = dataclasses.replace(state, cache=cache)
  return emit(state, logits[:, 0], config=config, return_mask=return_mask,
              num_top=num_top, logprob_mode=logprob_mode)


def prompt_logits(lm: LanguageModel, weights, tokens: jax.Array,
                  positions: jax.Array, cache
                  ) -> tuple[jax.Array, Any, jax.Array]:
  """``prefill``'s model half: runs left-aligned prompts ``tokens`` ``[B,
  P]`` (each last at index ``positions[b]``) through the model, writing
  ``cache`` positions ``0 .. P - 1``; returns each prompt's last token
  ``[B]``, the cache and the logits at the last token ``[B, V]``."""
  batch, width = tokens.shape
  columns = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  logits, cache = lm.apply(weights, tokens, columns, cache)
  last = jnp.take_along_axis(tokens, positions[:, None], axis=1)[:, 0]
  step_logits = jnp.take_along_axis(logits, positions[:, None, None],
                                    axis=1)[:, 0]
  return last, cache, step_logits


def prefill(lm: LanguageModel, weights, prompts: DecodeState, *,
            config: SamplerConfig | None = None, return_mask: bool = False,
            num_top: int = 0, logprob_mode: str | None = None
            ) -> tuple[DecodeState, StepOutput]:
  """Runs whole prompts through the model, then ``emit``s each first token.

  ``prompts`` is a ``DecodeState`` whose ``tokens`` are ``[B, P]`` prompts,
  left-aligned (padding after each prompt is ignored), and whose
  ``positions`` hold each prompt's last index (``length - 1``); its cache
  must be fresh or the slots' own (positions ``0 .. P - 1`` are written).
  Returns the ready-to-decode state and the first tokens' ``StepOutput``.
  """
  last, cache, logits = prompt_logits(lm, weights, prompts.tokens,
                                      prompts.positions, prompts.cache)
  state = dataclasses.replace(prompts, tokens=last, cache=cache)
  return emit(state, logits, config=config, return_mask=return_mask,
              num_top=num_top, logprob_mode=logprob_mode)


def raw_keys(keys, batch_size: int) -> jax.Array:
  """``[B, 2]`` uint32 key data from ``[B]`` typed keys or raw key data."""
  data = rng.key_words(keys)
  if data.shape != (batch_size, 2):
    raise ValueError(f"keys must be {batch_size} per-request keys ([B] typed "
                     f"keys or [B, 2] uint32 key data); got key data of shape "
                     f"{data.shape}")
  return data
