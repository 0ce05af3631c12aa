"""Truncated sampling on the kernels (``jaxsample.sample``,
``implementation="pallas"``, interpret mode) against the XLA reference.

Batches mixing kernel rows, rows the candidate buffer overflows, plain,
greedy and invalid rows; per-request keys; low-precision logits.  The kept
sets themselves are ``test_threshold.py``'s; their counts, masses (logZ) and
row logsumexps, through the sampling mask, against float64 here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import reference

from helpers.cases import (LOGPROB_ATOL, LOGPROB_RTOL, LOGZ_ATOL, LSE_ATOL,
                           logsumexp64, mass_tolerance)
from helpers.oracle import oracle_keep
from helpers.parametrize import on_gpu, slow_case
from helpers.sampling import run_sample


@pytest.mark.parametrize("gen,max_candidates,fp64", [
    ("philox", 16, False), slow_case("threefry", 4096, False),
    slow_case("philox", 16, True)])
def test_sample_matches_reference_with_fallback_rows(gen, max_candidates,
                                                     fp64):
  """Kernel rows, fallback rows (overflow), plain, greedy and invalid rows in
  one batch: tokens and validity equal the reference's (FP64 noise: the kept
  sets' thresholds, then an FP64 race of each)."""
  batch, vocab = 10, 2000 + 3
  r = np.random.default_rng(5)
  x = r.standard_normal((batch, vocab)).astype(np.float32) * 3
  x[3, 17] = np.nan
  x[4, :] = -np.inf
  x[5, 100:] = -np.inf
  params = SamplingParams.make(
      batch, temperature=[1, 0.7, 0, 1, 1, 1.3, 1, 0.9, 1, 2],
      top_k=[50, 0, 5, 3, 0, 20, 0, 1, 500, 0],
      top_p=[1, 0.9, 1, 1, 0.5, 0.8, 1, 1, 0.95, 0.999999],
      min_p=[0, 0, 0, 0, 0, 0, 0, 0, 0, 0.01])
  key = jax.random.key(8)
  a = run_sample(x, params, key, impl="pallas", rng=gen, fp64=fp64,
                 max_candidates=max_candidates)
  b = run_sample(x, params, key, impl="xla", rng=gen, fp64=fp64)
  np.testing.assert_array_equal(a.valid, b.valid)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
  y = np.asarray(reference.temper(reference.sanitize(jnp.asarray(x)),
                                  params.temperature))
  for row in np.flatnonzero(b.valid & (np.asarray(params.temperature) > 0)):
    o = oracle_keep(y[row], int(params.top_k[row]), float(params.top_p[row]),
                    float(params.min_p[row]))
    assert o.kept[a.tokens[row]], row


@pytest.mark.slow
def test_per_request_keys_are_batch_invariant():
  batch, vocab = 6, 3000
  x = np.random.default_rng(6).standard_normal((batch, vocab)).astype(np.float32)
  params = SamplingParams.make(batch, top_k=[40, 0, 3, 10, 0, 50],
                               top_p=[0.9, 0.8, 1, 0.5, 0.95, 1])
  keys = jax.random.split(jax.random.key(6), batch)
  positions = jnp.arange(batch, dtype=jnp.int32) * 7
  a = run_sample(x, params, keys, positions=positions, impl="pallas")
  b = run_sample(x, params, keys, positions=positions, impl="xla")
  np.testing.assert_array_equal(a.tokens, b.tokens)
  for row in (0, 3):
    alone = run_sample(x[row:row + 1], jax.tree.map(lambda v: v[row:row + 1],
                                                    params),
                       keys[row:row + 1], positions=positions[row:row + 1],
                       impl="pallas")
    assert alone.tokens[0] == a.tokens[row]


