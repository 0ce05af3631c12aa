"""The serving loop's slot state and its jitted programs.

The device state is a ``DecodeState`` (plain decoding) or a ``SpecState``
(speculative) of ``slots`` rows whose shapes never change; ``empty_state``
builds it with every slot finished (free).

* ``prompt``: runs a batch of prompts through the model on a fresh cache
  (and the drafter's prefill): the only program compiled per prompt width,
  and the only one without the sampler;
* ``admit``: samples each sample's first token from its prompt's logits
  (the ``n`` samples of a request share one prompt row) and scatters the
  rows into the chosen slots;
* ``step``: ``steps`` decode (or speculative) steps of every slot in a
  ``lax.scan``.

With logits processors every slot carries a ``LogitsProcessors`` row
(``admission.slot_processors``: fixed widths, neutral where unused); the
grammar ``bitmask`` rows of a step are the host's argument to ``step``.

``admit`` and ``step`` return the new state (the old one is donated) and an
``Output``.  ``programs`` gives the three jitted for one static setup
(model, drafter, sampler config, outputs, steps, cache length and the
weights' tree structures), with the weights passed as flat lists of arrays:
a call then hashes no static argument and flattens no ``nnx.State``
(together ~1 ms of host time per call on the embedded model), and loops
with the same setup share the compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.generation.spec_step import SpecState, spec_step, write_history
from jaxsample.generation.step import (DecodeState, decode_step, emit,
                                       prompt_logits)
from jaxsample._src.logprobs import TokenLogprobs
from jaxsample._src.mask import SamplingMask
from jaxsample._src.params import SamplingParams

__all__ = ["Output", "Programs", "admit", "empty_state", "pack", "programs",
           "prompt", "scatter_rows", "step"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Output:
  """What one program emitted for ``n`` steps of ``R`` rows of up to ``E``
  tokens: ``table`` int32 ``[n, R, 2E + 4]`` (``pack``: one array, one copy
  to the host), ``mask`` ``[n, E, R, ...]`` or None, ``top`` ``[n, R, ...]``
  or None (``E = 1``).  The properties read a host (numpy) copy's table."""

  table: jax.Array
  mask: SamplingMask | None
  top: TokenLogprobs | None

  @property
  def width(self) -> int:
    return (self.table.shape[-1] - 4) // 2

  @property
  def tokens(self) -> np.ndarray:
    """``[n, R, E]`` tokens (the first ``count`` emitted)."""
    return self.table[..., :self.width]

  @property
  def logprobs(self) -> np.ndarray:
    """``[n, R, E]`` fp32 logprobs."""
    return self.table[..., self.width:2 * self.width].view(np.float32)

  @property
  def count(self) -> np.ndarray:
    """``[n, R]`` tokens emitted per step and row."""
    return self.table[..., -4]

  @property
  def drafted(self) -> np.ndarray:
    """``[n, R]`` drafts verified per step and row."""
    return self.table[..., -3]

  @property
  def accepted(self) -> np.ndarray:
    """``[n, R]`` drafts accepted per step and row."""
    return self.table[..., -2]

  @property
  def finished(self) -> np.ndarray:
    """``[R]`` bool: the row's request finished (after the last step)."""
    return self.table[-1, :, -1].astype(bool)

  def emitted(self) -> tuple[np.ndarray, list[int], list[int], list[float]]:
    """``(emitted, sizes, tokens, logprobs)``: ``emitted`` bool ``[n, R,
    E]`` (the entries emitted), ``sizes[r]`` row ``r``'s count, and the
    emitted tokens and logprobs of row 0, then row 1, .. each in one list
    (one conversion; row ``r``'s are the next ``sizes[r]``)."""
    steps, rows, width = self.tokens.shape
    emitted = np.arange(width) < self.count[..., None]
    flags = emitted.transpose(1, 0, 2).reshape(rows, steps * width)
    values = lambda a: a.transpose(1, 0, 2).reshape(
        rows, steps * width)[flags].tolist()
    return (emitted, flags.sum(axis=1).tolist(), values(self.tokens),
            values(self.logprobs))


def pack(tokens, logprobs, count, drafted, accepted, finished) -> jax.Array:
  """``Output.table`` rows ``[..., 2E + 4]`` int32 from ``tokens`` and fp32
  ``logprobs`` ``[..., E]`` (their bits) and ``count``, ``drafted``,
  ``accepted``, ``finished`` ``[...]``."""
  scalars = [a.astype(jnp.int32)[..., None]
             for a in (count, drafted, accepted, finished)]
  return jnp.concatenate(
      [tokens.astype(jnp.int32),
       jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32), jnp.int32),
       *scalars], axis=-1)


def scatter_rows(full, rows, slot_ids):
  """``full`` with ``rows`` (leading axis ``A``) written at ``slot_ids``
  (entries ``>= B`` dropped)."""
  return jax.tree.map(lambda f, r: f.at[slot_ids].set(r, mode="drop"),
                      full, rows)


