"""jaxsample.race_first and ``SamplerConfig(logprobs=False)`` on the XLA paths.

Race-first tokens must be the reference's bit for bit on every row whose
kept set the oracle puts away from a top-p rounding boundary (the threshold
routes' own contract), with ties, -inf, invalid and greedy rows, every
filter combination, batch and per-request keys.  ``check`` is compared
with the reference's kept sets candidate by candidate; the fallback is
shown both taken (all ``M`` candidates outside) and never needed.
One shape (B = 16, V = 256) for every jitted call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import assert_tokens_off_boundary, params_by_row
from conftest import slow_case
import jaxsample
from jaxsample import SamplerConfig, SamplingParams, race_first, reference, rng
from jaxsample import xla_search
from jaxsample.pallas import gumbel
from jaxsample.pallas.tuning import RaceLaunch, Tuning

BATCH, VOCAB = 16, 256


def _rows(r) -> np.ndarray:
  """Peaked, flat, tied and -inf rows, then invalid and special rows."""
  x = r.standard_normal((BATCH, VOCAB)) * 3
  heads = r.integers(0, VOCAB, (BATCH, 3))
  np.put_along_axis(x, heads, r.uniform(6, 12, (BATCH, 3)), axis=-1)
  x[1] = r.standard_normal(VOCAB) * 0.5  # flat
  x[2] = r.integers(-3, 2, VOCAB) * 0.5  # ties at every threshold
  x[3, r.uniform(size=VOCAB) < 0.9] = -np.inf
  x[4, 7] = np.nan  # invalid
  x[5] = -np.inf  # invalid: no finite entry
  x[6, 3:] = -np.inf  # three finite entries: fewer than M candidates
  x[7] = 1.0  # one tie group
  x[8, 11] = np.inf  # invalid
  return x.astype(np.float32)


def _params(r) -> SamplingParams:
  """Every filter alone and combined, greedy rows, k and p at their ends."""
  cases = [dict(top_p=0.9), dict(top_k=5, top_p=0.8), dict(min_p=0.05),
           dict(top_k=3), dict(top_p=0.95, min_p=0.02),
           dict(top_k=20, top_p=0.5, min_p=0.1), dict(), dict(top_k=1),
           dict(top_p=1e-6), dict(temperature=0.0, top_p=0.5),
           dict(top_k=200, top_p=0.99), dict(min_p=1.0),
           dict(top_p=0.7, temperature=0.4), dict(top_k=50, temperature=2.0),
           dict(top_k=2, top_p=0.3, min_p=0.3), dict(top_p=0.999)]
  return params_by_row(cases, BATCH, r)


@functools.partial(jax.jit, static_argnames=("impl", "logprobs", "generator"))
def _sample(logits, params, key, positions, *, impl, logprobs, generator):
  config = SamplerConfig(implementation=impl, logprobs=logprobs, rng=generator,
                         race_candidates=4)
  return jaxsample.sample(logits, params, key, positions=positions,
                          config=config)


def _assert_reference_tokens(logits, params, key, positions=None,
                             generator="philox"):
  """Race-first tokens (the sort reference's route) and ``xla_search``'s
  without logprobs against the reference's."""
  ref = _sample(logits, params, key, positions, impl="xla", logprobs=True,
                generator=generator)
  for impl in ("xla", "xla_search"):
    out = _sample(logits, params, key, positions, impl=impl, logprobs=False,
                  generator=generator)
    assert out.logprobs is None
    assert_tokens_off_boundary(out, ref, logits, params)


@pytest.mark.parametrize("seed", range(3))
def test_tokens_match_reference(seed):
  r = np.random.default_rng(seed)
  logits = jnp.asarray(_rows(r))
  params = _params(r)
  key = jax.random.key(seed)
  _assert_reference_tokens(logits, params, key,
                           generator=("philox", "threefry")[seed % 2])


def test_per_request_keys():
  r = np.random.default_rng(7)
  keys = jax.random.split(jax.random.key(3), BATCH)
  positions = jnp.asarray(r.integers(0, 1000, BATCH), jnp.int32)
  _assert_reference_tokens(jnp.asarray(_rows(r)), _params(r), keys, positions)


def test_check_decides_every_candidate_like_the_reference():
  """Every id as a candidate: ``kept`` is the reference's kept set where
  decided, ``out`` its complement; undecided only where top-k cuts min-p's
  survivors and top-p is on."""
  r = np.random.default_rng(11)
  vocab = 32
  logits = np.round(r.standard_normal((BATCH, vocab)) * 2, 1)
  logits[3, ::2] = -np.inf
  params = _params(r).canonical(vocab)
  y = xla_search.tempered(jnp.asarray(logits, jnp.float32), params.temperature)
  order = np.argsort(-np.asarray(y), axis=-1, kind="stable")
  cand = jnp.take_along_axis(y, jnp.asarray(order), axis=-1)
  found = jax.jit(race_first.check)(y, params, cand, jnp.max(y, axis=-1))
  keep = np.asarray(reference.process(jnp.asarray(logits, jnp.float32),
                                      params).keep)
  keep = np.take_along_axis(keep, order, axis=-1)
  kept, out = np.asarray(found.kept), np.asarray(found.out)
  sampled = np.asarray(params.truncates() & (params.temperature > 0))
  assert not np.any(kept & out)
  decided_rows = 0
  for b in np.flatnonzero(sampled):
    np.testing.assert_array_equal(kept[b] & keep[b], kept[b], err_msg=str(b))
    np.testing.assert_array_equal(out[b] & ~keep[b], out[b], err_msg=str(b))
    if np.all(kept[b] | out[b]):
      decided_rows += 1
      np.testing.assert_array_equal(kept[b], keep[b], err_msg=str(b))
  assert decided_rows >= sampled.sum() - 3


def _direct(logits, params, key, candidates):
  """``race_first.sample`` with a fallback that marks its rows -1."""
  streams, _ = rng.row_streams(key, None, BATCH, VOCAB)
  return jax.jit(lambda x, p: race_first.sample(
      x, p.canonical(VOCAB), streams, generator="philox",
      candidates=candidates,
      fallback=lambda _: jnp.full((BATCH,), -1, jnp.int32)))(logits, params)


def test_fallback_taken_only_by_rows_whose_candidates_are_all_outside():
  """Top-k 1 on flat rows: the race's winner is rarely the argmax, so with
  one candidate most rows fall back.  Rows that resolve carry the
  reference's token, and so does ``sample``, whose fallback is real."""
  r = np.random.default_rng(5)
  logits = jnp.asarray(r.standard_normal((BATCH, VOCAB)) * 0.1, jnp.float32)
  params = SamplingParams.make(BATCH, top_k=1)
  key = jax.random.key(9)
  ref = _sample(logits, params, key, None, impl="xla", logprobs=True,
                generator="philox")
  one = np.asarray(_direct(logits, params, key, 1).tokens)
  assert np.sum(one == -1) >= BATCH // 2
  resolved = one != -1
  np.testing.assert_array_equal(one[resolved], np.asarray(ref.tokens)[resolved])
  routed = _sample(logits, params, key, None, impl="xla", logprobs=False,
                   generator="philox")
  np.testing.assert_array_equal(np.asarray(routed.tokens),
                                np.asarray(ref.tokens))


def test_fallback_never_needed_on_peaked_rows():
  """Top-p 0.9 on rows whose head holds most of the mass: four candidates
  always include a kept one, and the tokens are the reference's."""
  r = np.random.default_rng(6)
  x = r.standard_normal((BATCH, VOCAB))
  x[:, 0] = 9.0
  logits = jnp.asarray(x, jnp.float32)
  params = SamplingParams.make(BATCH, top_p=0.9, min_p=0.01)
  key = jax.random.key(2)
  got = np.asarray(_direct(logits, params, key, 4).tokens)
  ref = _sample(logits, params, key, None, impl="xla", logprobs=True,
                generator="philox")
  np.testing.assert_array_equal(got, np.asarray(ref.tokens))


def test_logprobs_off_is_none_on_every_route():
  """Masks and FP64 noise keep their routes and drop the logprobs; the
  config rejects bad values naming the field."""
  r = np.random.default_rng(1)
  logits = jnp.asarray(_rows(r))
  params = _params(r)
  config = SamplerConfig(implementation="xla", logprobs=False)
  out, mask = jaxsample.sample(logits, params, jax.random.key(0),
                               config=config, return_mask=True)
  assert out.logprobs is None and mask.ids.shape[0] == BATCH
  empty = jaxsample.sample(jnp.zeros((0, VOCAB)), SamplingParams.make(0),
                           jax.random.key(0), config=config)
  assert empty.logprobs is None and empty.tokens.shape == (0,)
  with pytest.raises(ValueError, match="logprobs must be a bool"):
    SamplerConfig(logprobs=1)
  with pytest.raises(ValueError, match="race_candidates must be an int >= 0"):
    SamplerConfig(race_candidates=-1)


# ---------------------------------------------------------------------------
# The kernel route (interpret mode): one shape, B = 8, V = 256.
# ---------------------------------------------------------------------------

KERNEL_BATCH = 8


@functools.partial(jax.jit, static_argnames=("config",))
def _kernel_sample(logits, params, key, *, config):
  return jaxsample.sample(logits, params, key, config=config)


def test_kernel_candidates_are_the_race_order():
  """``gumbel.race_candidates`` lists the reference race's best entries in
  order (ties by id), greedy rows' argmax first, invalid rows' first NaN or
  +inf, and the logits' max.  16-lane loads over 2 splits: each lane's list
  takes 8 entries, so insertion at every level and the chunk filter run."""
  r = np.random.default_rng(21)
  x = _rows(r)[:KERNEL_BATCH]
  x[2] = np.round(x[2])  # ties in y; distinct race values
  x[1, 5::3] = np.inf  # invalid: many +inf race values tie, id 5 first
  params = _params(r)[:KERNEL_BATCH].canonical(VOCAB)
  key = jax.random.key(4)
  streams, _ = rng.row_streams(key, None, KERNEL_BATCH, VOCAB)
  config = SamplerConfig(implementation="pallas", rng="threefry",
                         tuning=Tuning(gumbel=RaceLaunch(block_size=16,
                                                         num_splits=2)))
  values, ids, x_max = jax.jit(lambda l, t: gumbel.race_candidates(
      l, t, streams, config, 4))(jnp.asarray(x), params.temperature)
  y = reference.temper(reference.sanitize(jnp.asarray(x)), params.temperature)
  race = y + rng.gumbel_noise("threefry", streams, VOCAB)
  ref_values, ref_ids = race_first.race_candidates(race, 4)
  greedy = np.asarray(params.temperature) == 0
  invalid = ~np.isfinite(np.asarray(jnp.max(y, axis=-1)))
  sampled = ~greedy & ~invalid
  finite = np.isfinite(np.asarray(ref_values))
  np.testing.assert_array_equal(np.asarray(values)[sampled],
                                np.asarray(ref_values)[sampled])
  np.testing.assert_array_equal(np.asarray(ids)[sampled & finite.all(-1)],
                                np.asarray(ref_ids)[sampled & finite.all(-1)])
  argmax = np.asarray(jnp.argmax(y, axis=-1))
  np.testing.assert_array_equal(np.asarray(ids)[:, 0][~sampled],
                                argmax[~sampled])
  np.testing.assert_array_equal(
      np.asarray(x_max), np.asarray(jnp.max(reference.sanitize(
          jnp.asarray(x)), axis=-1)))


# One candidate: rows whose winner lies outside take the threshold kernels
# (the cond's branch); four is the default (``slow``: a compile of ~60 s).
@pytest.mark.parametrize("candidates", [1, slow_case(4, id="4")])
def test_kernel_route_matches_reference(candidates):
  r = np.random.default_rng(candidates)
  logits = jnp.asarray(_rows(r)[:KERNEL_BATCH])
  params = _params(r)[:KERNEL_BATCH]
  key = jax.random.key(candidates)
  ref = _sample(logits, params, key, None, impl="xla", logprobs=True,
                generator="philox")
  out = _kernel_sample(logits, params, key, config=SamplerConfig(
      implementation="pallas", logprobs=False, race_candidates=candidates))
  assert out.logprobs is None
  assert_tokens_off_boundary(out, ref, logits, params)


def _check_reductions(params, race_candidates: int = 4) -> int:
  """Variadic reductions (``race_first.check``'s) in the jaxpr of a
  ``sample`` without logprobs that closes over ``params``."""
  config = SamplerConfig(implementation="xla", logprobs=False,
                         race_candidates=race_candidates)
  jaxpr = jax.make_jaxpr(lambda x: jaxsample.sample(
      x, params, jax.random.key(0), config=config))(
          jnp.zeros((BATCH, VOCAB), jnp.float32))

  def count(j):
    found = 0
    for eqn in j.eqns:
      found += eqn.primitive.name == "reduce" and len(eqn.invars) > 10
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        found += count(sub)
    return found

  return count(jaxpr.jaxpr)


def test_closed_over_params_without_filters_skip_the_check():
  assert _check_reductions(SamplingParams.make(BATCH, temperature=0.7)) == 0
  assert _check_reductions(SamplingParams.make(BATCH, top_p=0.9)) == 1
  # race_candidates 0 (the default) keeps the threshold route
  assert _check_reductions(SamplingParams.make(BATCH, top_p=0.9), 0) == 0
