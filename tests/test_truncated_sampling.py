"""Truncated sampling on the kernels (``jaxsample.sample``,
``implementation="pallas"``, interpret mode) against the XLA reference.

Batches mixing kernel rows, rows the candidate buffer overflows, plain,
greedy and invalid rows; per-request keys; low-precision logits.  The kept
sets themselves are ``test_threshold.py``'s; their counts, masses (logZ) and
row logsumexps, through the sampling mask, against float64 here.  The
``gpu``-marked tests at the end run the kernels compiled at V = 151936.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import reference, rng
from jaxsample._src.pallas import threshold

from helpers.cases import (LOGPROB_ATOL, LOGPROB_RTOL, LOGZ_ATOL, LSE_ATOL,
                           kept_set_batch, logsumexp64, mass_tolerance)
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


# ---------------------------------------------------------------------------
# On a GPU (``gpu``-marked), at V = 151936: the stats, select and candidate
# kernels compiled, against the XLA reference (tokens, kept sets, masks).
# The checks that also run in interpret mode are the ``kernels`` tests
# above, ``test_threshold``'s and ``test_mask_kernels``', with GPU-marked
# cases at V = 151936.
# ---------------------------------------------------------------------------


VOCAB = 151936
SETTINGS = {
    "top_k50": dict(top_k=50),
    "top_p0.9": dict(top_p=0.9),
    "top_k50_top_p0.9": dict(top_k=50, top_p=0.9),
    "min_p0.05": dict(min_p=0.05),
    "mixed": dict(top_k=[1, 2, 50, 0, 0, 20, 0, 7], top_p=[1, 0.5, 0.9, 1e-6,
                  0.999999, 1, 0.95, 0.3], min_p=[0, 0, 0, 0, 0, 0.1, 0, 0]),
}


def logits(kind, batch, dtype, seed):
  r = np.random.default_rng(seed)
  x = r.standard_normal((batch, VOCAB)).astype(np.float32)
  if kind == "peaked":
    x = x * 5
  elif kind == "zipf":
    ranks = r.permuted(np.tile(np.arange(1, VOCAB + 1), (batch, 1)), axis=1)
    x = -1.1 * np.log(ranks) + 0.1 * x
  x[0, :11] = -np.inf
  return jnp.asarray(x).astype(dtype)


def assert_admissible_token(o, y, token, logprob, ctx):
  """A row near a top-p rounding boundary (``o.near_boundary``): ``token``
  lies in one of the oracle's admissible kept sets, with ``logprob`` its
  log-probability under that set (float64, within ``test_threshold``'s
  tolerance of kept masses)."""
  y = np.asarray(y, np.float64)
  ys = np.sort(y)[::-1]  # the set of count n is {y >= ys[n - 1]}
  mass = np.cumsum(np.exp(np.where(ys > -np.inf, ys - ys[0], -np.inf)))
  counts = np.asarray([n for n in o.admissible.counts if n > 0])
  logprobs = (y[token] - ys[0]) - np.log(mass[counts - 1])
  ok = (y[token] >= ys[counts - 1]) & np.isclose(logprob, logprobs,
                                                 rtol=1e-5, atol=1e-5)
  assert ok.any(), (ctx, token, logprob, counts, logprobs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("kind", ["flat", "peaked", "zipf"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_truncated_kernels_match_reference(setting, kind, dtype, fp64=False):
  batch = 8
  x = logits(kind, batch, dtype, seed=zlib.crc32(f"{setting}/{kind}".encode()))
  temps = np.float32([1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 0.9, 1.1])
  params = SamplingParams.make(batch, temperature=temps, **SETTINGS[setting])
  key = jax.random.key(5)
  a = run_sample(x, params, key, impl="pallas", fp64=fp64)
  b = run_sample(x, params, key, impl="xla", fp64=fp64)
  y = np.asarray(reference.temper(reference.sanitize(x),
                                  jnp.asarray(temps)))
  canon = params.canonical(VOCAB)
  keep = np.asarray(reference.process(x, canon).keep)
  near = 0
  for row in range(batch):
    o = oracle_keep(y[row], int(canon.top_k[row]), float(canon.top_p[row]),
                    float(canon.min_p[row]))
    if o.near_boundary:
      # fp32 masses may settle on an adjacent admissible threshold: the
      # reference keeps an admissible set, and each token lies in one with
      # its logprob under it.
      near += 1
      assert o.admits(keep[row]), row
      for got in (a, b):
        assert_admissible_token(o, y[row], got.tokens[row],
                                got.logprobs[row], row)
      continue
    assert a.tokens[row] == b.tokens[row], row
    np.testing.assert_allclose(a.logprobs[row], b.logprobs[row], rtol=1e-5,
                               atol=1e-5)
  # At most half the rows near a boundary (by the CPU's quotients at most 2
  # of 8 but top-p 0.9 on zipf rows: 4, whose tails hold many tokens each
  # below the oracle's margin; with a margin of 1e-5 up to 8 of 8).
  assert near <= batch // 2, near
  np.testing.assert_array_equal(a.valid, b.valid)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["flat", "zipf"])
@pytest.mark.parametrize("setting", ["top_k50_top_p0.9", "mixed"])
def test_fp64_truncated_rows_match_reference(setting, kind):
  """FP64 noise: the kept sets' thresholds, then an FP64 race of each."""
  test_truncated_kernels_match_reference(setting, kind, jnp.float32, fp64=True)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1007, 151936])
