"""Host side of admission: a request checked against the loop's limits
(``RequestRules``), a batch of requests as the admission program's
fixed-shape arrays (``admission_inputs``, ``slot_processors``) and a
``bitmask_fn`` result as packed words (``pack_host_bitmask``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxsample.generation.requests import ProcessorLimits, Request
from jaxsample._src.params import SamplingParams, check_setting
from jaxsample._src.processors import (MAX_BIAS, LogitsProcessors,
                                       bitmask_width, neutral_field)

__all__ = ["SEED_LIMIT", "RequestRules", "admission_inputs", "check_limits",
           "pack_host_bitmask", "request_from_fields", "share_prompts",
           "slot_processors", "stop_end"]

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
