"""``ServeLoop``: continuous batching over a fixed number of slots.

The loop owns a device state of ``slots`` decode slots and two jitted
programs whose shapes never change while requests come and go:

* *admit*: up to ``admit_batch`` queued requests, their prompts left-aligned
  in a bucket of ``max(16, next_pow2(longest))`` columns (capped at the cache;
  one compile per bucket, ``warmup`` compiles them all), are prefilled on a
  fresh cache of ``admit_batch`` rows, their first token sampled, and the
  rows scattered into free slots;
* *step*: ``steps_per_call`` decode steps of every slot (``decode_step``), or
  with ``speculation`` that many speculative steps (``spec_step``).

Between calls the host reads the emitted tokens, streams them to each
request (``events``, callbacks), retires finished requests and admits queued
ones into the freed slots.  A request's tokens depend only on its prompt,
seed, parameters, budget and stop ids: plain decoding gives exactly
``generate``'s tokens for the same key (``seed`` ``s`` is the key
``jax.random.PRNGKey(s)``); speculative decoding gives the same tokens for
greedy requests and the same distribution for sampled ones.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.generation.generate import FINISH_REASONS, bucket
from jaxsample.generation.lm import LanguageModel, as_language_model
from jaxsample.generation.spec_step import SpecState, spec_step, write_history
from jaxsample.generation.step import DecodeState, decode_step, prefill
from jaxsample.logprobs import MODES, TokenLogprobs, check_num_top
from jaxsample.mask import SamplingMask
from jaxsample.params import SamplerConfig, SamplingParams, check_setting

__all__ = ["Completion", "Request", "ServeLoop", "Speculation", "StreamEvent"]

MIN_PROMPT = 16
SEED_LIMIT = 2**32


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request (validated by ``ServeLoop.submit``).

  ``seed`` in ``[0, 2^32)`` is the key ``jax.random.PRNGKey(seed)``; the
  request's tokens depend only on it, ``prompt`` and the settings.  Generation
  stops after a token of ``stop`` or after ``max_tokens`` tokens (capped so
  the sequence fits the cache).  ``logprobs`` / ``top_logprobs`` /
  ``return_masks`` choose what the outputs carry (``top_logprobs`` up to the
  loop's ``top_logprobs``; masks need a loop built with
  ``return_masks=True``).
  """

  prompt: Sequence[int]
  max_tokens: int = 16
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int = 0
  stop: Sequence[int] = ()
  logprobs: bool = True
  top_logprobs: int = 0
  return_masks: bool = False
  request_id: Any = None


@dataclasses.dataclass(frozen=True)
class StreamEvent:
  """New tokens of one request (and, on the last event, how it finished).

  ``logprobs`` is None unless the request asked; ``top_logprobs`` (one
  entry per new token: ``{"logprob", "rank", "top"}``, the token's value and
  rank and ``(id, value)`` pairs, in the loop's ``logprobs_mode``) unless it
  asked for ``top_logprobs``; ``sampling_mask`` and
  ``logz`` (one entry per new token: the kept ids, or None where nothing was
  truncated; ``SamplingMask.to_lists``) are None unless it asked for masks.
  ``completion`` is set on the final event.
  """

  request_id: Any
  token_ids: list[int]
  logprobs: list[float] | None = None
  top_logprobs: list[dict] | None = None
  sampling_mask: list | None = None
  logz: list[float] | None = None
  finish_reason: str | None = None
  completion: "Completion | None" = None


