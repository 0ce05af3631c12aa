"""Race first, then check: truncated sampling without finding the threshold.

Every filter keeps an upward-closed set ``K = {y >= t, y > -inf}``
(``jaxsample.reference``), and with the same noise the restricted race
``argmax_{i in K} (y_i + g_i)`` (smallest id on ties) is the first element of
``K`` in the unrestricted race's order: descending ``y + g``, smallest id
first.  So: race the whole row once, keep its top ``M`` candidates in that
order (``race_candidates``), and decide for each candidate ``c`` with value
``y_c`` whether it is kept, from one counting pass over the row (no noise,
no threshold):

* min-p: ``y_c >= t1 = max(y) + log(min_p)`` (the reference's expression);
* top-k ``k``: ``#{y > y_c} < k`` (then ``y_c`` reaches the k-th largest
  survivor of min-p: every entry above ``y_c`` survives min-p too);
* top-p ``p``: ``#{y > y_c} = 0`` or ``mass{y > y_c} < p * Z``, with
  ``mass`` the exact fixed-point sums of ``e = exp(y - max(y))``
  (``xla_search.masked_sum``) and ``Z`` the mass of the survivors of min-p
  and top-k: the comparison ``xla_search``'s searches decide top-p by (the
  largest ``v`` whose ``mass{y >= v}`` reaches ``p * Z``).  ``Z`` is the
  mass of ``{y >= t1}`` unless top-k cuts that set (more than ``k``
  entries); then it lies between ``mass{y >= y_c}`` of the lowest candidate
  top-k keeps and ``mass{y >= t1}``, and a candidate those bounds do not
  decide is undecided.

The token is the first kept candidate when every candidate before it is
decided out.  Rows with no such candidate (all ``M`` outside the kept set,
probability at most ``(1 - kept mass)^M``, or undecided) are *unresolved*:
the caller samples them by a threshold route, behind a cond that only runs
when some row needs it.  Tokens are the reference's bit for bit (where the
threshold routes' are: a top-p crossing within fp32 rounding of ``p`` may
differ, as ``xla_search``'s).

Logprobs: the sampled token's log-probability under the truncated
distribution needs the kept set's mass, which race-first never finds; its
results carry no logprobs (``SamplerConfig(logprobs=False)``).

``sample`` is the pure-JAX route (full-row noise from ``jaxsample.rng``,
``lax.top_k`` of the race); the kernel route races in the Gumbel kernel
with top-``M`` tracking (``jaxsample.pallas.gumbel``) and shares ``check``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxsample import reference, rng, rowwise, xla_search
from jaxsample.params import SamplingParams
from jaxsample.reference import SampleResult

__all__ = ["Check", "check", "first_kept", "race_candidates", "resolve",
           "sample"]


def race_candidates(race: jax.Array, width: int):
  """The first ``width`` entries of each row of ``race`` ``[B, V]`` in race
  order (descending, smallest id first among equal values): ``(values,
  ids)`` ``[B, width]`` (``rowwise.top_k``, exact with ties)."""
  return rowwise.top_k(race, min(width, race.shape[-1]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Check:
  """Per candidate ``[B, M]``: ``kept`` (surely in the row's kept set) and
  ``out`` (surely outside it); neither means undecided (top-p with a
  cutting top-k, between ``Z``'s bounds)."""

  kept: jax.Array
  out: jax.Array


def check(y: jax.Array, params: SamplingParams, candidate_y: jax.Array,
          row_max: jax.Array) -> Check:
  """Decides which candidates lie in each row's kept set (module doc).

  ``y`` ``[B, V]``: tempered logits (``xla_search.tempered``); ``params``
  canonical; ``candidate_y`` ``[B, M]`` the candidates' ``y`` (-inf for
  none); ``row_max`` ``[B]`` = ``max(y)`` (finite on the rows that count).
  One variadic reduction over the row: the count of ``{y >= t1}`` and its
  mass, and per candidate the count and the mass of ``{y > y_c}``
  (``reference.fixed_point_digits`` sums, exact for any order).  A lower
  bound of the mass of ``{y >= y_c}`` adds the candidate's own term, less
  2^-20 of it (XLA's ``exp`` of one value and of the row differ by a few
  ulps), to the mass above it, digit by digit (integer sums: monotone).
  """
  width = candidate_y.shape[-1]
  shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  t1 = jnp.where(params.min_p > 0, row_max + jnp.log(params.min_p), -jnp.inf)
  survives = (y > -jnp.inf) & (y >= t1[:, None])
  digits = reference.fixed_point_digits(
      jnp.where(survives, jnp.exp(y - shift[:, None]), 0.0))
  terms = [survives.astype(jnp.int32)] + digits
  for c in range(width):
    above = y > candidate_y[:, c:c + 1]
    terms += [above.astype(jnp.int32)] + [jnp.where(above, d, 0)
                                          for d in digits]
  sums = lax.reduce(tuple(terms), (jnp.int32(0),) * len(terms),
                    lambda a, b: tuple(u + v for u, v in zip(a, b)), (1,))
  limbs = lambda at: jnp.stack(sums[at:at + reference.LIMBS], axis=-1)
  per = 1 + reference.LIMBS
  survivors, z_high = sums[0], reference.limbs_to_float(limbs(1))
  start = 1 + reference.LIMBS
  count = jnp.stack([sums[start + c * per] for c in range(width)], axis=-1)
  above_limbs = jnp.stack([limbs(start + c * per + 1) for c in range(width)],
                          axis=1)  # [B, M, LIMBS]
  above_mass = reference.limbs_to_float(above_limbs)
  own = jnp.where(candidate_y > -jnp.inf,
                  jnp.exp(candidate_y - shift[:, None]), 0.0) * (1 - 2.0**-20)
  reach_mass = reference.limbs_to_float(
      above_limbs + jnp.stack(reference.fixed_point_digits(own), axis=-1))

  k = params.top_k[:, None]
  min_p_ok = (candidate_y > -jnp.inf) & (candidate_y >= t1[:, None])
  top_k_ok = (k <= 0) | (count < k)
  # Top-k cuts the survivors of min-p: Z lies between (a lower bound of)
  # the mass of the lowest candidate's {y >= y_c} that top-k keeps and the
  # survivors'.
  cut = (params.top_k > 0) & (survivors > params.top_k)
  z_low = jnp.where(cut, jnp.max(jnp.where(min_p_ok & top_k_ok, reach_mass,
                                           0.0), axis=-1), z_high)
  p = params.top_p[:, None]
  top_p = p < 1
  at_top = count == 0
  kept_p = ~top_p | at_top | (above_mass < p * z_low[:, None])
  out_p = top_p & ~at_top & (above_mass >= p * z_high[:, None])
  kept = min_p_ok & top_k_ok & kept_p
  return Check(kept, ~min_p_ok | ~top_k_ok | out_p)


def first_kept(found: Check):
  """``(at, resolved)`` ``[B]``: the position of each row's first candidate
  surely kept with every one before it surely out, and whether there is
  one."""
  open_before = jnp.cumsum(~found.out, axis=-1) - (~found.out)
  chosen = found.kept & (open_before == 0)
  return (jnp.argmax(chosen, axis=-1).astype(jnp.int32),
          jnp.any(chosen, axis=-1))


def resolve(y: jax.Array, params: SamplingParams, ids: jax.Array,
            candidate_y: jax.Array, row_max: jax.Array,
            plain_tokens: jax.Array, fallback) -> SampleResult:
  """The tokens from the race's candidates (``SampleResult``, logprobs None).

  ``y`` ``[B, V]`` tempered logits (``xla_search.tempered``), ``ids`` and
  ``candidate_y`` ``[B, M]`` the candidates in race order and their ``y``
  (-inf for none), ``row_max = max(y)``, ``plain_tokens`` ``[B]`` the
  tokens of greedy and invalid rows.  Truncating rows take their first
  kept candidate (``check``, ``first_kept``), other sampled rows the first
  candidate; ``fallback(rows)`` gives the ``[B]`` tokens of a threshold
  route on the unresolved ``rows`` (``[B]`` bool; others may be
  undefined), run only when some row is unresolved.
  """
  valid = jnp.isfinite(row_max)
  plain = (params.temperature == 0) | ~valid
  untruncated = jnp.where(plain, plain_tokens, ids[:, 0])
  with jax.ensure_compile_time_eval():  # known for concrete params
    any_truncating = jnp.any(params.truncates() & (params.temperature > 0))

  def truncated():
    truncating = params.truncates() & ~plain
    at, resolved = first_kept(check(y, params, candidate_y, row_max))
    chosen = jnp.take_along_axis(ids, at[:, None], axis=-1)[:, 0]
    tokens = jnp.where(truncating, chosen, untruncated)
    unresolved = truncating & ~resolved
    found = rowwise.cond(jnp.any(unresolved), lambda: fallback(unresolved),
                         lambda: tokens)
    return jnp.where(unresolved, found, tokens)

  # Params closed over by the caller's jit: a batch without filters skips
  # the check; traced params run it (no cond on the batch).
  tokens = rowwise.cond(any_truncating, truncated, lambda: untruncated,
                        unknown=truncated)
  return SampleResult(tokens, None, valid)


def sample(logits: jax.Array, params: SamplingParams,
           streams: rng.RowStreams, *, generator: str, candidates: int,
           fallback) -> SampleResult:
  """Race-first sampling in XLA (``B >= 1``, canonical ``params``, fp32
  noise): ``SampleResult`` with ``logprobs`` None.

  Every row races whole (the reference's noise, ``rng.gumbel_noise``; its
  first ``candidates`` entries by ``lax.top_k``), then ``resolve``; greedy
  and invalid rows take the argmax.  ``fallback``: ``resolve``'s.
  """
  y = xla_search.tempered(logits, params.temperature)
  noise = rng.gumbel_noise(generator, streams, logits.shape[-1])
  _, ids = race_candidates(y + noise, candidates)
  return resolve(y, params, ids, jnp.take_along_axis(y, ids, axis=-1),
                 jnp.max(y, axis=-1),
                 jnp.argmax(y, axis=-1).astype(jnp.int32), fallback)
