"""A ``ServeLoop`` request's host state (``Tracked``): its completion so
far, the outputs read for it, and its multi-token stop sequences."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxsample.generation.generate import FINISH_REASONS
from jaxsample.generation.requests import Completion, Request, StreamEvent

__all__ = ["Tracked"]


@dataclasses.dataclass(eq=False)
class Tracked:
  """Host bookkeeping of a request, queued or in slot ``slot``.

  ``index``: the sample (``Request.n``).  ``sequences``: its multi-token
  stop sequences (matched on the host).
  ``promised``: the fewest tokens the programs dispatched for it emit unless
  it finishes first (1 per admission, 1 per step); at ``budget`` it will
  have finished once they ran.  ``released``: its slot was handed on
  (``ServeLoop._release_finishing``) before its last outputs were read.
  """

  request: Request
  budget: int
  completion: Completion
  callback: Callable[[StreamEvent], None] | None
  index: int = 0
  sequences: tuple[tuple[int, ...], ...] = ()
  slot: int = -1
  promised: int = 0
  released: bool = False

  @classmethod
  def start(cls, request: Request, budget: int, callback, index: int,
            sequences: tuple[tuple[int, ...], ...]) -> "Tracked":
    """Sample ``index`` of a checked ``request`` (id and seed set) with an
    empty completion."""
    return cls(request, budget, Completion(
        request.request_id, len(request.prompt), [],
        [] if request.logprobs else None,
        [] if request.return_masks else None,
        [] if request.return_masks else None,
        [] if request.top_logprobs else None, seed=request.seed,
        index=index), callback, index, sequences)

  def reason_by_rule(self) -> str:
    """The finish reason by ``generate``'s rule for the last token: a stop
    id, the budget, else invalid logits."""
    ids = self.completion.token_ids
    if ids and ids[-1] in set(self.request.stop):
      return FINISH_REASONS[0]
    return FINISH_REASONS[1 if len(ids) >= self.budget else 2]

  def final_event(self) -> StreamEvent:
    """The finished request's final event without new tokens."""
    return StreamEvent(self.request.request_id, [],
                       finish_reason=self.completion.finish_reason,
                       completion=self.completion, index=self.index)

  def advance(self, host, row: int, emitted: np.ndarray, tokens: list[int],
              logprobs: list[float]) -> dict:
    """Appends row ``row``'s ``tokens`` and ``logprobs`` (where ``emitted``
    ``[n, R, E]``) of ``host`` (a ``slot_programs.Output`` on the host)
    and what else the request asked for to its completion; returns them
    as ``StreamEvent`` fields (one list entry per token each)."""
    request, done = self.request, self.completion
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

  def cut_at_stop(self, fields: dict) -> str | None:
    """Cuts the new tokens (``advance``'s ``fields``, and the completion)
    after the first match of a multi-token stop sequence
    (``stop_end``); returns ``"stop"`` if one matched."""
    done = self.completion
    end = stop_end(done.token_ids, len(fields["token_ids"]), self.sequences,
                   self.request.min_tokens)
    if end is None:
      return None
    excess = len(done.token_ids) - end
    for name, values in fields.items():
      fields[name] = values[:len(values) - excess]
      del getattr(done, name)[len(getattr(done, name)) - excess:]
    return FINISH_REASONS[0]


def stop_end(tokens: Sequence[int], new: int,
             sequences: Sequence[tuple[int, ...]], min_tokens: int
             ) -> int | None:
  """The output length at which a multi-token stop sequence first ends
  within the last ``new`` of ``tokens`` (the output so far), or None.  A
  match counts only past ``min_tokens`` tokens (its last token is token
  ``min_tokens + 1`` or later, as single stop ids are held back); the
  output is then cut after it (its tokens are kept, as a stop id is)."""
  for end in range(max(len(tokens) - new + 1, min_tokens + 1),
                   len(tokens) + 1):
    for sequence in sequences:
      if end >= len(sequence) and tuple(
          tokens[end - len(sequence):end]) == sequence:
        return end
  return None
