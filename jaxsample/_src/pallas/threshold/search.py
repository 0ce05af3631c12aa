"""The exact threshold search over a small buffer of values: bit by bit over
fp32 order keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxsample._src.pallas import common

__all__ = ["bit_length", "BOUND_KEY_BITS", "count_reaches", "kept_bound",
           "key_prefix", "largest_key", "largest_keys", "NEG_INF_KEY"]


# ---------------------------------------------------------------------------
# The exact threshold search over a small buffer of values.
# ---------------------------------------------------------------------------


# Key bits the bound search resolves.  Bounds only need to be conservative,
# so the search stops early: 20 bits (sign, exponent and 11 mantissa bits)
# round each bound down by less than 2^-11 of its magnitude.
BOUND_KEY_BITS = 20
NEG_INF_KEY = 0x007FFFFF  # order_key(-inf); smaller keys are NaN patterns


def largest_keys(reaches: tuple, bits: int, start=None) -> tuple:
  """Per predicate of ``reaches``, the largest uint32 ``v`` with its low ``32
  - bits`` bits zero and ``reaches(v)`` (monotone: true below some point),
  built bit by bit in ``bits`` steps; 0 if none.  The searches share one
  loop, so the block reductions of their steps overlap.

  ``start = (prefix, known)`` (``key_prefix``): the search looks only among
  the keys whose ``known`` high bits are ``prefix``'s (``bits - known``
  steps and a check): the largest there, or 0 if none there reaches."""

  def body(i, keys):
    bit = jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32))
    return tuple(jnp.where(reach(v | bit), v | bit, v)
                 for reach, v in zip(reaches, keys))

  if start is None:
    return common.fori_loop(0, bits, body, (jnp.uint32(0),) * len(reaches))
  prefix, known = start
  keys = common.fori_loop(known, bits, body, (prefix,) * len(reaches))
  return tuple(jnp.where(reach(v), v, jnp.uint32(0))
               for reach, v in zip(reaches, keys))


def largest_key(reaches, bits: int, start=None) -> jax.Array:
  """``largest_keys`` of one predicate."""
  return largest_keys((reaches,), bits, start)[0]


def key_prefix(lower, upper):
  """``(prefix, known)``: the ``known`` high bits that the order keys of
  every value in ``[lower, upper]`` share, and those bits (the rest 0)."""
  low, high = common.order_key(lower), common.order_key(upper)
  known = 32 - bit_length(low ^ high)
  mask = jnp.where(known > 0, jnp.uint32(0xFFFFFFFF) << jnp.minimum(
      32 - known, 31).astype(jnp.uint32), jnp.uint32(0))
  return low & mask, known


def count_reaches(key, survives, n):
  """``reaches(v) = #{survivors with key >= v} >= n`` for ``largest_key``:
  the search then finds the key of the ``n``-th largest survivor."""
  return lambda v: common.count(survives & (key >= v)) >= n


def _bound_thresholds(y, survives, e, k, p, mass, above, bits: int,
                      window=None):
  """Bound mode's ``(t2, k_found, t3)``, rounded down to ``bits`` key bits.

  One search per row: with top-k on, ``t2`` (the ``k``-th largest survivor)
  and ``t3 = -inf`` (every top-k survivor stays a candidate); otherwise ``t2 =
  -inf`` and ``t3`` (the largest value whose upper mass, plus ``above``,
  reaches ``p * mass``).  ``bits`` block reductions, plus one for
  ``k_found``; with 32 bits the thresholds are exact (element values).
  ``window = (lower, upper)``: the search looks only among the keys that
  share the high bits of ``[lower, upper]``'s (``key_prefix``), and gives
  -inf where none there reaches: exact when the threshold lies in the
  window, below ``lower`` or at least ``upper`` otherwise.
  """
  key = common.order_key(y)
  target = p * mass - above
  mass_reaches = lambda v: jnp.sum(jnp.where(survives & (key >= v), e,
                                             0.0)) >= target
  start = None if window is None else key_prefix(*window)
  found = lax.cond(
      k > 0,
      lambda: largest_key(count_reaches(key, survives, k), bits, start),
      lambda: largest_key(mass_reaches, bits, start))
  bound = jnp.where(found > NEG_INF_KEY, common.key_value(found), -jnp.inf)
  k_found = common.count(survives) >= k
  return (jnp.where(k > 0, bound, -jnp.inf), k_found,
          jnp.where(k > 0, -jnp.inf, bound))


def kept_bound(y, row_max, t1, k, p, mass, above, bits: int, window=None):
  """Bound mode's ``(max(t1, t2, t3), k_found)`` over the values ``y``
  (``_bound_thresholds``; ``t3`` only where ``p < 1``)."""
  finite = y > -jnp.inf
  e = jnp.where(finite, jnp.exp(y - row_max), 0.0)
  t2, k_found, t3 = _bound_thresholds(y, finite & (y >= t1), e, k, p, mass,
                                      above, bits, window)
  return jnp.maximum(jnp.maximum(t1, t2), jnp.where(p < 1, t3, -jnp.inf)), (
      k_found)


def bit_length(v: jax.Array) -> jax.Array:
  """Bits of the uint32 ``v`` up to its highest set bit (0 for 0), int32."""
  n = jnp.int32(0)
  for shift in (16, 8, 4, 2, 1):  # a binary search for the highest bit
    high = (v >> jnp.uint32(shift)) != 0
    v = jnp.where(high, v >> jnp.uint32(shift), v)
    n = jnp.where(high, n + shift, n)
  return jnp.where(v != 0, n + 1, n)
