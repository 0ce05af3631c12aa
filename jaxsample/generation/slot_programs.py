"""The serving loop's slot state, its admission rows and its jitted programs.

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

The host builds the admission program's fixed-shape inputs from a batch of
requests (``admission_inputs``, ``share_prompts``, ``slot_processors``) and
a ``bitmask_fn`` result's packed words (``pack_host_bitmask``).

With logits processors every slot carries a ``LogitsProcessors`` row
(``slot_processors``: fixed widths, neutral where unused); the
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
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.generation.requests import ProcessorLimits, Request
from jaxsample.generation.spec_step import SpecState, spec_step, write_history
from jaxsample.generation.step import (DecodeState, decode_step, emit,
                                       prompt_logits)
from jaxsample._src.logprobs import TokenLogprobs
from jaxsample._src.mask import SamplingMask
from jaxsample._src.params import SamplingParams
from jaxsample._src.processors import (LogitsProcessors, bitmask_width,
                                       neutral_field)

__all__ = ["Output", "Programs", "admission_inputs", "admit", "empty_state",
           "pack", "pack_host_bitmask", "programs", "prompt", "scatter_rows",
           "share_prompts", "slot_processors", "step"]


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


def admission_inputs(batch: Sequence[tuple[Request, int, int]], rows: int,
                     width: int, max_stop_tokens: int):
  """The admission program's inputs for ``(request, budget, sample index)``
  triples in ``rows`` rows (the rest padding) with prompts in ``width``
  columns: ``(tokens, lengths, params, keys, stop_ids, budgets)``; sample
  ``i``'s key is ``[i, seed]``."""
  tokens = np.zeros((rows, width), np.int32)
  lengths = np.ones(rows, np.int32)
  fields = {"temperature": np.zeros(rows, np.float32),
            "top_k": np.zeros(rows, np.int32),
            "top_p": np.ones(rows, np.float32),
            "min_p": np.zeros(rows, np.float32)}
  keys = np.zeros((rows, 2), np.uint32)
  stop_ids = np.full((rows, max_stop_tokens), -1, np.int32)
  budgets = np.zeros(rows, np.int32)
  for row, (request, budget, index) in enumerate(batch):
    tokens[row, :len(request.prompt)] = request.prompt
    lengths[row] = len(request.prompt)
    for name, values in fields.items():
      # top_k beyond int32 means off, as does the clipped value.
      values[row] = np.clip(getattr(request, name), -2**31 + 1, 2**31 - 1)
    keys[row] = index, request.seed
    stop_ids[row, :len(request.stop)] = request.stop
    budgets[row] = budget
  return (tokens, lengths, SamplingParams(**fields), keys, stop_ids, budgets)


def share_prompts(groups: Sequence, tokens: np.ndarray, lengths: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The prompt program's rows for admission rows ``tokens`` ``[A, W]`` and
  ``lengths`` ``[A]`` whose first ``len(groups)`` rows hold samples
  (``groups[j]``: the request of row ``j``; one request's rows hold its
  prompt): ``(prompt tokens, prompt lengths, sources)``, each request's
  prompt once in the first rows (the rest padding), ``sources[j]`` row
  ``j``'s prompt row."""
  rank = {}
  sources = np.arange(len(lengths), dtype=np.int32)  # padding: any row
  for row, group in enumerate(groups):
    sources[row] = rank.setdefault(group, len(rank))
  firsts = [groups.index(group) for group in rank]
  prompts, prompt_lengths = np.zeros_like(tokens), np.ones_like(lengths)
  prompts[:len(firsts)] = tokens[firsts]
  prompt_lengths[:len(firsts)] = lengths[firsts]
  return prompts, prompt_lengths, sources


def slot_processors(limits: ProcessorLimits | None,
                    requests: Sequence[Request], rows: int, *, history: int,
                    stop_width: int, vocab_size: int,
                    bitmasks: Sequence[np.ndarray | None] = ()
                    ) -> LogitsProcessors | None:
  """The ``LogitsProcessors`` (numpy ``[rows, ...]`` fields) of ``requests``
  (checked) in the first rows and neutral padding after: the fields
  ``limits`` enables, id tables of their fixed widths padded with -1, the
  prompt and output histories ``history`` wide, ``bitmasks[row]`` packed
  words (all ids allowed where None or missing).  None without ``limits``."""
  if limits is None:
    return None
  fields = {}

  def neutral(*names, width=None):
    for name in names:
      fields[name] = neutral_field(name, (rows,) if width is None
                                   else (rows, width))

  if limits.penalties:
    neutral("repetition_penalty", "presence_penalty", "frequency_penalty")
    neutral("prompt_ids", "output_ids", width=history)
  if limits.logit_bias:
    neutral("bias_ids", "bias_values", width=limits.logit_bias)
  for name, field in (("allowed_token_ids", "allowed_ids"),
                      ("banned_token_ids", "banned_ids")):
    if getattr(limits, name):
      neutral(field, width=getattr(limits, name))
  if limits.min_tokens:
    neutral("min_tokens")
    neutral("stop_ids", width=stop_width)
  if limits.penalties or limits.min_tokens:
    neutral("num_output")
  if limits.bitmask:
    neutral("bitmask", width=bitmask_width(vocab_size))
  for row, request in enumerate(requests):
    if limits.penalties:
      for name in ("repetition_penalty", "presence_penalty",
                   "frequency_penalty"):
        fields[name][row] = getattr(request, name)
      fields["prompt_ids"][row, :len(request.prompt)] = request.prompt
    if limits.logit_bias and request.logit_bias:
      items = sorted(request.logit_bias.items())
      fields["bias_ids"][row, :len(items)] = [i for i, _ in items]
      fields["bias_values"][row, :len(items)] = [b for _, b in items]
    for name, field in (("allowed_token_ids", "allowed_ids"),
                        ("banned_token_ids", "banned_ids")):
      ids = getattr(request, name)
      if getattr(limits, name) and ids:
        fields[field][row, :len(ids)] = ids
    if limits.min_tokens:
      fields["min_tokens"][row] = request.min_tokens
      fields["stop_ids"][row, :len(request.stop)] = request.stop
    if row < len(bitmasks) and bitmasks[row] is not None:
      fields["bitmask"][row] = bitmasks[row]
  return LogitsProcessors(**fields)


def pack_host_bitmask(allowed, vocab_size: int) -> np.ndarray:
  """``int32 [ceil(V / 32)]`` words of a ``bitmask_fn`` result: bool
  ``[V]`` allowed ids, or packed words (``int32``/``uint32``, also as one
  ``[1, W]`` row, xgrammar's buffer); bit ``j`` of word ``w`` allows id
  ``32 w + j``.  Raises ``ValueError`` for anything else."""
  value = np.asarray(allowed)
  width = bitmask_width(vocab_size)
  if value.ndim == 2 and value.shape[0] == 1:
    value = value[0]
  if value.dtype == bool and value.shape == (vocab_size,):
    bits = np.zeros(32 * width, bool)
    bits[:vocab_size] = value
    return np.packbits(bits, bitorder="little").view("<u4").view(np.int32)
  if value.dtype in (np.int32, np.uint32) and value.shape == (width,):
    return value.view(np.int32)
  if value.dtype.kind in "iu" and value.shape == (width,):
    words = value.astype(np.int64)
    if np.all((words >= -2**31) & (words < 2**32)):
      return (words & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
  raise ValueError(f"bitmask_fn must return bool [{vocab_size}] (allowed ids) "
                   f"or int32 [{width}] packed words; got {value.dtype} "
                   f"{list(value.shape)}")