def low_precision_batch(vocab, dtype, seed=7):
  """``[12, vocab]`` logits in ``dtype`` (rounded from fp32) with
  per-request params: top-k, top-p, min-p and combined rows at several
  temperatures on normal, zipf and mild rows (bf16 rounding ties many
  values), greedy rows with and without a filter, a row without filters, a
  row with -inf entries, a NaN row (invalid) and a row of 100 finite
  entries."""
  r = np.random.default_rng(seed)
  x = r.standard_normal((12, vocab)) * 3
  ranks = r.permuted(np.tile(np.arange(1, vocab + 1), (2, 1)), axis=1)
  x[6:8] = -1.1 * np.log(ranks) + 0.1 * x[6:8]  # zipf
  x[8] /= 3
  x[9, :11] = -np.inf
  x[10, 17] = np.nan
  x[11, 100:] = -np.inf
  params = SamplingParams.make(
      12, temperature=[1, 0.7, 1.3, 0.5, 0, 0, 1.1, 0.9, 1, 0.8, 1, 1.2],
      top_k=[50, 0, 0, 20, 5, 0, 0, 0, 0, 7, 10, 0],
      top_p=[1, 0.9, 1, 0.8, 1, 1, 1, 0.9, 0.95, 0.9, 1, 0.95],
      min_p=[0, 0, 0.05, 0.01, 0, 0, 0, 0, 0.1, 0, 0, 0])
  return jnp.asarray(x.astype(np.float32)).astype(dtype), params


@pytest.mark.kernels
@pytest.mark.parametrize("vocab", [1007, on_gpu(151936)])
@pytest.mark.parametrize("dtype", [
    slow_case(jnp.bfloat16, id="bfloat16"),
    slow_case(jnp.float16, id="float16")])
def test_low_precision_logits(dtype, vocab):
  """The kernels read bf16/fp16 logits in their own dtype (truncated batches,
  ``low_precision_batch``: mixed per-request k / p / min-p / T, greedy,
  unfiltered, -inf and NaN rows): valid flags equal the XLA reference's (fed
  the same array), tokens bit for bit and logprobs within ``LOGPROB_*`` on
  every row (invalid rows: -inf both) but those on an fp32 rounding boundary
  of top-p (the oracle's ``near_boundary``): none at V = 1007, at most one
  at V = 151936 (on a GPU)."""
  x, params = low_precision_batch(vocab, dtype)
  key = jax.random.key(9)
  a = run_sample(x, params, key, impl="pallas")
  b = run_sample(x, params, key, impl="xla")
  assert a.tokens.dtype == np.int32 and a.logprobs.dtype == np.float32
  np.testing.assert_array_equal(a.valid, b.valid)
  assert b.valid.sum() == len(b.valid) - 1  # the NaN row alone is invalid
  y = np.asarray(reference.temper(reference.sanitize(x), params.temperature))
  canon = params.canonical(vocab)
  filtered = np.asarray(canon.truncates() & (canon.temperature > 0))
  near = [row for row in np.flatnonzero(b.valid & filtered) if oracle_keep(
      y[row], int(canon.top_k[row]), float(canon.top_p[row]),
      float(canon.min_p[row])).near_boundary]
  rows = np.setdiff1d(np.arange(len(y)), near)
  np.testing.assert_array_equal(a.tokens[rows], b.tokens[rows])
  np.testing.assert_allclose(a.logprobs[rows], b.logprobs[rows],
                             rtol=LOGPROB_RTOL, atol=LOGPROB_ATOL)
  assert len(near) <= (vocab > 1007), near


_sample_with_mask = jax.jit(
    functools.partial(jaxsample.sample, return_mask=True),
    static_argnames=("config",))


def mass_batch(vocab, seed=11):
  """``[10, vocab]`` fp32 logits with per-request params: top-k, top-p,
  min-p and combined rows on normal, zipf and large (mean 40) rows, with -inf
  entries in a top-p row, a greedy row with a filter and a row without
  filters."""
  r = np.random.default_rng(seed)
  n = r.standard_normal((10, vocab))
  x = n * 3
  ranks = r.permuted(np.tile(np.arange(1, vocab + 1), (3, 1)), axis=1)
  x[4:7] = -1.1 * np.log(ranks) + 0.1 * n[4:7]  # zipf
  x[7] = n[7] * 2 + 40
  x[1, :11] = -np.inf
  x[8, :11] = -np.inf
  params = SamplingParams.make(
      10, temperature=[1, 0.7, 1.3, 0.5, 1, 0.9, 1.1, 1, 0, 1],
      top_k=[50, 0, 0, 20, 0, 200, 0, 30, 5, 0],
      top_p=[1, 0.9, 1, 0.8, 0.95, 1, 0.7, 0.9, 1, 1],
      min_p=[0, 0, 0.05, 0.01, 0, 0, 0.001, 0.02, 0, 0])
  return x.astype(np.float32), params