@dataclasses.dataclass
class Completion:
  """A finished request: OpenAI-like fields plus speculation statistics.

  ``drafted`` / ``accepted`` count the draft tokens proposed for and accepted
  by the request's verification steps (0 without speculation);
  ``acceptance_rate`` is their ratio (None when nothing was drafted).
  """

  request_id: Any
  prompt_tokens: int
  token_ids: list[int]
  logprobs: list[float] | None
  sampling_mask: list | None
  logz: list[float] | None
  top_logprobs: list[dict] | None = None
  finish_reason: str | None = None
  drafted: int = 0
  accepted: int = 0

  @property
  def acceptance_rate(self) -> float | None:
    return self.accepted / self.drafted if self.drafted else None

  def to_openai(self, tokenizer=None) -> dict:
    """An OpenAI-like choice: ``token_ids``, ``text`` (with a tokenizer that
    has ``decode``), ``logprobs``, ``sampling_mask``, ``logz`` (when asked),
    ``finish_reason`` and ``usage`` (with speculation statistics)."""
    choice = {"id": self.request_id, "token_ids": list(self.token_ids),
              "finish_reason": self.finish_reason}
    if tokenizer is not None:
      choice["text"] = tokenizer.decode(self.token_ids)
    for name in ("logprobs", "top_logprobs", "sampling_mask", "logz"):
      if getattr(self, name) is not None:
        choice[name] = getattr(self, name)
    choice["usage"] = {"prompt_tokens": self.prompt_tokens,
                       "completion_tokens": len(self.token_ids),
                       "draft_tokens": self.drafted,
                       "accepted_draft_tokens": self.accepted}
    return choice


@dataclasses.dataclass(frozen=True)
class Speculation:
  """Speculative decoding in the loop.

  Attributes:
    drafter: an ``NgramDrafter`` or ``ModelDrafter`` (``drafters``).
    draft_weights: the draft model's weights (``ModelDrafter``), else None.
    synthetic_rates: ``k`` per-position acceptance probabilities for
      benchmarks (``jaxsample.spec``, synthetic mode), else None.
  """

  drafter: Any
  draft_weights: Any = None
  synthetic_rates: Sequence[float] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Output:
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


def _scatter_rows(full, rows, slot_ids):
  """``full`` with ``rows`` (leading axis ``A``) written at ``slot_ids``
  (entries ``>= B`` dropped)."""
  return jax.tree.map(lambda f, r: f.at[slot_ids].set(r, mode="drop"),
                      full, rows)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(7,))
def _admit(lm, drafter, config, outputs, cache_len, weights, draft_weights,
           state, slot_ids, tokens, lengths, params, keys, stop_ids, budgets):
  return_mask, num_top, mode = outputs
  prompts = DecodeState(
      tokens=tokens, positions=lengths - 1, keys=keys, params=params,
      finished=budgets <= 0, stop_tokens=stop_ids, remaining=budgets,
      cache=lm.init_cache(weights, tokens.shape[0], cache_len))
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
  state = _scatter_rows(state, fresh, slot_ids)
  zeros = jnp.zeros(out.tokens.shape, jnp.int32)[None]
  mask = None if out.mask is None else jax.tree.map(
      lambda a: a[None, None], out.mask)
  return state, _Output(out.tokens[None, :, None], out.logprobs[None, :, None],
                        out.valid.astype(jnp.int32)[None], zeros, zeros,
                        (fresh.decode if drafter else fresh).finished, mask,
                        jax.tree.map(lambda a: a[None], out.top))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(7,))
def _step(lm, drafter, config, outputs, steps, weights, draft_weights,
          state, synthetic_rates):
  return_mask, num_top, mode = outputs

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
  return state, _Output(tokens, logprobs, count, drafted, accepted, finished,
                        mask, top)


@dataclasses.dataclass
class _Active:
  """Host bookkeeping of a request in a slot."""

  request: Request
  budget: int
  completion: Completion
  callback: Callable[[StreamEvent], None] | None