def prompt(lm, drafter, cache_len, weights, draft_weights, tokens, lengths):
  """Left-aligned prompts ``tokens`` ``[A, P]`` of ``lengths`` on fresh
  caches of ``cache_len`` positions: ``(last tokens, cache, logits,
  history, drafter state)`` (``prompt_logits``; the token history and the
  drafter's state after the prompts with a ``drafter``, else None)."""
  rows = tokens.shape[0]
  last, cache, logits = prompt_logits(
      lm, weights, tokens, lengths - 1,
      lm.init_cache(weights, rows, cache_len))
  history = own = None
  if drafter is not None:
    history = write_history(jnp.zeros((rows, cache_len), jnp.int32), tokens,
                            jnp.zeros_like(lengths), lengths)
    own = drafter.prefill(draft_weights,
                          drafter.init(draft_weights, rows, cache_len),
                          tokens, lengths)
  return last, cache, logits, history, own


def admit(drafter, config, outputs, state, slot_ids, sources, prompted,
          lengths, params, keys, stop_ids, budgets, processors):
  """Samples the first tokens of ``prompt``'s output ``prompted``, row
  ``j`` from its row ``sources[j]`` (samples of one prompt share it), with
  ``lengths``, ``params``, ``keys``, ``stop_ids``, ``budgets`` and
  ``processors`` and writes the rows into ``state`` at ``slot_ids``
  (entries ``>= slots`` dropped)."""
  return_mask, num_top, mode = outputs
  last, cache, logits, history, own = jax.tree.map(lambda a: a[sources],
                                                   prompted)
  prompts = DecodeState(
      tokens=last, positions=lengths - 1, keys=keys, params=params,
      finished=budgets <= 0, stop_tokens=stop_ids, remaining=budgets,
      cache=cache, processors=processors)
  fresh, out = emit(prompts, logits, config=config, return_mask=return_mask,
                    num_top=num_top, logprob_mode=mode)
  if drafter is not None:
    history = write_history(history, out.tokens[:, None], lengths,
                            out.valid.astype(jnp.int32))
    fresh = SpecState(fresh, history, own)
  state = scatter_rows(state, fresh, slot_ids)
  zeros = jnp.zeros(out.tokens.shape, jnp.int32)
  mask = None if out.mask is None else jax.tree.map(
      lambda a: a[None, None], out.mask)
  table = pack(out.tokens[:, None], out.logprobs[:, None], out.valid, zeros,
               zeros, (fresh.decode if drafter else fresh).finished)
  return state, Output(table[None], mask,
                       jax.tree.map(lambda a: a[None], out.top))


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
      return state, (pack(out.tokens[:, None], out.logprobs[:, None],
                          out.valid, zeros, zeros, state.finished), mask,
                     out.top)
    state, out = spec_step(lm, weights, drafter, draft_weights, state,
                           config=config, return_mask=return_mask,
                           synthetic_rates=synthetic_rates)
    return state, (pack(out.tokens, out.logprobs, out.count, out.drafted,
                        out.accepted, state.decode.finished), out.mask, None)

  state, (table, mask, top) = jax.lax.scan(one, state, None, length=steps)
  return state, Output(table, mask, top)


@dataclasses.dataclass(frozen=True)
class Programs:
  """The programs jitted for one setup (``programs``), called as
  ``prompt(weight_leaves, draft_leaves, tokens, lengths)``,
  ``admit(state, slot_ids, sources, prompted, lengths, params, keys,
  stop_ids, budgets, processors)`` and ``step(state, weight_leaves, draft_leaves,
  synthetic_rates, bitmask)``; ``state`` is donated."""

  prompt: Callable
  admit: Callable
  step: Callable


@functools.lru_cache(maxsize=64)
def programs(lm, drafter, config, outputs, steps: int, cache_len: int,
             weights_def, draft_def) -> Programs:
  """The ``Programs`` of a setup; ``weights_def`` and ``draft_def`` are the
  tree structures of the weights and the draft weights
  (``jax.tree.flatten``).  Cached: equal setups get the same programs."""
  unflatten = lambda leaves, draft_leaves: (
      jax.tree.unflatten(weights_def, leaves),
      jax.tree.unflatten(draft_def, draft_leaves))

  def prompt_leaves(leaves, draft_leaves, tokens, lengths):
    return prompt(lm, drafter, cache_len, *unflatten(leaves, draft_leaves),
                  tokens, lengths)

  def step_leaves(state, leaves, draft_leaves, rates, bitmask):
    return step(lm, drafter, config, outputs, steps,
                *unflatten(leaves, draft_leaves), state, rates, bitmask)

  return Programs(jax.jit(prompt_leaves),
                  jax.jit(functools.partial(admit, drafter, config, outputs),
                          donate_argnums=(0,)),
                  jax.jit(step_leaves, donate_argnums=(0,)))


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