@pytest.mark.kernels
@pytest.mark.parametrize("vocab", [1007, on_gpu(151936)])
def test_kept_mass_and_lse_match_float64(vocab):
  """``sample(..., return_mask=True)`` on the kernels (fp32): per row the
  kept count and ids (``{y >= threshold}``: the oracle's set, an admissible
  one on a top-p rounding boundary), ``lse = logsumexp(y)`` over the finite
  entries and ``logz = log sum_K softmax(y)``, against float64 numpy on the
  fp32 tempered logits ``y``.

  Tolerances, per row with ``L = |lse|``: the kernels form ``lse = row_max +
  log S`` and ``logz = (row_max + log S_K) - lse``; each add rounds to
  within 1/2 ulp (<= eps * L), hence ``2 eps L`` for both, plus the relative
  error of the fp32 sums ``S``, ``S_K`` of <= V terms in (0, 1]: ~log2(V)
  eps (2e-6 at V = 151936) for the summation, and on a GPU up to ~1e-6
  more for the kernels' ``ex2.approx`` (< 2^-22 per term) and fp32 exponent
  scale (``log2(e) / T``); 3e-6 for ``lse``, 4e-6 for ``logz`` (two sums,
  their scale errors alike).  Measured on CPU: <= 1.6e-6 (<= 0.8 ulp of lse)
  at V = 1007 and 151936.  Greedy rows: ``logz = 0`` and ``lse = max(y)``
  exactly; rows without filters ``logz = 0`` exactly."""
  x, params = mass_batch(vocab)
  config = SamplerConfig(implementation="pallas")
  res, m = jax.tree.map(np.asarray, _sample_with_mask(
      jnp.asarray(x), params, jax.random.key(3), config=config))
  y = np.asarray(reference.temper(reference.sanitize(jnp.asarray(x)),
                                  params.temperature))
  canon = params.canonical(vocab)
  cap = config.max_mask_ids
  assert res.valid.all()
  near = []
  for row in range(len(y)):
    finite = y[row] > -np.inf
    lse = logsumexp64(y[row], finite)
    ctx = f"row {row}"
    if canon.temperature[row] == 0:
      assert m.count[row] == 1 and m.ids[row, 0] == res.tokens[row], ctx
      assert m.logz[row] == 0 and m.lse[row] == y[row].max(), ctx
      continue
    o = oracle_keep(y[row], int(canon.top_k[row]), float(canon.top_p[row]),
                    float(canon.min_p[row]))
    # The kernels' kept set: the upward-closed set of their count.
    ys = np.sort(y[row])[::-1]
    kept = (y[row] >= ys[m.count[row] - 1]) & finite
    assert kept.sum() == m.count[row], ctx
    if o.near_boundary:
      near.append(row)
      assert o.admits(kept), ctx
    else:
      np.testing.assert_array_equal(kept, o.kept, err_msg=ctx)
    assert kept[res.tokens[row]], ctx
    order = np.lexsort((np.arange(vocab), -y[row].astype(np.float64)))
    listed = order[kept[order]][:cap]
    if m.truncated[row]:
      np.testing.assert_array_equal(m.ids[row, :len(listed)], listed,
                                    err_msg=ctx)
    else:  # no filter removed anything
      assert kept.sum() == finite.sum(), ctx
    assert abs(m.lse[row] - lse) <= mass_tolerance(lse, LSE_ATOL), (
        ctx, m.lse[row], lse)
    logz = logsumexp64(y[row], kept) - lse
    assert abs(m.logz[row] - logz) <= mass_tolerance(lse, LOGZ_ATOL), (
        ctx, m.logz[row], logz)
    if not canon.truncates()[row]:
      assert m.logz[row] == 0 and not m.truncated[row], ctx
  # Rows on a rounding boundary: none at V = 1007; at V = 151936 a zipf
  # top-p 0.95 row is, by the CPU's quotients.
  assert len(near) <= (vocab > 1007), near
