"""Pure-JAX (XLA) reference sampler: the definition every kernel must match.

Processing of one row with logits ``x`` (any float dtype, computed in fp32),
canonical parameters (``SamplingParams.canonical``) and Gumbel noise ``g``:

1. Sanitize: NaN entries become +inf.
2. Temperature: ``y = x / T`` in fp32 by one formula, ``divide``, for every
   element of every path (rows, the sampled token, kernels): on NVIDIA GPUs
   XLA's division, ``div.full.f32`` (within 2 ulp of the IEEE quotient),
   which the kernels issue too; elsewhere ``x * (1 / T)`` (what XLA:CPU
   makes of a division by a broadcast).  Greedy rows (T = 0, which includes
   every T below ``params.MIN_TEMPERATURE`` = 1e-5) keep ``y = x``.  The row
   is *valid* iff ``max(y)`` is finite: no NaN, no +inf, at least one finite
   entry, and no overflow of ``x / T`` (for T >= 1e-5 only where ``|x| >
   3.4e33``).
3. Greedy rows and invalid rows: ``token = argmax(y)`` (smallest index on
   ties, so the first NaN/+inf/overflowing entry of an invalid row, or 0 for
   an all -inf row), no noise.  ``logprob`` is 0 for valid greedy rows (the
   processed distribution is a point mass) and -inf for invalid rows.
4. Every filter keeps an upward-closed set ``{i : y_i >= t}`` (ties at a
   threshold are all kept), and -inf entries are never kept:

   * min-p: ``t1 = max(y) + log(min_p)``;
   * top-k: ``t2`` = the k-th largest ``y`` among the survivors of min-p;
   * top-p: ``t3`` = the largest value ``v`` such that the mass of
     ``{y >= v}`` reaches ``p`` under the distribution renormalized on the
     survivors of min-p and top-k, i.e. ``sum_{y_i >= v} e_i >= p * sum e``
     with ``e_i = exp(y_i - max(y))`` on the survivors (the crossing token is
     kept).

   The kept set is ``K = {i : y_i >= max(t1, t2, t3), y_i > -inf}``.
5. Gumbel-max on the kept set: ``token = argmax_{i in K} (y_i + g_i)``.  Without
   truncation and with one threefry key this is
   ``jax.random.categorical(key, x / T)`` bit for bit.
6. ``logprob = y_token - logsumexp_{i in K}(y_i)``, the log-probability under
   the truncated, renormalized distribution, evaluated as
   ``(y_token - shift) - log(sum_K exp(y_i - shift))`` for a shift near
   ``max(y)`` so large tempered logits do not cancel in fp32.

With ``fp64`` the noise and the comparison ``y_i + g_i`` are fp64 (``y`` is
the fp32 tempered logit, widened).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsample._src import rng, rowwise
from jaxsample._src.params import SamplingParams

__all__ = ["divide", "exact_sum", "finalize", "fixed_point_digits",
           "fixed_point_limbs", "keep_threshold", "limbs_to_float", "log_probs", "logsumexp_where", "process", "Processed", "race_tokens",
           "sample_reference", "SampleResult", "sanitize", "temper", "top_ids"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
  """Sampled tokens ``[B]`` int32, their logprobs ``[B]`` fp32 (None when
  the call asked for none: ``SamplerConfig(logprobs=False)``) and row
  validity ``[B]``."""

  tokens: jax.Array
  logprobs: jax.Array | None
  valid: jax.Array


def sanitize(logits: jax.Array) -> jax.Array:
  """fp32 logits with NaN replaced by +inf (so invalid rows show in the max)."""
  x = logits.astype(jnp.float32)
  return jnp.where(jnp.isnan(x), jnp.inf, x)


def divide(x: jax.Array, t: jax.Array) -> jax.Array:
  """fp32 ``x / t`` (broadcast) as every path computes a tempered logit:
  XLA's division on CUDA (``div.full.f32``, the kernels' ``gpu_div``),
  ``x * (1 / t)`` on other platforms (the kernels' interpret mode)."""
  return jax.lax.platform_dependent(
      x, t, cuda=lambda x, t: x / t, default=lambda x, t: x * (1.0 / t))


def temper(x: jax.Array, temperature: jax.Array) -> jax.Array:
  """``x / T`` per row (``divide``) for sampled rows (T > 0); greedy rows are
  left as is.  ``temperature`` ``[B]`` for ``x`` ``[B, ...]``."""
  t = temperature.reshape(temperature.shape + (1,) * (x.ndim - 1))
  return jnp.where(t > 0, divide(x, jnp.where(t > 0, t, 1.0)), x)


def keep_threshold(y: jax.Array, params: SamplingParams,
                   order_width: int = 0):
  """Per-row threshold ``t`` of the kept set ``{y >= t, y > -inf}`` (sort-based).

  ``y`` are tempered, sanitized logits of valid rows and ``params`` canonical.
  With ``order_width``, returns ``(t, order)``: ``order`` ``[B, order_width]``
  the first ids of each row by descending ``y``, smallest id first among
  equal values (``top_ids``).
  """
  ys = -jnp.sort(-y, axis=-1)  # descending
  y_max = ys[:, 0]
  finite = ys > -jnp.inf
  log_min_p = jnp.log(params.min_p)
  t1 = jnp.where(params.min_p > 0, y_max + log_min_p, -jnp.inf)
  n1 = jnp.sum(finite & (ys >= t1[:, None]), axis=-1)
  k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, n1), n1)
  t2 = jnp.take_along_axis(ys, jnp.maximum(k - 1, 0)[:, None], axis=-1)[:, 0]
  survivors = finite & (ys >= t2[:, None])
  e = jnp.where(survivors, jnp.exp(ys - y_max[:, None]), 0.0)
  cumulative = jnp.cumsum(e, axis=-1)
  total = cumulative[:, -1]
  reached = cumulative >= (params.top_p * total)[:, None]
  first = jnp.argmax(reached, axis=-1)
  t3 = jnp.take_along_axis(ys, first[:, None], axis=-1)[:, 0]
  t3 = jnp.where(params.top_p < 1, t3, -jnp.inf)
  threshold = jnp.maximum(jnp.maximum(t1, t2), t3)
  return ((threshold, top_ids(y, ys[:, order_width - 1], order_width))
          if order_width else threshold)


