"""What a ``ServeLoop`` takes and gives: ``Request``, ``StreamEvent``,
``Completion``, and the loop's ``Speculation`` and ``ProcessorLimits``
settings (``docs/serving.md``); ``RequestRules``: a request checked against
the loop's limits (``ServeLoop.submit``'s rules)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxsample._src.params import check_setting
from jaxsample._src.processors import MAX_BIAS

__all__ = ["ABORT", "ERROR", "PROCESSOR_DEFAULTS", "SEED_LIMIT", "Completion",
           "ProcessorLimits", "Request", "RequestRules", "Speculation",
           "StreamEvent", "check_limits", "request_from_fields"]

ERROR = "error"
"""The finish reason of a request that failed after ``submit`` accepted it
(its ``bitmask_fn`` or callback raised, ...): ``Completion.error`` says why."""
ABORT = "abort"
"""The finish reason of a request ended by ``ServeLoop.abort``."""

PROCESSOR_DEFAULTS = {"repetition_penalty": 1.0, "presence_penalty": 0.0,
                      "frequency_penalty": 0.0, "logit_bias": None,
                      "allowed_token_ids": None, "banned_token_ids": (),
                      "min_tokens": 0, "bitmask_fn": None}
"""``Request``'s logits-processor fields and their values that mean off."""


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request (validated by ``ServeLoop.submit``).

  ``seed`` in ``[0, 2^32)`` is the key ``jax.random.PRNGKey(seed)``; None
  draws a fresh one at ``submit`` (``Completion.seed`` records it).  The
  request's tokens depend only on the seed, ``prompt`` and the settings.
  Generation stops after ``max_tokens`` tokens (capped so the sequence fits
  the cache) or after a match of ``stop``: a token id, or a list whose
  items are token ids (each a stop token) or lists of ids (multi-token stop
  sequences); the stop's tokens end the output.  A bare int where a list of
  ids is expected (``prompt``, ``stop``, ``allowed_token_ids``,
  ``banned_token_ids``) is one id.  ``n`` samples share the request id,
  prompt and settings; sample ``i`` (``index``) uses the raw key ``[i,
  seed]`` (sample 0: ``PRNGKey(seed)``); samples admitted together share
  one prefill.  ``logprobs`` / ``top_logprobs`` /
  ``return_masks`` choose what the outputs carry (``top_logprobs`` up to the
  loop's ``top_logprobs``; masks need a loop built with
  ``return_masks=True``).

  Logits processors (``jaxsample._src.processors``, vLLM/OpenAI semantics; a loop
  built with ``processors=ProcessorLimits(...)``): ``repetition_penalty``
  (> 0, 1 off; prompt and output tokens), ``presence_penalty`` and
  ``frequency_penalty`` (0 off; output tokens), ``logit_bias`` (``{id:
  bias}``, biases in ``[-100, 100]``; JSON's string ids are accepted),
  ``allowed_token_ids`` (None: all), ``banned_token_ids`` (bad words as
  ids), ``min_tokens`` (the ``stop`` ids are held back until the request has
  that many tokens) and ``bitmask_fn``: called on the host before each of
  the request's tokens with the ids generated so far, it returns the
  allowed ids as bool ``[V]`` or packed ``int32 [ceil(V / 32)]`` words
  (xgrammar's layout); a loop built with ``ProcessorLimits(bitmask=True)``.
  """

  prompt: Sequence[int]
  max_tokens: int = 16
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int | None = None
  stop: int | Sequence[int | Sequence[int]] = ()
  logprobs: bool = True
  top_logprobs: int = 0
  return_masks: bool = False
  request_id: Any = None
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: Mapping[int, float] | None = None
  allowed_token_ids: Sequence[int] | None = None
  banned_token_ids: Sequence[int] = ()
  min_tokens: int = 0
  bitmask_fn: Callable[[list[int]], Any] | None = None
  n: int = 1

  def processors_used(self) -> list[str]:
    """The processor fields set to something other than off."""
    return [name for name, off in PROCESSOR_DEFAULTS.items()
            if not _is_off(getattr(self, name), off)]


def _is_off(value, off) -> bool:
  """Whether a processor field's ``value`` means off: its default, an empty
  ``logit_bias`` or an empty ``banned_token_ids`` (anything else, of any
  type, is checked as a setting)."""
  if value is None:
    return True
  if off is None:
    return isinstance(value, Mapping) and not value
  if isinstance(off, tuple):
    return isinstance(value, (tuple, list)) and not value
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and value == off)


@dataclasses.dataclass(frozen=True)
class StreamEvent:
  """New tokens of one request (and, on the last event, how it finished).

  ``logprobs`` is None unless the request asked; ``top_logprobs`` (one
  entry per new token: ``{"logprob", "rank", "top"}``, the token's value and
  rank and ``(id, value)`` pairs, in the loop's ``logprobs_mode``) unless it
  asked for ``top_logprobs``; ``sampling_mask`` and
  ``logz`` (one entry per new token: the kept ids, or None where nothing was
  truncated; ``SamplingMask.to_lists``) are None unless it asked for masks.
  ``completion`` is set on the final event.  ``index``: the sample of the
  request (``Request.n``).
  """

  request_id: Any
  token_ids: list[int]
  logprobs: list[float] | None = None
  top_logprobs: list[dict] | None = None
  sampling_mask: list | None = None
  logz: list[float] | None = None
  finish_reason: str | None = None
  completion: "Completion | None" = None
  index: int = 0


@dataclasses.dataclass
class Completion:
  """A finished request: OpenAI-like fields plus speculation statistics.

  ``drafted`` / ``accepted`` count the draft tokens proposed for and accepted
  by the request's verification steps (0 without speculation);
  ``acceptance_rate`` is their ratio (None when nothing was drafted).
  ``error`` says why a request finished with ``finish_reason`` ``"error"``
  (its ``bitmask_fn`` or callback raised, ...), else None.  ``seed`` is the
  request's seed (drawn at ``submit`` if it gave none): passing it back
  reproduces the tokens; ``index`` the sample (``Request.n``).
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
  error: str | None = None
  seed: int | None = None
  index: int = 0

  @property
  def acceptance_rate(self) -> float | None:
    return self.accepted / self.drafted if self.drafted else None

  def to_openai(self, tokenizer=None) -> dict:
    """An OpenAI-like choice: ``id``, ``index``, ``token_ids``, ``text``
    (with a tokenizer that has ``decode``), ``logprobs``, ``sampling_mask``,
    ``logz`` (when asked), ``error`` (when set), ``finish_reason``,
    ``seed`` and ``usage`` (with speculation statistics)."""
    choice = {"id": self.request_id, "index": self.index,
              "token_ids": list(self.token_ids),
              "finish_reason": self.finish_reason, "seed": self.seed}
    if tokenizer is not None:
      choice["text"] = tokenizer.decode(self.token_ids)
    for name in ("logprobs", "top_logprobs", "sampling_mask", "logz",
                 "error"):
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
      benchmarks (``jaxsample._src.spec``, synthetic mode: every step verifies
      ``k`` drafts, the drafter's padded with the last token;
      ``spec_step``), else None.
  """

  drafter: Any
  draft_weights: Any = None
  synthetic_rates: Sequence[float] | None = None


@dataclasses.dataclass(frozen=True)
class ProcessorLimits:
  """Which logits processors a loop's requests may use, and the fixed widths
  of their per-slot tables (every slot carries them, used or not, so the
  programs compile once; a processor that is off costs nothing).

  Attributes:
    penalties: repetition, presence and frequency penalties (per slot: the
      prompt and output ids, ``cache_len`` each).
    logit_bias: most ``logit_bias`` entries per request (0: off).
    allowed_token_ids: most allowed ids per request (0: off).
    banned_token_ids: most banned ids per request (0: off).
    min_tokens: ``min_tokens`` (holds back the request's ``stop`` ids).
    bitmask: ``bitmask_fn`` grammar masks (plain decoding, one step per
      call: the host computes each step's mask).
  """

  penalties: bool = True
  logit_bias: int = 16
  allowed_token_ids: int = 64
  banned_token_ids: int = 16
  min_tokens: bool = True
  bitmask: bool = False

  def __post_init__(self):
    for name in ("logit_bias", "allowed_token_ids", "banned_token_ids"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ProcessorLimits.{name} must be an int >= 0 (the "
                         f"most ids per request; 0 turns it off); got "
                         f"{value!r}")


SEED_LIMIT = 2**32
_FIELDS = tuple(f.name for f in dataclasses.fields(Request))


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(
      value, (bool, np.bool_))


def _is_real(value) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and (
      not isinstance(value, (bool, np.bool_))) and math.isfinite(value)


def _is_sequence(value) -> bool:
  return isinstance(value, (Sequence, np.ndarray)) and not isinstance(
      value, (str, bytes))


def _show(value) -> str:
  """``repr(value)``, shortened to 60 characters."""
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _ids(name: str, value, what: str | None = None) -> np.ndarray:
  """``value``, a token id or a sequence of them, as int64 ``[n]``; else
  ``ValueError`` naming ``name`` (and saying ``what`` it must be)."""
  if _is_int(value):
    return np.asarray([value], np.int64)
  if _is_sequence(value) and all(map(_is_int, value)):
    return np.asarray(value, np.int64).reshape(-1)
  raise ValueError(f"{name}: {what or 'must be a token id or a list of them'}"
                   f" (ints; encode text with the tokenizer); got "
                   f"{_show(value)}")


def request_from_fields(fields: Mapping) -> Request:
  """A ``Request`` from a mapping of its fields (a JSON body), or
  ``ValueError`` naming the fields ``Request`` does not have."""
  unknown = sorted(set(map(str, fields)) - set(_FIELDS))
  if unknown:
    raise ValueError(f"unknown request field(s) {unknown}; a Request has "
                     f"{list(_FIELDS)}")
  if "prompt" not in fields:
    raise ValueError("prompt is required (a non-empty sequence of token ids)")
  return Request(**fields)


def check_limits(limits, speculation, steps_per_call: int
                 ) -> ProcessorLimits | None:
  """``ServeLoop``'s ``processors`` argument, checked against its
  ``speculation`` and ``steps_per_call``."""
  if limits is None:
    return None
  if not isinstance(limits, ProcessorLimits):
    raise ValueError(f"processors must be a ProcessorLimits or None; got "
                     f"{type(limits).__name__}")
  if limits.bitmask and speculation is not None:
    raise ValueError("ProcessorLimits(bitmask=True) needs plain decoding "
                     "(speculation=None): each drafted position would need "
                     "its own grammar mask")
  if limits.bitmask and steps_per_call != 1:
    raise ValueError("ProcessorLimits(bitmask=True) needs steps_per_call=1 "
                     "(the host computes every step's masks)")
  return limits


@dataclasses.dataclass(frozen=True)
class RequestRules:
  """What a loop accepts: ``check`` validates a request against it."""

  vocab_size: int
  cache_len: int
  max_stop_tokens: int
  top_logprobs: int
  return_masks: bool
  processors: ProcessorLimits | None = None

  def check_ids(self, name: str, ids: np.ndarray) -> None:
    """Raises ``ValueError`` naming ``name`` for an id outside ``[0, V)``."""
    bad = ids[(ids < 0) | (ids >= self.vocab_size)]
    if bad.size:
      raise ValueError(f"{name} has token id {int(bad[0])} outside the "
                       f"vocabulary [0, {self.vocab_size})")

  def check(self, request: Request
            ) -> tuple[Request, int, tuple[tuple[int, ...], ...]]:
    """Validates every field of ``request`` (``ServeLoop.submit``'s rules;
    ``ValueError`` naming the field); returns it canonical (``prompt`` a
    tuple of ints, ``stop`` its single stop ids and other id lists as
    sorted tuples, settings as Python numbers, ``logit_bias`` as ``{int:
    float}``), its budget (``max_tokens`` capped so the sequence fits the
    cache) and its multi-token stop sequences."""
    prompt = _ids("prompt", request.prompt)
    if prompt.size == 0:
      raise ValueError("prompt must be a non-empty list of token ids")
    if prompt.size >= self.cache_len:
      raise ValueError(f"prompt has {prompt.size} tokens; at most "
                       f"{self.cache_len - 1} fit the cache (cache_len "
                       f"{self.cache_len})")
    self.check_ids("prompt", prompt)
    stop, sequences = self._check_stop(request.stop)
    budget = request.max_tokens
    if not _is_int(budget) or budget < 1:
      raise ValueError(f"max_tokens must be an int >= 1; got {_show(budget)}")
    seed = request.seed
    if seed is not None and (not _is_int(seed) or not 0 <= seed < SEED_LIMIT):
      raise ValueError(f"seed must be an int in [0, 2^32) or None (a fresh "
                       f"one); got {_show(seed)}")
    rid = "new" if request.request_id is None else request.request_id
    try:
      hash(rid)
    except TypeError:
      raise ValueError(f"request_id must be hashable; got "
                       f"{type(rid).__name__}") from None
    changes = {"prompt": tuple(prompt.tolist()), "stop": stop,
               "max_tokens": int(budget),
               "seed": None if seed is None else int(seed)}
    for name in ("temperature", "top_k", "top_p", "min_p"):
      value = getattr(request, name)
      if not (isinstance(value, (int, float, np.integer, np.floating)) and
              not isinstance(value, (bool, np.bool_))):
        raise ValueError(f"{name} must be a number; got {_show(value)}")
      check_setting(name, rid, value)
      changes[name] = int(value) if name == "top_k" else float(value)
    for name in ("logprobs", "return_masks"):
      if not isinstance(getattr(request, name), (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False; got "
                         f"{_show(getattr(request, name))}")
      changes[name] = bool(getattr(request, name))
    if request.return_masks and not self.return_masks:
      raise ValueError("return_masks needs a ServeLoop built with "
                       "return_masks=True")
    top = request.top_logprobs
    if not _is_int(top) or not 0 <= top <= self.top_logprobs:
      raise ValueError(f"top_logprobs must be an int in [0, "
                       f"{self.top_logprobs}] (the loop's top_logprobs); got "
                       f"{_show(top)}")
    changes["top_logprobs"] = int(top)
    if not _is_int(request.n) or request.n < 1:
      raise ValueError(f"n must be an int >= 1 (samples of the prompt); got "
                       f"{_show(request.n)}")
    changes["n"] = int(request.n)
    request = self._check_processors(dataclasses.replace(request, **changes))
    return (request, min(int(budget), self.cache_len - prompt.size),
            sequences)

  def _check_stop(self, stop) -> tuple[tuple[int, ...],
                                       tuple[tuple[int, ...], ...]]:
    """``stop`` (a token id, or a list of ids and id lists) as its sorted
    single stop ids and its sorted multi-token sequences."""
    items = [stop] if _is_int(stop) else stop
    if not _is_sequence(items):
      raise ValueError(f"stop must be a token id or a list of token ids and "
                       f"lists of them (stop sequences); got {_show(stop)}")
    singles, sequences = set(), set()
    for item in items:
      ids = _ids("stop", item, "each stop must be a token id or a list of "
                               "them")
      if ids.size == 0:
        raise ValueError("stop has an empty stop sequence; drop it")
      self.check_ids("stop", ids)
      (singles.add(int(ids[0])) if ids.size == 1 else
       sequences.add(tuple(ids.tolist())))
    if len(singles) > self.max_stop_tokens:
      raise ValueError(f"stop has {len(singles)} single stop ids; this loop "
                       f"takes at most {self.max_stop_tokens} "
                       f"(max_stop_tokens; longer stop sequences are not "
                       f"counted)")
    return tuple(sorted(singles)), tuple(sorted(sequences))

  def _check_processors(self, request: Request) -> Request:
    used = request.processors_used()
    if not used:
      return request
    limits = self.processors
    if limits is None:
      raise ValueError(f"{used[0]} needs a ServeLoop built with "
                       "processors=ProcessorLimits(...)")
    changes = {}
    for name in used:
      value = getattr(request, name)
      if name.endswith("_penalty"):
        self._need(limits.penalties, name, "penalties=True")
        if not _is_real(value) or (name == "repetition_penalty" and
                                   value <= 0):
          raise ValueError(f"{name} must be a finite number" + (
              " > 0 (1 is off)" if name == "repetition_penalty" else
              " (0 is off)") + f"; got {value!r}")
      elif name == "logit_bias":
        changes[name] = self._check_bias(value, limits.logit_bias)
      elif name.endswith("_token_ids"):
        changes[name] = self._check_id_list(name, value, getattr(limits, name))
      elif name == "min_tokens":
        self._need(limits.min_tokens, name, "min_tokens=True")
        if not _is_int(value) or not 0 <= value <= request.max_tokens:
          raise ValueError(f"min_tokens must be an int in [0, max_tokens = "
                           f"{request.max_tokens}]; got {value!r}")
      else:
        self._need(limits.bitmask, name, "bitmask=True")
        if not callable(value):
          raise ValueError(f"bitmask_fn must be callable (generated ids -> "
                           f"allowed ids); got {type(value).__name__}")
    return dataclasses.replace(request, **changes)

  @staticmethod
  def _need(enabled, name: str, setting: str) -> None:
    if not enabled:
      raise ValueError(f"{name} needs a ServeLoop built with "
                       f"processors=ProcessorLimits({setting})")

  def _check_id_list(self, name: str, ids, limit: int) -> tuple[int, ...]:
    self._need(limit, name, f"{name}=N")
    unique = np.unique(_ids(name, ids))
    if name == "allowed_token_ids" and unique.size == 0:
      raise ValueError("allowed_token_ids must list at least one id (None "
                       "allows every id)")
    self.check_ids(name, unique)
    if unique.size > limit:
      raise ValueError(f"{name} has {unique.size} ids; this loop takes at "
                       f"most {limit} (ProcessorLimits.{name})")
    return tuple(unique.tolist())

  def _check_bias(self, bias, limit: int) -> dict[int, float]:
    self._need(limit, "logit_bias", "logit_bias=N")
    if not isinstance(bias, Mapping):
      raise ValueError(f"logit_bias must be a mapping {{token id: bias}}; got "
                       f"{type(bias).__name__}")
    pairs = {}
    for key, value in bias.items():
      token = int(key) if isinstance(key, str) and key.isdigit() else key
      if not _is_int(token):
        raise ValueError(f"logit_bias keys must be token ids; got {key!r}")
      self.check_ids("logit_bias", np.asarray([token]))
      if int(token) in pairs:
        raise ValueError(f"logit_bias lists token id {int(token)} twice")
      if not _is_real(value) or not abs(value) <= MAX_BIAS:
        raise ValueError(f"logit_bias[{key!r}] = {value!r}; biases must be "
                         f"numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
      pairs[int(token)] = float(value)
    if len(pairs) > limit:
      raise ValueError(f"logit_bias has {len(pairs)} entries; this loop takes "
                       f"at most {limit} (ProcessorLimits.logit_bias)")
    return pairs
