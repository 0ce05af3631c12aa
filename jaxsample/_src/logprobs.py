"""Logprob outputs beside ``sample``: top-n with ranks and the sampled token's
rank, in vLLM's four modes (``docs/processing.md``).

``mode`` picks the ``[B, V]`` values ``v`` reported:

* ``"raw_logprobs"``: ``log_softmax(x)`` of the model's logits ``x`` (fp32;
  before any processor, temperature or filter);
* ``"raw_logits"``: ``x`` in fp32;
* ``"processed_logprobs"``: ``log q``, the distribution ``sample`` draws from
  after the processors, temperature and the filters (``reference.log_probs``:
  -inf outside the kept set; a greedy row's point mass is 0 at its argmax);
* ``"processed_logits"``: the tempered processed logits ``y`` on the kept set
  (where ``log q > -inf``), -inf elsewhere.

Raw values of an invalid row (NaN, +inf or no finite logit) are -inf for
``raw_logprobs`` and the logits as given for ``raw_logits``.  The token's rank
is vLLM's: ``#{i : v_i >= v_token}`` (1 for the top value; tied tokens share
the largest rank).  The top-n are ``lax.top_k(v, n)`` (smallest id first
among equal values; computed in two stages over runs of ids,
``rowwise.top_k``; for ``raw_logprobs`` the runs' keys come from the read
of the logits that takes the row's max), ranks 1..n.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsample._src import reference, rowwise, xla_search
from jaxsample._src.params import SamplingParams
from jaxsample._src.processors import LogitsProcessors, maybe_apply
from jaxsample._src.dispatch import check_logits

__all__ = ["MAX_TOP", "MODES", "TokenLogprobs", "check_num_top",
           "mode_values", "raw_logprobs", "token_logprobs", "top_logprobs"]

MODES: tuple[str, ...] = ("raw_logprobs", "raw_logits", "processed_logprobs",
                          "processed_logits")
MAX_TOP = 20
"""The largest ``num_top`` (vLLM's and OpenAI's limit)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """Per row: the sampled token's value ``[B]`` and rank ``[B]`` (int32),
  and the top ``n`` ids ``[B, n]`` (int32) with their values ``[B, n]``
  (fp32; rank ``j + 1`` in column ``j``)."""

  token_values: jax.Array
  token_ranks: jax.Array
  top_ids: jax.Array
  top_values: jax.Array


def mode_values(logits: jax.Array, params: SamplingParams, mode: str, *,
                processors: LogitsProcessors | None = None) -> jax.Array:
  """fp32 ``[B, V]`` values of ``mode`` (module doc) for ``sample(logits,
  params, ..., processors=processors)``'s rows.

  Raises:
    ValueError: for a mode not in ``MODES``, or inputs ``sample`` rejects.
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
  logits = jnp.asarray(logits)
  params = check_logits(logits, params)
  if mode.startswith("raw"):
    x = logits.astype(jnp.float32)
    if mode == "raw_logits":
      return x
    return raw_logprobs(logits)[0]
  z = maybe_apply(logits, processors)
  with jax.ensure_compile_time_eval():  # concrete params stay concrete
    params = params.canonical(z.shape[1])
  process = xla_search.process if z.shape[0] else reference.process
  proc = process(z, params)
  log_q = reference.log_probs(proc, params)
  if mode == "processed_logprobs":
    return log_q
  return jnp.where(log_q > -jnp.inf, proc.y, -jnp.inf)


def raw_logprobs(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``where(valid, log_softmax(x), -inf)`` ``[B, V]`` and its
  ``rowwise.run_keys``, from one read of the row for both the max and the
  run keys, then one for the sum.

  The max is the largest run key of the sanitized row (NaN read as +inf:
  the max is finite iff the row is valid, and then it is ``log_softmax``'s
  max ``m``).  The values are ``jax.nn.log_softmax``'s expression, ``(x -
  m) - log(sum(exp(x - m)))``, so its bits (up to the sign of a zero max,
  which no value shows unless the row's log-sum is 0).  That expression is
  nondecreasing in ``x`` (each rounding is), so the largest value of a run
  is the expression at the run's largest logit: the values' run keys come
  from the logits' run maxima, with no read of the values (an invalid row's
  are all -inf's, as its values)."""
  x = logits.astype(jnp.float32)
  runs = rowwise.run_keys(reference.sanitize(logits))
  top = rowwise.key_values(jnp.max(runs, axis=-1, keepdims=True))
  valid = jnp.isfinite(top)
  shift = jnp.where(valid, top, 0.0)
  shifted = jnp.where(valid, x, 0.0) - shift
  log_sum = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
  values = lambda u: jnp.where(valid, (jnp.where(valid, u, 0.0) - shift)
                               - log_sum, -jnp.inf)
  return values(x), rowwise.total_order_keys(values(rowwise.key_values(runs)))


def check_num_top(num_top, vocab_size: int) -> int:
  """``num_top`` if it is an int in ``[0, min(20, V)]``.

  Raises:
    ValueError: naming ``num_top`` and its range otherwise.
  """
  if isinstance(num_top, bool) or not isinstance(num_top, int) or not (
      0 <= num_top <= min(MAX_TOP, vocab_size)):
    raise ValueError(f"num_top must be an int in [0, min({MAX_TOP}, V = "
                     f"{vocab_size})]; got {num_top!r}")
  return num_top


def top_logprobs(values: jax.Array, tokens: jax.Array, num_top: int, *,
                 runs: jax.Array | None = None) -> TokenLogprobs:
  """The token's value and rank and the top ``num_top`` of ``values``
  ``[B, V]`` (``mode_values``; module doc: ranks and ties); ``runs``:
  ``rowwise.run_keys(values)`` when the caller has them.

  Raises:
    ValueError: ``num_top`` outside ``[0, min(20, V)]`` or tokens that are
      not ``[B]``.
  """
  vocab = values.shape[-1]
  check_num_top(num_top, vocab)
  tokens = jnp.asarray(tokens)
  if tokens.shape != values.shape[:1]:
    raise ValueError(f"tokens must be [B] = {values.shape[:1]}; got shape "
                     f"{tokens.shape}")
  token = jnp.clip(tokens.astype(jnp.int32), 0, vocab - 1)
  token_values = jnp.take_along_axis(values, token[:, None], axis=-1)
  ranks = jnp.sum(values >= token_values, axis=-1, dtype=jnp.int32)
  top_values, top_ids = rowwise.top_k(values, num_top, runs=runs)
  return TokenLogprobs(token_values[:, 0], ranks, top_ids, top_values)


def token_logprobs(logits: jax.Array, params: SamplingParams,
                   tokens: jax.Array, *, num_top: int = 0,
                   mode: str = "raw_logprobs",
                   processors: LogitsProcessors | None = None
                   ) -> TokenLogprobs:
  """The logprob outputs of ``tokens`` ``[B]`` sampled from ``logits``
  ``[B, V]`` (module doc): ``top_logprobs(mode_values(...), tokens,
  num_top)``; jit it beside ``sample`` with ``num_top`` and ``mode`` static
  and the same ``params`` and ``processors``.

  Raises:
    ValueError: ``num_top`` outside ``[0, min(20, V)]``, a bad mode, or
      tokens that are not ``[B]``.
  """
  check_num_top(num_top, jnp.shape(logits)[-1])
  if mode != "raw_logprobs":
    return top_logprobs(
        mode_values(logits, params, mode, processors=processors), tokens,
        num_top)
  logits = jnp.asarray(logits)
  check_logits(logits, params)
  values, runs = raw_logprobs(logits)
  return top_logprobs(values, tokens, num_top, runs=runs)
