"""What a ``ServeLoop`` takes and gives: ``Request``, ``StreamEvent``,
``Completion``, and the loop's ``Speculation`` and ``ProcessorLimits``
settings (``docs/serving.md``)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["ABORT", "ERROR", "PROCESSOR_DEFAULTS", "Completion", "ProcessorLimits",
           "Request", "Speculation", "StreamEvent"]

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