def test_kept_set_batch_through_sample(vocab):
  """The kept-set batch (``test_threshold.test_kept_sets_match_oracle`` checks
  its kept sets, here compiled too) through ``jaxsample.sample``: its
  invalid rows (NaN, +inf) get the reference's tokens bit for bit, ``valid``
  False and logprob -inf, and every row the reference's validity."""
  y, ks, ps, ms, _ = kept_set_batch(vocab)
  params = SamplingParams.make(len(y), top_k=ks, top_p=ps, min_p=ms)
  key = jax.random.key(0)
  a = run_sample(y, params, key, impl="pallas")
  b = run_sample(y, params, key, impl="xla")
  invalid = ~np.isfinite(y.max(axis=-1))
  assert invalid.sum() == 3
  np.testing.assert_array_equal(a.valid, b.valid)
  np.testing.assert_array_equal(a.valid, ~invalid)
  np.testing.assert_array_equal(a.tokens[invalid], b.tokens[invalid])
  assert ((0 <= a.tokens) & (a.tokens < vocab)).all(), a.tokens
  np.testing.assert_array_equal(a.logprobs[invalid], -np.inf)
  np.testing.assert_array_equal(b.logprobs[invalid], -np.inf)


@pytest.mark.gpu
def test_kernels_decide_most_rows_without_fallback():
  """top-k 50 + top-p 0.9 on every distribution: all rows complete, their
  candidates read from their listed segments alone."""
  batch = 32
  for kind in ("flat", "peaked", "zipf"):
    x = logits(kind, batch, jnp.float32, seed=3)
    params = SamplingParams.make(batch, top_k=50, top_p=0.9).canonical(VOCAB)
    streams, _ = rng.row_streams(jax.random.key(0), None, batch, VOCAB)
    tr = jax.jit(lambda x: threshold.sample_truncated(
        x, params, streams, SamplerConfig()))(x)
    assert bool(np.all(tr.complete)), kind
    assert bool(np.all(tr.gathered)), kind
    proc = reference.process(x, params)
    np.testing.assert_array_equal(tr.count, np.sum(proc.keep, axis=-1))


@pytest.mark.gpu
@pytest.mark.parametrize("setting", [dict(top_p=0.9), dict(top_p=0.95),
                                     dict(min_p=0.05),
                                     dict(top_p=0.9, min_p=0.001),
                                     dict(top_k=VOCAB - 1),
                                     dict(top_k=20000, min_p=0.001),
                                     dict(top_k=60000, top_p=0.9)],
                         ids=str)
