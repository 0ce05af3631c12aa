"""Host side of admission: a request checked against the loop's limits
(``RequestRules``), and a batch of requests as the admission program's
fixed-shape arrays (``admission_inputs``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxsample.generation.requests import Request
from jaxsample.params import SamplingParams, check_setting

__all__ = ["SEED_LIMIT", "RequestRules", "admission_inputs"]

SEED_LIMIT = 2**32


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(
      value, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class RequestRules:
  """What a loop accepts: ``check`` validates a request against it."""

  vocab_size: int
  cache_len: int
  max_stop_tokens: int
  top_logprobs: int
  return_masks: bool

  def check_ids(self, name: str, ids: np.ndarray) -> None:
    """Raises ``ValueError`` naming ``name`` for an id outside ``[0, V)``."""
    bad = ids[(ids < 0) | (ids >= self.vocab_size)]
    if bad.size:
      raise ValueError(f"{name} has token id {int(bad[0])} outside the "
                       f"vocabulary [0, {self.vocab_size})")

  def check(self, request: Request) -> int:
    """Validates ``request`` (``ServeLoop.submit``'s rules) and returns its
    budget: ``max_tokens`` capped so the sequence fits the cache."""
    prompt = np.asarray(request.prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not (
        np.issubdtype(prompt.dtype, np.integer)):
      raise ValueError(f"prompt must be a non-empty sequence of token ids; got "
                       f"{request.prompt!r}")
    if prompt.size >= self.cache_len:
      raise ValueError(f"prompt has {prompt.size} tokens; at most "
                       f"{self.cache_len - 1} fit the cache (cache_len "
                       f"{self.cache_len})")
    self.check_ids("prompt", prompt)
    stop = np.asarray(request.stop, np.int64).reshape(-1)
    if stop.size > self.max_stop_tokens:
      raise ValueError(f"stop has {stop.size} ids; this loop takes at most "
                       f"{self.max_stop_tokens} (max_stop_tokens)")
    self.check_ids("stop", stop)
    budget = request.max_tokens
    if not _is_int(budget) or budget < 0:
      raise ValueError(f"max_tokens must be an int >= 0; got {budget!r}")
    seed = request.seed
    if not _is_int(seed) or not 0 <= seed < SEED_LIMIT:
      raise ValueError(f"seed must be an int in [0, 2^32); got {seed!r}")
    rid = "new" if request.request_id is None else request.request_id
    for name in ("temperature", "top_k", "top_p", "min_p"):
      check_setting(name, rid, getattr(request, name))
    if request.return_masks and not self.return_masks:
      raise ValueError("return_masks needs a ServeLoop built with "
                       "return_masks=True")
    top = request.top_logprobs
    if not _is_int(top) or not 0 <= top <= self.top_logprobs:
      raise ValueError(f"top_logprobs must be an int in [0, "
                       f"{self.top_logprobs}] (the loop's top_logprobs); got "
                       f"{top!r}")
    return min(int(budget), self.cache_len - prompt.size)


def admission_inputs(batch: Sequence[tuple[Request, int]], rows: int,
                     width: int, max_stop_tokens: int):
  """The admission program's inputs for ``(request, budget)`` pairs in
  ``rows`` rows (the rest padding) with prompts in ``width`` columns:
  ``(tokens, lengths, params, keys, stop_ids, budgets)``."""
  tokens = np.zeros((rows, width), np.int32)
  lengths = np.ones(rows, np.int32)
  fields = {"temperature": np.zeros(rows, np.float32),
            "top_k": np.zeros(rows, np.int32),
            "top_p": np.ones(rows, np.float32),
            "min_p": np.zeros(rows, np.float32)}
  keys = np.zeros((rows, 2), np.uint32)
  stop_ids = np.full((rows, max_stop_tokens), -1, np.int32)
  budgets = np.zeros(rows, np.int32)
  for row, (request, budget) in enumerate(batch):
    tokens[row, :len(request.prompt)] = request.prompt
    lengths[row] = len(request.prompt)
    for name, values in fields.items():
      # top_k beyond int32 means off, as does the clipped value.
      values[row] = np.clip(getattr(request, name), -2**31 + 1, 2**31 - 1)
    keys[row, 1] = request.seed
    stop_ids[row, :len(request.stop)] = request.stop
    budgets[row] = budget
  return (tokens, lengths, SamplingParams(**fields), keys, stop_ids, budgets)