def top_ids(y: jax.Array, last: jax.Array, width: int) -> jax.Array:
  """The first ``width`` ids of each row of ``y`` by descending value,
  smallest id first among equal values (``width <= V``; ``last`` ``[B]`` is
  the row's ``width``-th largest value: ``sorted(y)[::-1][width - 1]``; a
  larger ``last`` lists the entries reaching it first, then undefined ids).

  Equivalent to a stable key-value sort of ``(-y, ids)`` cut to ``width``,
  without sorting ``[B, V]`` pairs: the entries above the ``width``-th
  largest value, then its ties, are compacted in vocab order (two prefix
  sums, no ``lax.cond``: ties past the ``width`` slots drop), and only those
  ``[B, width]`` pairs are sorted.
  """
  batch = y.shape[0]
  last = last[:, None]
  reach = y >= last
  above = y > last
  count = lambda m: jnp.cumsum(m, axis=-1, dtype=jnp.int32) - 1
  slot = jnp.where(above, count(above),
                   jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32) +
                   count(reach & ~above))
  rows = jax.lax.broadcasted_iota(jnp.int32, y.shape, 0)
  ids = jax.lax.broadcasted_iota(jnp.int32, y.shape, 1)
  top = jnp.zeros((batch, width), jnp.int32).at[rows, jnp.where(
      reach, slot, width)].set(ids, mode="drop")
  # Slots no entry filled (fewer than ``width`` reach ``last``) sort last.
  filled = jnp.arange(width, dtype=jnp.int32) < jnp.sum(
      reach, axis=-1, keepdims=True, dtype=jnp.int32)
  values = jnp.where(filled, jnp.take_along_axis(y, top, axis=-1), -jnp.inf)
  # Equal values sit in vocab order, so (value, id) keys order them as a
  # stable sort would; an unstable sort of two operands is cheaper than a
  # stable one (XLA adds a third, an iota): 36.0-38.5 against 50.3-53.2 us
  # for [B, 4096] pairs on an H200 at B = 1-128 (scripts/bench_sort.py).
  _, order = jax.lax.sort((-values, top), num_keys=2, is_stable=False)
  return order


LIMB_BITS = 12
LIMBS = 5
MAX_SUM_TERMS = 2**19
"""``exact_sum`` adds at most this many terms (int32 limb sums)."""


def fixed_point_limbs(e: jax.Array) -> jax.Array:
  """Integer sums ``[..., LIMBS]`` of the base-2^12 digits of terms ``e``
  ``[..., n]`` in [0, 1] (fp32), ``n <= MAX_SUM_TERMS``: digit ``k`` of
  ``e`` is ``floor(e 2^(12 (k + 1))) mod 2^12`` (the first one may be 2^12
  for ``e = 1``), so the terms are cut to multiples of 2^-60.  Integer
  sums: the same whatever the order or grouping of the terms (rows of any
  batch, vocab shards added with ``psum``).  One reduction adds the five
  digits together, so each term is computed once (five sums cost XLA:CPU
  the terms' ``exp`` five times)."""
  digits = fixed_point_digits(e)
  sums = jax.lax.reduce(tuple(digits), (jnp.int32(0),) * LIMBS,
                        lambda a, b: tuple(u + v for u, v in zip(a, b)),
                        (e.ndim - 1,))
  return jnp.stack(sums, axis=-1)


