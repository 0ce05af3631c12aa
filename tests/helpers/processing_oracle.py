"""Numpy oracles of logits processing and logprob outputs, shared by
``test_processors.py`` and ``test_logprobs.py``.

Independent re-implementations of the documented math
(``jaxsample/processors.py``, ``jaxsample/logprobs.py`` module docs,
``docs/processing.md``); they never call the code under test.
"""

from __future__ import annotations

import numpy as np

from helpers.oracle import oracle_keep


def bitmask_width(vocab: int) -> int:
  return -(-vocab // 32)


def random_case(rng, batch, vocab, *, grid=False):
  """Logits with ties, zeros and -inf entries, and per-request Python specs
  of every processor (lists with duplicates, empty rows, edge bitmask words).

  ``grid``: every value on a grid of 1/4 (half-integer logits, penalties and
  biases that keep them there), so values that differ differ by at least 1/8
  and exact ties stay exact through any monotone fp32 computation.
  """
  logits = (rng.integers(-6, 7, (batch, vocab)) / 2).astype(np.float32)
  logits[rng.random((batch, vocab)) < 0.1] = -np.inf
  ids = lambda n: [int(i) for i in rng.integers(0, vocab, n)]
  maybe = lambda make: [make() if rng.random() < 0.7 else None
                        for _ in range(batch)]
  words = rng.integers(-2**31, 2**31, (batch, bitmask_width(vocab)))
  words[rng.random(words.shape) < 0.3] = -1  # all 32 ids allowed, past V too
  if grid:
    repetition = rng.choice([0.5, 1.0, 2.0], batch)
    presence, frequency = (rng.integers(-2, 3, batch) / 4 for _ in range(2))
    bias = lambda: float(rng.integers(-8, 9) / 4)
  else:
    repetition = rng.uniform(0.5, 2.0, batch)
    presence, frequency = (rng.uniform(-1, 1, batch) for _ in range(2))
    bias = lambda: float(rng.uniform(-5, 5))
  kw = dict(
      repetition_penalty=[float(v) for v in repetition],
      presence_penalty=[float(v) for v in presence],
      frequency_penalty=[float(v) for v in frequency],
      logit_bias=maybe(lambda: {i: bias() for i in ids(3)}),
      allowed_token_ids=maybe(lambda: ids(rng.integers(1, 8))),
      banned_token_ids=maybe(lambda: ids(2)),
      min_tokens=[int(v) for v in rng.integers(0, 4, batch)],
      stop_token_ids=[ids(2) for _ in range(batch)],
      prompt_token_ids=maybe(lambda: ids(6)),
      output_token_ids=maybe(lambda: ids(rng.integers(0, 6))),
      history_width=8,
      bitmask=words.astype(np.int32))
  return logits, kw


def process_oracle(logits, kw):
  """The processors' math (``jaxsample/processors.py``), row by row in numpy
  float32: bias, penalties, then the masks."""
  z = np.array(logits, np.float32)
  batch, vocab = z.shape
  for b in range(batch):
    for i, v in (kw["logit_bias"][b] or {}).items():
      z[b, i] += np.float32(v)
    out = kw["output_token_ids"][b] or []
    counts = np.bincount(np.asarray(out, int), minlength=vocab)[:vocab]
    seen = counts > 0
    seen[kw["prompt_token_ids"][b] or []] = True
    rep = np.float32(kw["repetition_penalty"][b])
    z[b] = np.where(seen, np.where(z[b] > 0, z[b] / rep, z[b] * rep), z[b])
    z[b] -= np.float32(kw["frequency_penalty"][b]) * counts.astype(np.float32)
    z[b] -= np.float32(kw["presence_penalty"][b]) * (counts > 0)
    keep = np.ones(vocab, bool)
    if kw["allowed_token_ids"][b]:
      keep[:] = False
      keep[kw["allowed_token_ids"][b]] = True
    keep[kw["banned_token_ids"][b] or []] = False
    words = kw["bitmask"][b].astype(np.int64) & 0xFFFFFFFF
    keep &= [(words[v // 32] >> (v % 32)) & 1 == 1 for v in range(vocab)]
    if len(out) < kw["min_tokens"][b]:
      keep[kw["stop_token_ids"][b]] = False
    z[b] = np.where(keep, z[b], -np.inf)
  return z


def _valid(x) -> bool:
  """A row the sampler accepts: no NaN, no +inf, a finite entry."""
  return not np.any(np.isnan(x)) and not np.any(x == np.inf) and bool(
      np.any(np.isfinite(x)))


def _log_softmax(x, kept):
  x = np.asarray(x, np.float64)
  shifted = np.where(kept, x - x[kept].max(), -np.inf)
  return shifted - np.log(np.sum(np.exp(shifted)))


def mode_oracle(mode, logits, processed, temperature, top_k, top_p, min_p):
  """float64 ``[B, V]`` values of a logprob ``mode`` (``jaxsample._src.logprobs``):
  raw modes from the model's ``logits``, processed modes from the
  ``processed`` logits (``process_oracle``) tempered and truncated
  (``helpers.oracle.oracle_keep``; a row near a top-p/min-p rounding boundary is
  an error: pick cases away from them)."""
  x = np.asarray(logits, np.float32)
  if mode == "raw_logits":
    return x.astype(np.float64)
  out = np.full(x.shape, -np.inf)
  for b in range(x.shape[0]):
    if mode == "raw_logprobs":
      if _valid(x[b]):
        out[b] = _log_softmax(x[b], np.isfinite(x[b]))
      continue
    z = np.asarray(processed[b], np.float32)
    if not _valid(z):
      continue
    if temperature[b] == 0:  # greedy: a point mass at the first argmax
      kept = np.arange(z.size) == np.argmax(z)
      log_q = np.where(kept, 0.0, -np.inf)
      y = z.astype(np.float64)
    else:
      y = z.astype(np.float64) / np.float64(np.float32(temperature[b]))
      keep = oracle_keep(y, top_k[b], top_p[b], min_p[b])
      assert not keep.near_boundary, f"row {b} lies near a rounding boundary"
      kept = keep.kept
      log_q = _log_softmax(y, kept)
    out[b] = log_q if mode == "processed_logprobs" else np.where(
        kept, y, -np.inf)
  return out


def top_oracle(values, n):
  """``(ids, values)`` of the ``n`` largest per row, smallest id first
  among equal values (a stable sort)."""
  order = np.argsort(-values, axis=-1, kind="stable")[:, :n]
  return order, np.take_along_axis(values, order, axis=-1)


def rank_oracle(values, tokens):
  """vLLM's rank of each row's token: ``#{i : v_i >= v_token}``."""
  token_values = values[np.arange(len(tokens)), tokens]
  return np.sum(values >= token_values[:, None], axis=-1)
