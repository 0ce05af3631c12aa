"""What a ``ServeLoop`` takes and gives: ``Request``, ``StreamEvent``,
``Completion`` and the ``Speculation`` setting (``docs/serving.md``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["Completion", "Request", "Speculation", "StreamEvent"]


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