def fixed_point_digits(e: jax.Array) -> list[jax.Array]:
  """The ``LIMBS`` int32 base-2^12 digits of each term ``e`` in [0, 1]
  (``fixed_point_limbs``' terms, before their sums)."""
  digits = []
  rest = jnp.minimum(e.astype(jnp.float32), 1.0)  # inf: invalid rows
  for _ in range(LIMBS):
    rest = rest * float(2**LIMB_BITS)  # exact: a power of 2
    digit = jnp.floor(rest)
    rest = rest - digit  # exact: the fraction of an fp32
    digits.append(digit.astype(jnp.int32))
  return digits


def limbs_to_float(limbs: jax.Array) -> jax.Array:
  """fp32 value ``sum_k limbs_k 2^(-12 (k + 1))`` of ``fixed_point_limbs``'
  sums: carries normalized in integers, then one fp32 Horner pass from the
  lowest digit (deterministic; within 1 ulp of the exact value)."""
  digits = [limbs[..., k] for k in range(LIMBS)]
  for k in range(LIMBS - 1, 0, -1):
    digits[k - 1] = digits[k - 1] + (digits[k] >> LIMB_BITS)
    digits[k] = digits[k] & (2**LIMB_BITS - 1)
  value = digits[-1].astype(jnp.float32)
  for digit in digits[-2::-1]:
    value = digit.astype(jnp.float32) + value * float(2**-LIMB_BITS)
  return value * float(2**-LIMB_BITS)


def exact_sum(e: jax.Array) -> jax.Array:
  """``sum(e, axis=-1)`` for terms in [0, 1], independent of the order and
  grouping of the terms (``fixed_point_limbs``); a float sum's rounding
  depends on how XLA tiles the reduction, which changes with the batch
  size.  Each term is cut to a multiple of 2^-60: an error below ``n``
  2^-60, far under fp32's 2^-24 relative of a sum ``>= 1``."""
  if e.shape[-1] > MAX_SUM_TERMS:
    raise ValueError(
        f"the XLA paths sum at most {MAX_SUM_TERMS} vocab entries per row; "
        f"got V = {e.shape[-1]}: use implementation='pallas'")
  return limbs_to_float(fixed_point_limbs(e))


