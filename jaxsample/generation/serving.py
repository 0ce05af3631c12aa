"""``ServeLoop``: continuous batching over a fixed number of slots.

The loop owns a device state of ``slots`` decode slots and the jitted
programs of ``slot_programs``, whose shapes never change while requests
come and go.  Each ``step`` admits queued requests into free slots (prompts
prefilled in buckets of ``max(16, next_pow2(longest))`` columns, first
tokens sampled), runs ``steps_per_call`` decode (or speculative) steps of
every slot, streams the tokens read back to their requests (``events``,
callbacks) and retires the finished ones.  With ``overlap`` (the default) a
call dispatches its programs before it reads the previous call's outputs,
and a request whose budget the dispatched programs reach hands its slot on
at once (``_release_finishing``); neither changes any request's tokens,
which depend only on its prompt, seed, settings, budget and stop ids.  A
request that fails after ``submit`` ends alone with finish reason
``"error"``.  The rules in full: ``docs/serving.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.generation import slot_programs
from jaxsample.generation.generate import bucket
from jaxsample.generation.lm import as_language_model
from jaxsample.generation.requests import (ABORT, ERROR, Completion,
                                           ProcessorLimits, Request,
                                           RequestRules, Speculation,
                                           StreamEvent, check_limits,
                                           request_from_fields)
from jaxsample.generation.slot_programs import (admission_inputs,
                                                pack_host_bitmask,
                                                share_prompts, slot_processors)
from jaxsample.generation.tracked import Tracked
from jaxsample._src.logprobs import MODES, check_num_top
from jaxsample._src.params import SamplerConfig

__all__ = ["DEFAULT_STEPS_PER_CALL", "ServeLoop"]

MIN_PROMPT = 16
DEFAULT_STEPS_PER_CALL = 4
"""Decode steps per jitted call by default: a quarter of the host's
per-call work (dispatch, reading outputs, events) per step; a request
that ends mid-call idles its slot for the call's remaining steps
(``docs/serving.md``, Host and device)."""

@dataclasses.dataclass(frozen=True)
class _InFlight:
  """A dispatched program's output (its host copy under way), not yet read:
  row ``r`` belongs to ``owners[r]`` (None: no request)."""

  serial: int
  output: slot_programs.Output
  owners: tuple[Tracked | None, ...]


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
      ``jaxsample._src.logprobs.MODES`` (vLLM's ``logprobs_mode``).
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
    self.processors = check_limits(processors, speculation, steps_per_call)
    self._rules = RequestRules(self.vocab_size, self.cache_len,
                               max_stop_tokens, self.top_logprobs,
                               self.return_masks, processors)
    neutral = self._slot_processors([], slots)
    # All ids allowed, [slots, W] (None without grammar masks): the rows of
    # slots without a bitmask_fn.
    self._open_bitmask = None if neutral is None else neutral.bitmask
    self.overlap = bool(overlap) and self._open_bitmask is None
    self._queue: collections.deque = collections.deque()
    self._live: dict = {}  # request_id: its unfinished samples (Tracked)
    self._ended: list[Tracked] = []  # aborted; final events not yet given
    self._active: list[Tracked | None] = [None] * slots
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
    """Counts (``admit_calls``, ``prefills``: prompts run through the
    model, ``step_calls``, ``tokens``, ``completed``, ``drafted``,
    ``accepted``) and seconds: ``busy_s`` in ``step``
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
    int).  A request without a seed gets a fresh one (``Completion.seed``).
    ``callback`` gets each of its ``StreamEvent``s; if it raises, the
    request ends with finish reason ``"error"`` (not calling it again).

    Raises:
      ValueError: naming the field, for an unknown field, a field of the
        wrong type, an empty prompt, a prompt of ``cache_len`` tokens or
        more, ids outside the vocabulary, too many stop ids, a budget
        below 1, a bad seed, invalid sampling settings, masks or processors
        the loop was not built for, a processor setting out of range or
        over the loop's ``ProcessorLimits``, a callback that is not
        callable, or the ``request_id`` of a request still queued or
        running.
        Nothing is queued and nothing in flight changes.
    """
    if isinstance(request, Mapping):
      request = request_from_fields(request)
    if not isinstance(request, Request):
      raise ValueError(f"request must be a Request or a mapping of its "
                       f"fields; got {type(request).__name__}")
    if callback is not None and not callable(callback):
      raise ValueError(f"callback must be callable (StreamEvent -> None); "
                       f"got {type(callback).__name__}")
    request, budget, sequences = self._rules.check(request)
    rid = request.request_id
    if rid in self._live:
      raise ValueError(f"request_id {rid!r} belongs to a request still queued "
                       f"or running; give each its own id (None: a fresh one)")
    while rid is None or rid in self._live:  # a fresh id no live one has
      rid = next(self._ids)
    seed = secrets.randbits(32) if request.seed is None else request.seed
    request = dataclasses.replace(request, request_id=rid, seed=seed)
    samples = [Tracked.start(request, budget, callback, i, sequences)
               for i in range(request.n)]
    self._queue.extend(samples)
    self._live[rid] = samples
    return rid

  def abort(self, request_id) -> bool:
    """Ends the pending request ``request_id`` (its samples queued or in a
    slot) with finish reason ``"abort"`` and frees their slots; their final
    events (no new tokens: those in flight are dropped) come from the next
    ``step``.  Returns whether such a request was pending."""
    try:
      samples = list(self._live.get(request_id, ()))
    except TypeError:  # unhashable: no request has it
      return False
    for active in samples:
      if active.slot < 0:
        self._queue.remove(active)
      self._finish(active, ABORT)
      self._free(active)
      self._ended.append(active)
    return bool(samples)

  @property
  def pending(self) -> int:
    """Requests queued, in a slot, or aborted with their final event not
    given yet."""
    return (len(self._queue) + self._released + len(self._ended) +
            self.slots - self._active.count(None))

  def step(self) -> list[StreamEvent]:
    """Admits queued requests into free slots, dispatches one step call if
    any slot is busy, and returns the events read back: with ``overlap``
    those of the programs the previous ``step`` dispatched (this call's run
    meanwhile), else this call's.  When no request is left, nothing stays
    in flight."""
    start = time.perf_counter()
    first = next(self._serials)  # serials below it: earlier calls'
    ended, self._ended = self._ended, []
    events = [self._emit(a, a.final_event()) for a in ended]
    self._release_finishing()
    while self._queue and None in self._active:
      events += self._admit_some()
    bitmask = self._open_bitmask
    if bitmask is not None and self._active.count(None) < self.slots:
      masks, failed = self._grammar_masks(self._active)
      events += failed
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
    ``Completion``s in request order (a request's ``n`` samples by
    index)."""
    ids = [self.submit(r) for r in requests]
    done = collections.defaultdict(dict)
    for event in self.events():
      if event.completion is not None:
        done[event.request_id][event.index] = event.completion
    return [c for i in ids for _, c in sorted(done[i].items())]

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
      self._admit([], self._admission_inputs([], width), width)
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

  def _slot_processors(self, requests, rows: int, bitmasks=()):
    return slot_processors(self.processors, requests, rows,
                           history=self.cache_len,
                           stop_width=self.max_stop_tokens,
                           vocab_size=self.vocab_size, bitmasks=bitmasks)

  def _admission_inputs(self, batch: list[Tracked], width: int,
                        bitmasks=()):
    requests = [a.request for a in batch]
    return admission_inputs(
        [(a.request, a.budget, a.index) for a in batch], self.admit_batch, width,
        self.max_stop_tokens) + (
            self._slot_processors(requests, self.admit_batch, bitmasks),)

  def _grammar_masks(self, actives) -> tuple[list, list[StreamEvent]]:
    """Each request's bitmask words for its next token (``bitmask_fn`` of
    its tokens so far; None for None entries and requests without one).
    A request whose ``bitmask_fn`` raises or returns a wrong shape ends
    with finish reason ``ERROR`` (``_fail``): the returned events are
    theirs."""
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
          events.append(self._fail(active, "bitmask_fn", error))
      masks.append(words)
    return masks, events

  def _release_finishing(self) -> None:
    """Frees the slots of requests whose dispatched programs end them (their
    budget reached: ``Tracked.promised``): queued requests enter them in
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
    masks, events = [None] * len(batch), []
    if self._open_bitmask is not None:
      masks, events = self._grammar_masks(batch)
    inputs = None
    while inputs is None:
      masks = [m for m, a in zip(masks, batch) if not a.completion.error]
      batch = [a for a in batch if not a.completion.error]
      if not batch:
        return events
      width = min(bucket(max(len(a.request.prompt) for a in batch),
                         MIN_PROMPT), self.cache_len)
      try:
        inputs = self._admission_inputs(batch, width, masks)
      except Exception:  # pylint: disable=broad-exception-caught
        events += self._fail_inadmissible(batch, masks, width)
    for active, slot in zip(batch, free):
      active.slot = slot
      self._active[slot] = active
    self._admit(batch, inputs, width)
    self.stats["admit_calls"] += 1
    if not self.overlap:  # grammar masks: the next need the first tokens
      events += self._read(None)
    return events

  def _fail_inadmissible(self, batch: list[Tracked], masks,
                         width: int) -> list[StreamEvent]:
    """Ends with ``ERROR`` each request of ``batch`` whose admission inputs
    (``_admission_inputs`` alone) cannot be built; returns their events.
    Raises if none fails alone (the batch's failure is the loop's)."""
    events = []
    for active, mask in zip(batch, masks):
      try:
        self._admission_inputs([active], width, [mask])
      except Exception as error:  # pylint: disable=broad-exception-caught
        events.append(self._fail(active, "admission", error))
    if not events:
      raise RuntimeError("admission failed for the batch but for none of its "
                         "requests alone")
    return events

  def _admit(self, batch: list[Tracked], inputs, width: int) -> None:
    """Dispatches the admission of ``batch`` (slots set) with its
    ``_admission_inputs``, prompts in ``width`` columns (the ``prompt``
    program of that width, then ``admit``)."""
    slot_ids = np.full(self.admit_batch, self.slots, np.int32)
    slot_ids[:len(batch)] = [a.slot for a in batch]
    tokens, lengths, *rest = inputs
    prompts, prompt_lengths, sources = share_prompts(
        [id(a.request) for a in batch], tokens, lengths)
    self.stats["prefills"] += len(set(sources[:len(batch)].tolist()))
    prompted = self._programs.prompt(*self._leaves, prompts, prompt_lengths)
    self._dispatch(self._programs.admit, 1,
                   batch + [None] * (self.admit_batch - len(batch)), slot_ids,
                   sources, prompted, lengths, *rest)

  def _collect(self, host: slot_programs.Output,
               owners: Sequence[Tracked | None]) -> list[StreamEvent]:
    """Events of the rows of ``host`` (an ``Output`` on the host; row ``r``
    belongs to ``owners[r]``); retires the requests that finished."""
    emitted, sizes, tokens, logprobs = host.emitted()
    drafted, accepted = host.drafted.sum(0), host.accepted.sum(0)
    self.stats["drafted"] += int(drafted.sum())
    self.stats["accepted"] += int(accepted.sum())
    finished = host.finished.tolist()
    drafted, accepted = drafted.tolist(), accepted.tolist()
    events, end = [], 0
    for row, active in enumerate(owners):
      start, end = end, end + sizes[row]
      if (active is None or not (sizes[row] or finished[row]) or
          active.completion.finish_reason is not None):
        continue  # nothing new, no request, or one finished earlier
      try:
        active.completion.drafted += drafted[row]
        active.completion.accepted += accepted[row]
        fields = active.advance(host, row, emitted, tokens[start:end],
                                logprobs[start:end])
        reason = active.cut_at_stop(fields)
        self.stats["tokens"] += len(fields["token_ids"])
        if finished[row] or reason:
          self._finish(active, reason)
          self._free(active)
          fields.update(finish_reason=active.completion.finish_reason,
                        completion=active.completion)
      except Exception as error:  # pylint: disable=broad-exception-caught
        events.append(self._fail(active, "reading its outputs", error))
        continue
      events.append(self._emit(active, StreamEvent(
          active.request.request_id, index=active.index, **fields)))
    return events

  def _finish(self, active: Tracked, reason: str | None = None) -> None:
    """Sets the request's finish reason: ``reason``, else ``generate``'s
    rule for its last token."""
    active.completion.finish_reason = reason or active.reason_by_rule()
    samples = self._live[active.request.request_id]
    samples.remove(active)
    if not samples:
      del self._live[active.request.request_id]
    self.stats["completed"] += 1

  def _free(self, active: Tracked) -> None:
    """Hands on the slot of a request that finished (nothing for a queued
    one); its device row, if it still runs, has no owner: its outputs are
    dropped until a new request's admission overwrites it."""
    if active.released:
      active.released = False
      self._released -= 1
    elif active.slot >= 0 and self._active[active.slot] is active:
      self._active[active.slot] = None

  def _emit(self, active: Tracked, event: StreamEvent) -> StreamEvent:
    """Gives ``event`` to the request's callback; returns the event to
    stream: ``event``, or if the callback raised, the request's final
    ``ERROR`` event (``_fail``, with ``event``'s tokens)."""
    if active.callback is None:
      return event
    try:
      active.callback(event)
    except Exception as error:  # pylint: disable=broad-exception-caught
      active.callback = None  # not called again
      return self._fail(active, "callback", error, event)
    return event

  def _fail(self, active: Tracked, what: str, error: Exception,
            event: StreamEvent | None = None) -> StreamEvent:
    """Ends the request alone with finish reason ``ERROR`` (also one that
    just finished otherwise, on its final event's callback) and
    ``Completion.error`` saying that ``what`` failed with ``error`` (the
    first failure's); frees its slot.  Returns its final event (``event``'s
    tokens, if given), given to its callback."""
    done = active.completion
    done.error = done.error or f"{what} failed: {type(error).__name__}: {error}"
    if done.finish_reason is None:
      self._finish(active, ERROR)
      self._free(active)
    done.finish_reason = ERROR
    final = dataclasses.replace(event or active.final_event(),
                                finish_reason=ERROR, completion=done)
    return self._emit(active, final)