class ServeLoop:
  """Continuous batching over ``slots`` slots (module doc).

  Args:
    model: a Flax NNX module or a ``(LanguageModel, weights)`` pair.
    slots: decode slots (the step's batch).
    cache_len: cached positions per sequence (default: the model's
      ``max_len``); a prompt needs fewer tokens than this.
    config: static ``SamplerConfig`` of every sampling call.
    return_masks: compute sampling masks (requests may then ask for them).
    max_stop_tokens: stop ids a request may give.
    admit_batch: prompts prefilled per admission call (default
      ``min(slots, 8)``).
    steps_per_call: decode (or speculative) steps per jitted call (more
      amortizes the host round trip; retirement waits for the call's end).
    speculation: a ``Speculation``, or None for plain decoding.
    top_logprobs: the most top logprobs a request may ask for (0 to 20;
      plain decoding only).
    logprobs_mode: the values ``top_logprobs`` report, one of
      ``jaxsample.logprobs.MODES`` (vLLM's ``logprobs_mode``).
  """

  def __init__(self, model, *, slots: int = 8, cache_len: int | None = None,
               config: SamplerConfig | None = None, return_masks: bool = False,
               max_stop_tokens: int = 4, admit_batch: int | None = None,
               steps_per_call: int = 1, speculation: Speculation | None = None,
               top_logprobs: int = 0, logprobs_mode: str = "raw_logprobs"):
    self.lm, self.weights = as_language_model(model)
    self.cache_len = cache_len or self.lm.max_len
    if not self.cache_len or self.cache_len < 2:
      raise ValueError("cache_len must be >= 2 (or the model needs max_len)")
    if slots < 1 or steps_per_call < 1 or max_stop_tokens < 1:
      raise ValueError("slots, steps_per_call and max_stop_tokens must be >= 1")
    self.slots = slots
    self.config = config or SamplerConfig()
    self.return_masks = bool(return_masks)
    self.max_stop_tokens = max_stop_tokens
    self.admit_batch = admit_batch or min(slots, 8)
    self.steps_per_call = steps_per_call
    self.speculation = speculation
    self.drafter = speculation.drafter if speculation else None
    extra = self.drafter.num_draft if self.drafter else 0
    self._state_len = self.cache_len + extra
    self._draft_weights = speculation.draft_weights if speculation else None
    self._rates = (None if speculation is None or
                   speculation.synthetic_rates is None else
                   jnp.asarray(speculation.synthetic_rates, jnp.float32))
    if self._rates is not None and self._rates.shape != (extra,):
      raise ValueError(f"synthetic_rates needs {extra} rates (one per draft "
                       f"position); got shape {self._rates.shape}")
    self.vocab_size = self._probe_vocab()
    self.top_logprobs = check_num_top(top_logprobs, self.vocab_size)
    if logprobs_mode not in MODES:
      raise ValueError(f"logprobs_mode must be one of {MODES}; got "
                       f"{logprobs_mode!r}")
    if top_logprobs and speculation is not None:
      raise ValueError("top_logprobs needs plain decoding (speculation=None)")
    self._outputs = (self.return_masks, self.top_logprobs,
                     logprobs_mode if top_logprobs else None)
    self._queue: collections.deque = collections.deque()
    self._active: list[_Active | None] = [None] * slots
    self._ids = itertools.count()
    self._state = self._empty_state()
    self.stats = collections.Counter()
    """Counts (``admit_calls``, ``step_calls``, ``tokens``, ``completed``,
    ``drafted``, ``accepted``) and seconds: ``device_s`` from each jitted
    call's dispatch until its outputs are ready, ``busy_s`` in ``step``
    altogether (the difference is host work: bookkeeping, inputs,
    transfers, events)."""

  # -- requests ------------------------------------------------------------

  def submit(self, request: Request,
             callback: Callable[[StreamEvent], None] | None = None):
    """Validates ``request`` and queues it; returns its id (``request_id``
    or a fresh int).  ``callback`` gets each of its ``StreamEvent``s.

    Raises:
      ValueError: naming the field, for an empty prompt, a prompt of
        ``cache_len`` tokens or more, ids outside the vocabulary, unknown or
        too many stop ids, a bad budget or seed, invalid sampling settings,
        or masks from a loop built without them.  Nothing in flight changes.
    """
    prompt = np.asarray(request.prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not (
        np.issubdtype(prompt.dtype, np.integer)):
      raise ValueError(f"prompt must be a non-empty sequence of token ids; got "
                       f"{request.prompt!r}")
    if prompt.size >= self.cache_len:
      raise ValueError(f"prompt has {prompt.size} tokens; at most "
                       f"{self.cache_len - 1} fit the cache (cache_len "
                       f"{self.cache_len})")
    self._check_ids("prompt", prompt)
    stop = np.asarray(request.stop, np.int64).reshape(-1)
    if stop.size > self.max_stop_tokens:
      raise ValueError(f"stop has {stop.size} ids; this loop takes at most "
                       f"{self.max_stop_tokens} (max_stop_tokens)")
    self._check_ids("stop", stop)
    budget = request.max_tokens
    if isinstance(budget, bool) or not isinstance(
        budget, (int, np.integer)) or budget < 0:
      raise ValueError(f"max_tokens must be an int >= 0; got {budget!r}")
    seed = request.seed
    if isinstance(seed, bool) or not isinstance(
        seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT:
      raise ValueError(f"seed must be an int in [0, 2^32); got {seed!r}")
    rid = request.request_id
    for name in ("temperature", "top_k", "top_p", "min_p"):
      check_setting(name, "new" if rid is None else rid, getattr(request, name))
    if request.return_masks and not self.return_masks:
      raise ValueError("return_masks needs a ServeLoop built with "
                       "return_masks=True")
    top = request.top_logprobs
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or (
        not 0 <= top <= self.top_logprobs):
      raise ValueError(f"top_logprobs must be an int in [0, "
                       f"{self.top_logprobs}] (the loop's top_logprobs); got "
                       f"{top!r}")
    if rid is None:
      rid = next(self._ids)
      request = dataclasses.replace(request, request_id=rid)
    self._queue.append((request, min(int(budget),
                                     self.cache_len - prompt.size), callback))
    return rid

  @property
  def pending(self) -> int:
    """Requests queued or in a slot."""
    return len(self._queue) + sum(a is not None for a in self._active)

  def step(self) -> list[StreamEvent]:
    """Admits queued requests into free slots, runs one step call if any
    slot is busy, and returns the events it produced."""
    start = time.perf_counter()
    events = []
    while self._queue and None in self._active:
      events += self._admit_some()
    if any(a is not None for a in self._active):
      out = self._timed(_step, self.lm, self.drafter, self.config,
                        self._outputs, self.steps_per_call, self.weights,
                        self._draft_weights, self._state, self._rates)
      events += self._collect(out, list(range(self.slots)))
      self.stats["step_calls"] += 1
    self.stats["busy_s"] += time.perf_counter() - start
    return events

  def events(self) -> Iterator[StreamEvent]:
    """Steps until nothing is pending, yielding every event in order."""
    while self.pending:
      yield from self.step()

  def run(self, requests: Sequence[Request]) -> list[Completion]:
    """Submits ``requests``, runs them to completion and returns their
    ``Completion``s in request order."""
    ids = [self.submit(r) for r in requests]
    done = {e.request_id: e.completion for e in self.events()
            if e.completion is not None}
    return [done[i] for i in ids]

  def warmup(self, max_prompt_len: int | None = None) -> None:
    """Compiles the step and the admission of every prompt bucket up to
    ``max_prompt_len``'s (default: all); requests are not affected (the
    admitted rows go nowhere)."""
    last = min(bucket(max_prompt_len or self.cache_len, MIN_PROMPT),
               self.cache_len)
    width = MIN_PROMPT
    while True:
      width = min(width, last)
      self._call_admit(np.full(self.admit_batch, self.slots, np.int32),
                       self._admission_inputs([], width))
      if width >= last:
        break
      width *= 2
    self._timed(_step, self.lm, self.drafter, self.config,
                self._outputs, self.steps_per_call, self.weights,
                self._draft_weights, self._state, self._rates)
    self.stats.clear()

  # -- internals -----------------------------------------------------------

  def _probe_vocab(self) -> int:
    shape = jax.eval_shape(
        lambda w: self.lm.apply(w, jnp.zeros((1, 1), jnp.int32),
                                jnp.zeros((1, 1), jnp.int32),
                                self.lm.init_cache(w, 1, self.cache_len)),
        self.weights)
    return shape[0].shape[-1]

  def _check_ids(self, name: str, ids: np.ndarray) -> None:
    bad = ids[(ids < 0) | (ids >= self.vocab_size)]
    if bad.size:
      raise ValueError(f"{name} has token id {int(bad[0])} outside the "
                       f"vocabulary [0, {self.vocab_size})")

  def _empty_state(self):
    n = self.slots
    state = DecodeState(
        tokens=jnp.zeros((n,), jnp.int32), positions=jnp.zeros((n,), jnp.int32),
        keys=jnp.zeros((n, 2), jnp.uint32),
        params=SamplingParams.make(n, temperature=0.0),
        finished=jnp.ones((n,), bool),
        stop_tokens=jnp.full((n, self.max_stop_tokens), -1, jnp.int32),
        remaining=jnp.zeros((n,), jnp.int32),
        cache=self.lm.init_cache(self.weights, n, self._state_len))
    if self.drafter is None:
      return state
    return SpecState(state, jnp.zeros((n, self._state_len), jnp.int32),
                     self.drafter.init(self._draft_weights, n,
                                       self._state_len))

  def _admission_inputs(self, batch, width: int):
    a, st = self.admit_batch, self.max_stop_tokens
    tokens = np.zeros((a, width), np.int32)
    lengths = np.ones(a, np.int32)
    fields = {"temperature": np.zeros(a, np.float32),
              "top_k": np.zeros(a, np.int32), "top_p": np.ones(a, np.float32),
              "min_p": np.zeros(a, np.float32)}
    keys = np.zeros((a, 2), np.uint32)
    stop_ids = np.full((a, st), -1, np.int32)
    budgets = np.zeros(a, np.int32)
    for row, (request, budget, _) in enumerate(batch):
      tokens[row, :len(request.prompt)] = request.prompt
      lengths[row] = len(request.prompt)
      for name, values in fields.items():
        # top_k beyond int32 means off, as does the clipped value.
        values[row] = np.clip(getattr(request, name), -2**31 + 1, 2**31 - 1)
      keys[row, 1] = request.seed
      stop_ids[row, :len(request.stop)] = request.stop
      budgets[row] = budget
    return (tokens, lengths, SamplingParams(**fields), keys, stop_ids,
            budgets)

  def _timed(self, program, *args) -> _Output:
    """Runs ``program`` (new state and output), waits for it, counts its
    time in ``stats["device_s"]`` and returns the output."""
    start = time.perf_counter()
    self._state, out = jax.block_until_ready(program(*args))
    self.stats["device_s"] += time.perf_counter() - start
    return out

  def _call_admit(self, slot_ids, inputs) -> _Output:
    return self._timed(_admit, self.lm, self.drafter, self.config,
                       self._outputs, self._state_len, self.weights,
                       self._draft_weights, self._state, slot_ids, *inputs)

  def _admit_some(self) -> list[StreamEvent]:
    free = [s for s, a in enumerate(self._active) if a is None]
    batch = [self._queue.popleft()
             for _ in range(min(len(free), self.admit_batch, len(self._queue)))]
    width = min(bucket(max(len(r.prompt) for r, _, _ in batch), MIN_PROMPT),
                self.cache_len)
    slot_ids = np.full(self.admit_batch, self.slots, np.int32)
    slot_ids[:len(batch)] = free[:len(batch)]
    for (request, budget, callback), slot in zip(batch, free):
      self._active[slot] = _Active(request, budget, Completion(
          request.request_id, len(request.prompt), [],
          [] if request.logprobs else None,
          [] if request.return_masks else None,
          [] if request.return_masks else None,
          [] if request.top_logprobs else None), callback)
    out = self._call_admit(slot_ids, self._admission_inputs(batch, width))
    self.stats["admit_calls"] += 1
    return self._collect(out, free[:len(batch)])

  def _collect(self, out: _Output, slots: list[int]) -> list[StreamEvent]:
    """Events of the rows of ``out`` (row ``r`` is slot ``slots[r]``)."""
    want_masks = out.mask is not None and any(
        self._active[s] is not None and self._active[s].request.return_masks
        for s in slots)
    host = jax.device_get(dataclasses.replace(
        out, mask=out.mask if want_masks else None))
    emitted = np.arange(host.tokens.shape[2]) < host.count[..., None]
    drafted, accepted = host.drafted.sum(0), host.accepted.sum(0)
    self.stats["drafted"] += int(drafted.sum())
    self.stats["accepted"] += int(accepted.sum())
    events = []
    busy = np.flatnonzero((host.count.sum(axis=0) > 0) | host.finished)
    for row in busy[busy < len(slots)].tolist():
      slot = slots[row]
      active = self._active[slot]
      if active is None:
        continue
      active.completion.drafted += int(drafted[row])
      active.completion.accepted += int(accepted[row])
      event = self._advance(active, host, row, emitted[:, row])
      if host.finished[row]:
        self._finish(active)
        self._active[slot] = None
        event = dataclasses.replace(
            event, finish_reason=active.completion.finish_reason,
            completion=active.completion)
      if event.token_ids or event.finish_reason:
        events.append(event)
        if active.callback is not None:
          active.callback(event)
    return events

  def _advance(self, active: _Active, host: _Output, row: int,
               emitted: np.ndarray) -> StreamEvent:
    """Appends row ``row``'s tokens (``emitted`` ``[n, E]`` of them) to the
    request's completion and returns the event."""
    request, done = active.request, active.completion
    tokens = host.tokens[:, row][emitted].tolist()
    self.stats["tokens"] += len(tokens)
    done.token_ids += tokens
    event = StreamEvent(request.request_id, tokens)
    if request.logprobs:
      logprobs = host.logprobs[:, row][emitted].tolist()
      done.logprobs += logprobs
      event = dataclasses.replace(event, logprobs=logprobs)
    if request.top_logprobs:
      n, top = request.top_logprobs, host.top
      entries = [{"logprob": float(top.token_values[t, row]),
                  "rank": int(top.token_ranks[t, row]),
                  "top": list(zip(top.top_ids[t, row, :n].tolist(),
                                  top.top_values[t, row, :n].tolist()))}
                 for t in np.flatnonzero(emitted[:, 0])]
      done.top_logprobs += entries
      event = dataclasses.replace(event, top_logprobs=entries)
    if request.return_masks:
      masks, logz = [], []
      for t, n in enumerate(emitted.sum(axis=1).tolist()):
        if n:
          step = jax.tree.map(lambda a, t=t, n=n: a[t, :n, row:row + 1],
                              host.mask)
          for ids, value in step.to_lists(num_tokens=np.array([n]))[0]:
            masks.append(ids)
            logz.append(value)
      done.sampling_mask += masks
      done.logz += logz
      event = dataclasses.replace(event, sampling_mask=masks, logz=logz)
    return event

  def _finish(self, active: _Active) -> None:
    done, request = active.completion, active.request
    ids = done.token_ids
    if ids and ids[-1] in set(request.stop):
      reason = 0
    elif len(ids) >= active.budget:
      reason = 1
    else:
      reason = 2
    done.finish_reason = FINISH_REASONS[reason]
    self.stats["completed"] += 1