def logsumexp_where(y: jax.Array, keep: jax.Array):
  """``(shift, log(sum_{keep} exp(y - shift)))`` per row, shift = kept max;
  the sum is ``exact_sum``'s (bit-identical for any batch or vocab split)."""
  m = jnp.max(jnp.where(keep, y, -jnp.inf), axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  s = exact_sum(jnp.where(keep, jnp.exp(y - m_safe), 0.0))
  return m_safe[:, 0], jnp.log(s)


def holding_token(log_sum: jax.Array, token_gap: jax.Array) -> jax.Array:
  """``log_sum`` of a normalizer ``shift + log_sum`` over a kept set that
  holds the token, raised to at least the token's own term ``token_gap =
  y_token - shift``: then ``logprob = token_gap - log_sum <= 0``.  A no-op
  where the sum is exact (it holds ``exp(token_gap)``); the kernels' sums
  (``ex2.approx`` of ``x * (1 / T)`` against a race bound) can fall short
  by about an ulp of the largest tempered logit, which at small T is more
  than the token's term."""
  return jnp.maximum(log_sum, token_gap)


def finalize(x_token: jax.Array, params: SamplingParams, tokens: jax.Array,
             log_normalizer: tuple[jax.Array, jax.Array],
             row_max: jax.Array) -> SampleResult:
  """Logprobs and validity from per-row statistics (steps 2, 3 and 6).

  ``x_token`` is the sanitized logit of ``tokens`` (already chosen by the
  greedy / invalid-row rule), ``log_normalizer`` the ``(shift, log_sum)`` pair
  with ``logsumexp_K(y) = shift + log_sum`` (``holding_token`` applied) and
  ``row_max`` the max of the tempered logits (valid iff finite).
  """
  valid = jnp.isfinite(row_max)
  greedy = params.temperature == 0
  shift, log_sum = log_normalizer
  # The token's y by the rows' own formula: y_token <= shift = max_K(y).
  y_token = temper(x_token, params.temperature)
  log_sum = holding_token(log_sum, y_token - shift)
  logprobs = jnp.where(greedy, 0.0, (y_token - shift) - log_sum)
  logprobs = jnp.where(valid, logprobs, -jnp.inf)
  return SampleResult(tokens, logprobs.astype(jnp.float32), valid)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Processed:
  """Steps 1-4 of a batch of rows, plus the log-normalizer of step 6.

  ``x`` sanitized fp32 logits, ``y`` tempered logits, ``keep`` the kept set
  ``K`` (all ``[B, V]``), ``row_max = max(y)`` (the row is valid iff finite),
  ``logsumexp_K(y) = shift + log_sum`` (``[B]`` each) and, when asked for,
  ``order`` ``[B, W]``: ``keep_threshold``'s first ids by descending ``y``
  (meaningful on valid rows when some row truncates).
  """

  x: jax.Array
  y: jax.Array
  keep: jax.Array
  row_max: jax.Array
  shift: jax.Array
  log_sum: jax.Array
  order: jax.Array | None = None


def process(logits: jax.Array, params: SamplingParams, *,
            order_width: int = 0) -> Processed:
  """Steps 1-4 and the step-6 normalizer for canonical params (no noise);
  with ``order_width``, also ``order`` (``min(order_width, V)`` wide)."""
  batch, vocab = logits.shape
  width = min(order_width, vocab)
  x = sanitize(logits)
  y = temper(x, params.temperature)
  valid_rows = jnp.isfinite(jnp.max(y, axis=-1, keepdims=True))
  y_safe = jnp.where(valid_rows, y, 0.0)  # keeps the threshold search NaN-free
  # The sort-based search runs only when some row truncates.
  def untruncated():
    threshold = jnp.full((batch,), -jnp.inf, y.dtype)
    return (threshold, jnp.zeros((batch, width), jnp.int32)) if width else (
        threshold)

  found = rowwise.manual_cond(jnp.any(params.truncates()),
                              lambda: keep_threshold(y_safe, params, width),
                              untruncated)
  threshold, order = found if width else (found, None)
  keep = (y >= threshold[:, None]) & (y > -jnp.inf)
  shift, log_sum = logsumexp_where(y, keep)
  return Processed(x, y, keep, jnp.max(y, axis=-1), shift, log_sum, order)


def _first_argmax(values: jax.Array) -> jax.Array:
  return jnp.argmax(values, axis=-1).astype(jnp.int32)


def log_probs(proc: Processed, params: SamplingParams, *,
              argmax=_first_argmax, first_id=0) -> jax.Array:
  """``log q`` ``[B, V]``: log-probabilities of the processed distribution.

  Sampled valid rows: ``(y_i - shift) - log_sum`` on ``K`` and -inf outside
  (step 6 for every ``i``); valid greedy rows: 0 at ``argmax(y)`` and -inf
  elsewhere (a point mass); invalid rows: -inf everywhere.  Rows split over
  devices (``proc`` holds this device's columns, from global id
  ``first_id``): ``argmax`` gives the global id of the row's first largest
  value (``xla_search.Split.argmax``).
  """
  valid = jnp.isfinite(proc.row_max)[:, None]
  greedy = (params.temperature == 0)[:, None]
  sampled = jnp.where(proc.keep, (proc.y - proc.shift[:, None]) -
                      proc.log_sum[:, None], -jnp.inf)
  is_max = (jnp.arange(proc.y.shape[-1]) + first_id) == argmax(proc.y)[:, None]
  point = jnp.where(is_max, jnp.float32(0), jnp.float32(-jnp.inf))
  return jnp.where(valid, jnp.where(greedy, point, sampled), -jnp.inf)


def race_tokens(proc: Processed, params: SamplingParams, noise: jax.Array, *,
                argmax=_first_argmax) -> jax.Array:
  """Steps 3 and 5: argmax of greedy/invalid rows, Gumbel-max on ``K``
  otherwise.  ``argmax``: the int32 id of each row's first largest value
  (of rows split over devices: ``xla_search.Split.argmax``)."""
  race = proc.y.astype(noise.dtype) + noise
  race = jnp.where(proc.keep, race, -jnp.inf)
  plain = (params.temperature == 0) | ~jnp.isfinite(proc.row_max)
  return jnp.where(plain, argmax(proc.y), argmax(race))


def sample_reference(logits: jax.Array, params: SamplingParams,
                     streams: rng.RowStreams, *, generator: str,
                     fp64: bool = False,
                     proc: Processed | None = None) -> SampleResult:
  """The reference sampler (module doc) for canonical params and row streams.

  ``proc``: ``process(logits, params)`` if the caller has it already
  (``sample(..., return_mask=True)`` shares it with the mask).
  """
  proc = process(logits, params) if proc is None else proc
  noise = rng.gumbel_noise(generator, streams, logits.shape[1], fp64=fp64)
  tokens = race_tokens(proc, params, noise)
  x_token = jnp.take_along_axis(proc.x, tokens[:, None], axis=-1)[:, 0]
  return finalize(x_token, params, tokens, (proc.shift, proc.log_sum),
                  proc.row_max)
