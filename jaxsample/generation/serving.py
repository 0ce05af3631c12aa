"""``ServeLoop``: continuous batching over a fixed number of slots.

The loop owns a device state of ``slots`` decode slots and jitted programs
(``slot_programs``) whose shapes never change while requests come and go:

* *admit*: up to ``admit_batch`` queued requests, their prompts left-aligned
  in a bucket of ``max(16, next_pow2(longest))`` columns (capped at the
  cache), are prefilled on a fresh cache of ``admit_batch`` rows (one
  compile per bucket of the model alone, ``warmup`` compiles them all),
  their first token sampled, and the rows scattered into free slots (one
  compile);
* *step*: ``steps_per_call`` decode steps of every slot (``decode_step``), or
  with ``speculation`` that many speculative steps (``spec_step``).

Between calls the host reads the emitted tokens, streams them to each
request (``events``, callbacks), retires finished requests and admits queued
ones into the freed slots.  With ``overlap`` (the default) each ``step``
dispatches its programs before it reads the outputs of the previous
``step``'s, so that host work runs while the device computes: a request
that ends by its budget hands its slot on as soon as the programs
dispatched for it will end it (``_release_finishing``), one that stops
otherwise idles its slot through one more step call; neither changes any
request's tokens.  A request's tokens depend
only on its prompt, seed, parameters, budget and stop ids: plain decoding
gives exactly ``generate``'s tokens for the same key (``seed`` ``s`` is the
key ``jax.random.PRNGKey(s)``); speculative decoding gives the same tokens
for greedy requests and the same distribution for sampled ones.

Logits processors (``processors=ProcessorLimits(...)``): each slot carries
its request's ``LogitsProcessors`` row (penalties, bias, allowed and banned
ids, min tokens; fixed widths, neutral where unused) and its output history,
which every emitted token extends, so a request gets exactly what the decode
step gives it alone with those processors.  A request's ``bitmask_fn`` runs
on the host before each of its tokens (before admission for the first);
its words are the step's ``bitmask`` argument.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.generation import slot_programs
from jaxsample.generation.admission import (RequestRules, admission_inputs,
                                            pack_host_bitmask,
                                            request_from_fields,
                                            slot_processors)
from jaxsample.generation.generate import FINISH_REASONS, bucket
from jaxsample.generation.lm import as_language_model
from jaxsample.generation.requests import (ERROR, Completion, ProcessorLimits,
                                           Request, Speculation, StreamEvent)
from jaxsample.logprobs import MODES, check_num_top
from jaxsample.params import SamplerConfig

__all__ = ["DEFAULT_STEPS_PER_CALL", "ServeLoop"]

MIN_PROMPT = 16
DEFAULT_STEPS_PER_CALL = 4
"""Decode steps per jitted call by default: a quarter of the host's
per-call work (dispatch, reading outputs, events) per step; a request
that ends mid-call idles its slot for the call's remaining steps
(``docs/serving.md``, Host and device)."""

@dataclasses.dataclass
class _Active:
  """Host bookkeeping of a request, queued or in slot ``slot``.

  ``promised``: the fewest tokens the programs dispatched for it emit unless
  it finishes first (1 per admission, 1 per step); at ``budget`` it will
  have finished once they ran.  ``released``: its slot was handed on
  (``ServeLoop._release_finishing``) before its last outputs were read.
  """

  request: Request
  budget: int
  completion: Completion
  callback: Callable[[StreamEvent], None] | None
  slot: int = -1
  promised: int = 0
  released: bool = False


@dataclasses.dataclass(frozen=True)
class _InFlight:
  """A dispatched program's output (its host copy under way), not yet read:
  row ``r`` belongs to ``owners[r]`` (None: no request)."""

  serial: int
  output: slot_programs.Output
  owners: tuple[_Active | None, ...]


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
      amortizes the host round trip; retirement waits for the call's end);
      default ``DEFAULT_STEPS_PER_CALL``, 1 with grammar masks.
    speculation: a ``Speculation``, or None for plain decoding.
    top_logprobs: the most top logprobs a request may ask for (0 to 20;
      plain decoding only).
    logprobs_mode: the values ``top_logprobs`` report, one of
      ``jaxsample.logprobs.MODES`` (vLLM's ``logprobs_mode``).
    processors: a ``ProcessorLimits`` (which logits processors requests may
      use, the widths of their per-slot tables), or None (none).
    overlap: dispatch each step's programs before reading the previous
      step's outputs (module doc); off, ``step`` returns the events of its
      own programs.  Grammar masks (``ProcessorLimits(bitmask=True)``) turn
      it off: a ``bitmask_fn`` needs every token before the next step.
  """

  def __init__(self, model, *, slots: int = 8, cache_len: int | None = None,
               config: SamplerConfig | None = None, return_masks: bool = False,
               max_stop_tokens: int = 4, admit_batch: int | None = None,
               steps_per_call: int | None = None,
               speculation: Speculation | None = None,
               top_logprobs: int = 0, logprobs_mode: str = "raw_logprobs",
               processors: ProcessorLimits | None = None,
               overlap: bool = True):
    self.lm, self.weights = as_language_model(model)
    self.cache_len = cache_len or self.lm.max_len
    if not self.cache_len or self.cache_len < 2:
      raise ValueError("cache_len must be >= 2 (or the model needs max_len)")
    if steps_per_call is None:
      steps_per_call = (1 if getattr(processors, "bitmask", False) else
                        DEFAULT_STEPS_PER_CALL)
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
    self.processors = self._check_limits(processors)
    self._rules = RequestRules(self.vocab_size, self.cache_len,
                               max_stop_tokens, self.top_logprobs,
                               self.return_masks, processors)
    neutral = self._slot_processors([], slots)
    # All ids allowed, [slots, W] (None without grammar masks): the rows of
    # slots without a bitmask_fn.
    self._open_bitmask = None if neutral is None else neutral.bitmask
    self.overlap = bool(overlap) and self._open_bitmask is None
    self._queue: collections.deque = collections.deque()
    self._active: list[_Active | None] = [None] * slots
    self._released = 0  # released requests not finished yet
    self._ids = itertools.count()
    self._serials = itertools.count()
    self._inflight: collections.deque[_InFlight] = collections.deque()
    leaves, weights_def = jax.tree.flatten(self.weights)
    draft_leaves, draft_def = jax.tree.flatten(self._draft_weights)
    self._leaves = (leaves, draft_leaves)
    self._programs = slot_programs.programs(
        self.lm, self.drafter, self.config, self._outputs, steps_per_call,
        self._state_len, weights_def, draft_def)
    self._state = slot_programs.empty_state(
        self.lm, self.weights, slots, max_stop_tokens, self._state_len,
        self.drafter, self._draft_weights, neutral)
    self.stats = collections.Counter()
    """Counts (``admit_calls``, ``step_calls``, ``tokens``, ``completed``,
    ``drafted``, ``accepted``) and seconds: ``busy_s`` in ``step``
    altogether, ``wait_s`` of it blocked reading outputs (until the
    device finished them, and their copy) and ``dispatch_s`` in the jitted
    calls.  ``busy_s - wait_s`` is the host's own work (bookkeeping,
    inputs, dispatch, events): the device can idle only then, so ``1 -
    wait_s / busy_s`` bounds its idle share of the loop's time from above
    (``docs/serving.md``); a dispatch that waits for the device (a GPU's
    ``lax.cond``) counts in ``dispatch_s``."""

  # -- requests ------------------------------------------------------------

  def submit(self, request: Request | Mapping,
             callback: Callable[[StreamEvent], None] | None = None):
    """Validates ``request`` (a ``Request`` or a mapping of its fields, as
    a JSON body) and queues it; returns its id (``request_id`` or a fresh
    int).  ``callback`` gets each of its ``StreamEvent``s.

    Raises:
      ValueError: naming the field, for an unknown field, an empty prompt,
        a prompt of ``cache_len`` tokens or more, ids outside the
        vocabulary, unknown or too many stop ids, a bad budget or seed,
        invalid sampling settings, masks or processors the loop was not
        built for, or a processor setting out of range or over the loop's
        ``ProcessorLimits``.  Nothing in flight changes.
    """
    if isinstance(request, Mapping):
      request = request_from_fields(request)
    if not isinstance(request, Request):
      raise ValueError(f"request must be a Request or a mapping of its "
                       f"fields; got {type(request).__name__}")
    request, budget = self._rules.check(request)
    if request.request_id is None:
      request = dataclasses.replace(request, request_id=next(self._ids))
    self._queue.append(_Active(request, budget, Completion(
        request.request_id, len(request.prompt), [],
        [] if request.logprobs else None,
        [] if request.return_masks else None,
        [] if request.return_masks else None,
        [] if request.top_logprobs else None), callback))
    return request.request_id

  @property
  def pending(self) -> int:
    """Requests queued or in a slot."""
    return (len(self._queue) + self._released + self.slots -
            self._active.count(None))

  def step(self) -> list[StreamEvent]:
    """Admits queued requests into free slots, dispatches one step call if
    any slot is busy, and returns the events read back: with ``overlap``
    those of the programs the previous ``step`` dispatched (this call's run
    meanwhile), else this call's.  When no request is left, nothing stays
    in flight."""
    start = time.perf_counter()
    first = next(self._serials)  # serials below it: earlier calls'
    events = []
    self._release_finishing()
    while self._queue and None in self._active:
      events += self._admit_some()
    bitmask = self._open_bitmask
    if bitmask is not None and self._active.count(None) < self.slots:
      masks, failed = self._grammar_masks(self._active)
      events += failed
      self._active = [None if a is not None and a.completion.error else a
                      for a in self._active]
      bitmask = np.stack([bitmask[0] if m is None else m for m in masks])
    if self._active.count(None) < self.slots:  # a slot is busy
      self._dispatch(self._programs.step, self.steps_per_call, self._active,
                     *self._leaves, self._rates, bitmask)
      self.stats["step_calls"] += 1
    events += self._read(first if self.overlap else None)
    if not self.pending:  # idle: what is left in flight has no events
      self._read(None)
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
    """Compiles the step, the admission and the prompt program of every
    prompt bucket up to ``max_prompt_len``'s (default: all), on an idle
    loop (the admitted rows go nowhere).

    Raises:
      ValueError: with requests pending (the step would advance them).
    """
    if self.pending:
      raise ValueError("warmup runs the programs on the slots: call it "
                       f"before submitting requests ({self.pending} pending)")
    last = min(bucket(max_prompt_len or self.cache_len, MIN_PROMPT),
               self.cache_len)
    width = MIN_PROMPT
    while True:
      width = min(width, last)
      self._admit([], [], width)
      if width >= last:
        break
      width *= 2
    self._dispatch(self._programs.step, 0, (None,) * self.slots,
                   *self._leaves, self._rates, self._open_bitmask)
    self._read(None)
    self.stats.clear()

  # -- internals -----------------------------------------------------------

  def _probe_vocab(self) -> int:
    shape = jax.eval_shape(
        lambda w: self.lm.apply(w, jnp.zeros((1, 1), jnp.int32),
                                jnp.zeros((1, 1), jnp.int32),
                                self.lm.init_cache(w, 1, self.cache_len)),
        self.weights)
    return shape[0].shape[-1]

  def _dispatch(self, program, steps: int, owners, *args) -> None:
    """Dispatches ``program`` (``admit`` or ``step`` of ``self._programs``,
    ``steps`` steps) on the state and ``args`` and queues its output, rows
    owned by ``owners``, with its copy to the host started (masks only if
    an owner asked for them)."""
    start = time.perf_counter()
    self._state, out = program(self._state, *args)
    self.stats["dispatch_s"] += time.perf_counter() - start
    for active in owners:
      if active is not None:
        active.promised += steps
    if out.mask is not None and not any(
        a is not None and a.request.return_masks for a in owners):
      out = dataclasses.replace(out, mask=None)
    for leaf in jax.tree.leaves(out):
      leaf.copy_to_host_async()
    self._inflight.append(_InFlight(next(self._serials), out, tuple(owners)))

  def _read(self, before: int | None) -> list[StreamEvent]:
    """Reads the outputs in flight dispatched before serial ``before`` (all
    for None), in order; returns their events."""
    events = []
    while self._inflight and (before is None or
                              self._inflight[0].serial < before):
      done = self._inflight.popleft()
      start = time.perf_counter()
      host = jax.device_get(done.output)
      self.stats["wait_s"] += time.perf_counter() - start
      events += self._collect(host, done.owners)
    return events

  def _check_limits(self, limits) -> ProcessorLimits | None:
    if limits is None:
      return None
    if not isinstance(limits, ProcessorLimits):
      raise ValueError(f"processors must be a ProcessorLimits or None; got "
                       f"{type(limits).__name__}")
    if limits.bitmask and self.speculation is not None:
      raise ValueError("ProcessorLimits(bitmask=True) needs plain decoding "
                       "(speculation=None): each drafted position would need "
                       "its own grammar mask")
    if limits.bitmask and self.steps_per_call != 1:
      raise ValueError("ProcessorLimits(bitmask=True) needs steps_per_call=1 "
                       "(the host computes every step's masks)")
    return limits

  def _slot_processors(self, requests, rows: int, bitmasks=()):
    return slot_processors(self.processors, requests, rows,
                           history=self.cache_len,
                           stop_width=self.max_stop_tokens,
                           vocab_size=self.vocab_size, bitmasks=bitmasks)

  def _admission_inputs(self, batch: list[_Active], width: int,
                        bitmasks=()):
    requests = [a.request for a in batch]
    return admission_inputs(
        [(a.request, a.budget) for a in batch], self.admit_batch, width,
        self.max_stop_tokens) + (
            self._slot_processors(requests, self.admit_batch, bitmasks),)

  def _grammar_masks(self, actives) -> tuple[list, list[StreamEvent]]:
    """Each request's bitmask words for its next token (``bitmask_fn`` of
    its tokens so far; None for None entries and requests without one).
    A request whose ``bitmask_fn`` raises or returns a wrong shape ends
    with finish reason ``ERROR`` (``Completion.error`` says why; the caller
    frees it): the returned events are theirs."""
    masks, events = [], []
    for active in actives:
      words = None
      fn = None if active is None else active.request.bitmask_fn
      if fn is not None:
        try:
          words = pack_host_bitmask(fn(list(active.completion.token_ids)),
                                    self.vocab_size)
        except Exception as error:  # pylint: disable=broad-exception-caught
          # The request's own callback failed: it ends that request alone.
          active.completion.error = (f"bitmask_fn failed: "
                                     f"{type(error).__name__}: {error}")
          events.append(self._end(active, ERROR))
      masks.append(words)
    return masks, events

  def _release_finishing(self) -> None:
    """Frees the slots of requests whose dispatched programs end them (their
    budget reached: ``_Active.promised``): queued requests enter them in
    this call (their admission runs after those programs on the device),
    and no step is dispatched for them.  Their outputs in flight are still
    theirs (``_InFlight.owners``)."""
    for slot, active in enumerate(self._active):
      if active is not None and active.promised >= active.budget:
        active.released = True
        self._active[slot] = None
        self._released += 1

  def _admit_some(self) -> list[StreamEvent]:
    free = [s for s, a in enumerate(self._active) if a is None]
    batch = [self._queue.popleft()
             for _ in range(min(len(free), self.admit_batch, len(self._queue)))]
    masks, events = [], []
    if self._open_bitmask is not None:
      masks, events = self._grammar_masks(batch)
      masks = [m for m, a in zip(masks, batch) if not a.completion.error]
      batch = [a for a in batch if not a.completion.error]
      if not batch:
        return events
    width = min(bucket(max(len(a.request.prompt) for a in batch), MIN_PROMPT),
                self.cache_len)
    for active, slot in zip(batch, free):
      active.slot = slot
      self._active[slot] = active
    self._admit(batch, masks, width)
    self.stats["admit_calls"] += 1
    if not self.overlap:  # grammar masks: the next need the first tokens
      events += self._read(None)
    return events

  def _admit(self, batch: list[_Active], masks, width: int) -> None:
    """Dispatches the admission of ``batch`` (slots set) with grammar
    ``masks``, prompts in ``width`` columns (the ``prompt`` program of that
    width, then ``admit``)."""
    slot_ids = np.full(self.admit_batch, self.slots, np.int32)
    slot_ids[:len(batch)] = [a.slot for a in batch]
    tokens, lengths, *rest = self._admission_inputs(batch, width, masks)
    prompted = self._programs.prompt(*self._leaves, tokens, lengths)
    self._dispatch(self._programs.admit, 1,
                   batch + [None] * (self.admit_batch - len(batch)), slot_ids,
                   prompted, lengths, *rest)

  def _collect(self, host: slot_programs.Output,
               owners: Sequence[_Active | None]) -> list[StreamEvent]:
    """Events of the rows of ``host`` (an ``Output`` on the host; row ``r``
    belongs to ``owners[r]``); retires the requests that finished."""
    steps, rows, width = host.tokens.shape
    emitted = np.arange(width) < host.count[..., None]  # [n, R, E]
    flags = emitted.transpose(1, 0, 2).reshape(rows, steps * width)
    # The emitted values of row 0, then row 1, .. in one Python list each
    # (one conversion); row r's are the next sizes[r].
    emitted_values = lambda a: a.transpose(1, 0, 2).reshape(
        rows, steps * width)[flags].tolist()
    tokens, logprobs = emitted_values(host.tokens), emitted_values(
        host.logprobs)
    drafted, accepted = host.drafted.sum(0), host.accepted.sum(0)
    self.stats["drafted"] += int(drafted.sum())
    self.stats["accepted"] += int(accepted.sum())
    sizes, finished = flags.sum(axis=1).tolist(), host.finished.tolist()
    drafted, accepted = drafted.tolist(), accepted.tolist()
    events, end = [], 0
    for row, active in enumerate(owners):
      start, end = end, end + sizes[row]
      if (active is None or not (sizes[row] or finished[row]) or
          active.completion.finish_reason is not None):
        continue  # nothing new, no request, or one finished earlier
      active.completion.drafted += drafted[row]
      active.completion.accepted += accepted[row]
      fields = self._advance(active, host, row, emitted, tokens[start:end],
                             logprobs[start:end])
      if finished[row]:
        self._finish(active)
        if active.released:
          self._released -= 1
        else:
          self._active[active.slot] = None
        fields.update(finish_reason=active.completion.finish_reason,
                      completion=active.completion)
      event = StreamEvent(active.request.request_id, **fields)
      events.append(event)
      if active.callback is not None:
        active.callback(event)
    return events

  def _advance(self, active: _Active, host: slot_programs.Output, row: int,
               emitted: np.ndarray, tokens: list[int],
               logprobs: list[float]) -> dict:
    """Appends row ``row``'s ``tokens`` and ``logprobs`` (where ``emitted``
    ``[n, R, E]``) and what else the request asked for to its completion;
    returns them as ``StreamEvent`` fields."""
    request, done = active.request, active.completion
    self.stats["tokens"] += len(tokens)
    done.token_ids += tokens
    fields = {"token_ids": tokens}
    if request.logprobs:
      done.logprobs += logprobs
      fields["logprobs"] = logprobs
    if request.top_logprobs:
      n, top = request.top_logprobs, host.top
      entries = [{"logprob": float(top.token_values[t, row]),
                  "rank": int(top.token_ranks[t, row]),
                  "top": list(zip(top.top_ids[t, row, :n].tolist(),
                                  top.top_values[t, row, :n].tolist()))}
                 for t in np.flatnonzero(emitted[:, row, 0])]
      done.top_logprobs += entries
      fields["top_logprobs"] = entries
    if request.return_masks:
      masks, logz = [], []
      for t, n in enumerate(emitted[:, row].sum(axis=1).tolist()):
        if n:
          step = jax.tree.map(lambda a, t=t, n=n: a[t, :n, row:row + 1],
                              host.mask)
          for ids, value in step.to_lists(num_tokens=np.array([n]))[0]:
            masks.append(ids)
            logz.append(value)
      done.sampling_mask += masks
      done.logz += logz
      fields.update(sampling_mask=masks, logz=logz)
    return fields

  def _finish(self, active: _Active, reason: str | None = None) -> None:
    """Sets the request's finish reason: ``reason``, else ``generate``'s
    rule for its last token."""
    done, request = active.completion, active.request
    ids = done.token_ids
    if reason is None:
      if ids and ids[-1] in set(request.stop):
        reason = FINISH_REASONS[0]
      elif len(ids) >= active.budget:
        reason = FINISH_REASONS[1]
      else:
        reason = FINISH_REASONS[2]
    done.finish_reason = reason
    self.stats["completed"] += 1

  def _end(self, active: _Active, reason: str) -> StreamEvent:
    """Finishes a request outside a program's output (no new tokens): its
    final event, also given to its callback."""
    self._finish(active, reason)
    event = StreamEvent(active.request.request_id, [], finish_reason=reason,
                        completion=active.completion)
    if active.callback is not None:
      active.callback(event)
    return event
