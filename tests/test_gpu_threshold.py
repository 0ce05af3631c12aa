"""GPU-only tests of the truncated-sampling kernels
(``jaxsample._src.pallas.threshold``): at V = 151936 they lower and run the stats,
select and candidate kernels on the device and compare tokens, kept sets and
masks with the XLA reference.  The checks that also run in interpret mode
(kept sets, masks, low-precision logits, masses, the logit floor) are one
body each in ``test_threshold``, ``test_mask_kernels`` and
``test_truncated_sampling``, with GPU-marked cases at V = 151936."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import reference, rng
from jaxsample._src.pallas import threshold

from helpers.cases import kept_set_batch
from helpers.oracle import oracle_keep
from helpers.sampling import run_sample

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_gpu")]

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


@pytest.mark.parametrize("kind", ["flat", "zipf"])
@pytest.mark.parametrize("setting", ["top_k50_top_p0.9", "mixed"])
def test_fp64_truncated_rows_match_reference(setting, kind):
  """FP64 noise: the kept sets' thresholds, then an FP64 race of each."""
  test_truncated_kernels_match_reference(setting, kind, jnp.float32, fp64=True)


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