def test_large_kept_sets_take_the_window_search(setting):
  """Flat rows with top-k off or large keep far more than the candidate
  buffer: the windowed searches decide them (complete, no fallback) with the
  reference's counts and tokens."""
  batch = 32
  near = 0
  for kind in ("flat", "zipf"):
    x = logits(kind, batch, jnp.float32, seed=4)
    params = SamplingParams.make(batch, **setting).canonical(VOCAB)
    key = jax.random.key(2)
    streams, _ = rng.row_streams(key, None, batch, VOCAB)
    tr = jax.jit(lambda x: threshold.sample_truncated(
        x, params, streams, SamplerConfig()))(x)
    proc = reference.process(x, params)
    count = np.sum(proc.keep, axis=-1)
    large = count > SamplerConfig().max_candidates
    if kind == "flat":
      assert large.sum() >= batch // 2, count
    assert bool(np.all(tr.complete)), (kind, np.flatnonzero(~tr.complete))
    want = reference.sample_reference(x, params, streams, generator="philox")
    y = np.asarray(proc.y)
    keep = np.asarray(proc.keep)
    for row in range(batch):
      o = oracle_keep(y[row], int(params.top_k[row]),
                      float(params.top_p[row]), float(params.min_p[row]))
      if o.near_boundary:
        # Adjacent admissible thresholds: the kernels' set and the
        # reference's are admissible, the count is the set's and the token
        # lies in it with its logprob under it.
        near += 1
        kept = (y[row] >= tr.threshold[row]) & (y[row] > -np.inf)
        assert o.admits(kept), (kind, row)
        assert o.admits(keep[row]), (kind, row)
        assert tr.count[row] == kept.sum(), (kind, row)
        assert kept[tr.token[row]], (kind, row)
        y64 = y[row].astype(np.float64)
        mass = np.sum(np.exp(y64[kept] - y64.max()))
        np.testing.assert_allclose(
            tr.logprob[row], y64[tr.token[row]] - y64.max() - np.log(mass),
            rtol=1e-5, atol=1e-5)
        continue
      assert tr.count[row] == count[row], (kind, row)
      assert tr.token[row] == want.tokens[row], (kind, row)
      np.testing.assert_allclose(tr.logprob[row], want.logprobs[row],
                                 rtol=1e-5, atol=1e-5)
  # At most 7 in 8 rows near a boundary: at V = 151936 every zipf top-p 0.95
  # row is (its tail tokens each hold less than the oracle's margin) and 23
  # of 32 flat ones; with a margin of 1e-5 every top-p row was.
  assert near <= 2 * batch * 7 // 8, near


@pytest.mark.gpu
@pytest.mark.parametrize("fp64", [False, True],
                         ids=["fp32noise", "fp64noise"])
@pytest.mark.parametrize("setting,kind,cap", [
    ("top_k50_top_p0.9", "zipf", 256), ("mixed", "zipf", 256),
    ("top_p0.9", "flat", 64), ("top_p0.9", "flat", 1024),
    ("top_p0.9", "flat", 4096)])
def test_masks_match_reference(setting, kind, cap, fp64):
  """Masks from the kernels equal the reference's; flat rows with top-p 0.9
  keep large sets, listed from the candidate buffer of top-k = K_cap (64) or
  from the K_cap window (``large_kept_ids``)."""
  batch = 8
  x = logits(kind, batch, jnp.float32, seed=9)
  params = SamplingParams.make(batch, **SETTINGS[setting])
  config = SamplerConfig(implementation="pallas", max_mask_ids=cap,
                         use_fp64_gumbel=fp64)
  with jax.enable_x64(fp64):
    res, m = jax.jit(lambda x: jaxsample.sample(
        x, params, jax.random.key(1), config=config, return_mask=True))(x)
  if setting == "top_p0.9":
    assert m.overflow.all()
  want = jaxsample.extract_sampling_mask(  # the XLA reference
      x, params, config=dataclasses.replace(config, implementation="xla"))
  # extract_sampling_mask on the kernels (FP32 noise whatever the config).
  alone = jax.jit(lambda x: jaxsample.extract_sampling_mask(
      x, params, config=config))(x)
  # sample's mask lists its token (in the last slot when the set overflows).
  listed = jaxsample._src.sampling_mask.with_token(want, res.tokens, res.valid)
  for got, expect in ((m, listed), (alone, want)):
    for f in ("ids", "count", "truncated", "overflow"):
      np.testing.assert_array_equal(getattr(got, f), getattr(expect, f),
                                    err_msg=f)
    np.testing.assert_allclose(got.logz, expect.logz, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.lse, expect.lse, rtol=1e-5, atol=1e-5)
