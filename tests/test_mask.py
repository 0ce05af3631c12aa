"""jaxsample.mask: the kept set each token was drawn from (mask.py docstring).

Masks are checked against the numpy float64 oracle in conftest.py, and masks
returned by ``sample(..., return_mask=True)`` against the tokens and logprobs
drawn with them, on both backends.  The kernel path's masks (truncation
kernels, interpret mode here) are checked against the oracle on
``test_threshold``'s kept-set batch too (``test_kernel_masks_match_oracle``,
with GPU-marked cases compiled at V = 151936).
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from conftest import (IMPLEMENTATIONS, IMPLEMENTATIONS_SLOW_KERNELS,
                      STAT_CONFIGS, STAT_DRAWS, STAT_VOCAB,
                      assert_binned_chi2_fits, assert_chi2_fits,
                      chi2_critical, chi2_statistic, closing_over,
                      on_gpu, oracle_keep, slow_case, without_truncation)
from jaxsample import SamplerConfig, SamplingMask, SamplingParams, sampling_mask
from jaxsample.mask import MaskOverflowError
from jaxsample.pallas import sampler, threshold

from cases import (KINDS, LOGPROB_ATOL, LOGPROB_RTOL, LOGZ_ATOL,
                   LSE_ATOL, M_VALUES, P_VALUES, assert_mask_types,
                   assert_masks_equal, extract, k_values, kept_set_batch,
                   listed, logsumexp64, make_row, mask_kept, mass_tolerance,
                   rebuilt_logprob, tempered, to_np)


_sample = jax.jit(functools.partial(jaxsample.sample, return_mask=True),
                  static_argnames=("config",))


def sample_with_mask(logits, params, key, *, impl, positions=None, **config_kw):
  """``sample(..., return_mask=True)``, jitted; kernel runs of batches without
  filters close over the params (``conftest.closing_over``)."""
  config = SamplerConfig(implementation=impl, **config_kw)
  if impl == "pallas" and without_truncation(params, np.shape(logits)[1]):
    fn = closing_over(params, lambda p: lambda x, k, pos: jaxsample.sample(
        x, p, k, positions=pos, return_mask=True, config=config), config)
    return to_np(fn(jnp.asarray(logits), key, positions))
  return to_np(_sample(jnp.asarray(logits), params, key, positions=positions,
                       config=config))


def with_token(ids, token) -> list:
  """An overflowed row's listed ``ids`` (the first ``K_cap`` of its kept
  set) as the sampler lists them: its ``token`` in the last slot if it is
  not among them (``sampling_mask.with_token``)."""
  ids = [int(i) for i in ids]
  return ids if int(token) in ids else ids[:-1] + [int(token)]


def oracle_order(y, kept):
  """Kept ids by descending ``y``, smallest id first among equal values."""
  order = np.lexsort((np.arange(len(y)), -np.asarray(y, np.float64)))
  return order[kept[order]]


def logsumexp_np(y, where):
  y = np.asarray(y, np.float64)
  m = y[where].max()
  return m + math.log(np.exp(y[where] - m).sum())


def mixed_batch(seed, batch, vocab, *, truncating):
  """Random rows with -inf entries, greedy rows and (optionally) filters."""
  r = np.random.default_rng(seed)
  x = (r.standard_normal((batch, vocab)) *
       r.uniform(0.5, 4, (batch, 1))).astype(np.float32)
  x[r.random((batch, vocab)) < 0.05] = -np.inf
  temps = r.choice([0.0, 0.3, 0.7, 1.0, 1.7], batch)
  filters = {}
  if truncating:
    filters = dict(top_k=r.choice([0, 1, 3, 40, vocab - 1, vocab], batch),
                   top_p=r.choice([1.0, 0.99, 0.9, 0.5, 0.1], batch),
                   min_p=r.choice([0.0, 0.0, 0.01, 0.2], batch))
  return x, temps, SamplingParams.make(batch, temperature=temps, **filters)


# ---------------------------------------------------------------------------
# The kept set, its order, count and mass vs the float64 oracle.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [16, 1007])
def test_mask_matches_oracle(vocab):
  """Every row kind (ties, -inf, flat, peaked, ...) x p, k, min-p grids,
  incl. p = 1, k >= V and min-p.  Temperatures are powers of 2, so ``x / T``
  is exact in numpy and XLA alike."""
  r = np.random.default_rng(vocab + 1)
  rows, cols = [], {f: [] for f in ("temperature", "top_k", "top_p", "min_p")}
  for kind in KINDS:
    for p in P_VALUES:
      for k in k_values(vocab):
        for m in M_VALUES:
          rows.append(make_row(kind, r, vocab))
          for f, v in zip(cols, ((1.0, 0.5, 2.0)[len(rows) % 3], k, p, m)):
            cols[f].append(v)
  x = np.asarray(rows, np.float32)
  mask = extract(x, SamplingParams.make(len(rows), **cols))
  assert_mask_types(mask, len(rows), 1024)
  assert not mask.overflow.any()
  near = 0
  for b in range(len(rows)):
    y = tempered(x[b], cols["temperature"][b])
    o = oracle_keep(y, cols["top_k"][b], cols["top_p"][b], cols["min_p"][b])
    near += o.near_boundary
    kept = mask_kept(mask, b, y)
    ctx = (f"row {b} kind={KINDS[b * len(KINDS) // len(rows)]}: "
           f"{kept.sum()} kept, oracle {o.kept.sum()}")
    # fp32 mass rounding may pick the adjacent threshold near a boundary.
    assert np.array_equal(kept, o.kept) or (
        o.near_boundary and o.admits(kept)), ctx
    finite = y > -np.inf
    assert mask.count[b] == kept.sum(), ctx
    assert mask.truncated[b] == (kept.sum() < finite.sum()), ctx
    if mask.truncated[b]:
      np.testing.assert_array_equal(listed(mask, b), oracle_order(y, kept),
                                    err_msg=ctx)
      logz = logsumexp_np(y, kept) - logsumexp_np(y, finite)
      np.testing.assert_allclose(mask.logz[b], logz, rtol=1e-5, atol=2e-6,
                                 err_msg=ctx)
    else:
      assert mask.logz[b] == 0.0, ctx
    np.testing.assert_allclose(mask.lse[b], logsumexp_np(y, finite), rtol=1e-6,
                               atol=1e-6, err_msg=ctx)
  assert mask.truncated.sum() > 0.7 * len(rows)
  assert near <= 0.02 * len(rows), f"{near} of {len(rows)} rows near a boundary"


def test_untruncated_rows_list_nothing():
  """Rows where no filter removes a finite entry: no ids, logz exactly 0,
  None / null on the host, whether or not other rows of the batch truncate."""
  vocab = 64
  x = np.random.default_rng(5).standard_normal((7, vocab)).astype(np.float32)
  x[1] = -1.25  # flat: filters keep the whole tie group
  x[2, ::3] = -np.inf
  x[3] = 2.0
  x[4] = 0.5
  x[5, 10:] = -np.inf
  temps = [1.0, 1.0, 0.7, 1.0, 2.0, 1.0, 1.0]
  kw = dict(top_k=[0, 3, 0, 0, vocab, vocab + 5, 4],
            top_p=[1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0],
            min_p=[0.0, 0.0, 0.0, 0.0, 0.7, 0.0, 0.0])
  for n in (6, 7):  # without / with the truncated last row
    params = SamplingParams.make(n, temperature=temps[:n],
                                 **{f: v[:n] for f, v in kw.items()})
    m = extract(x[:n], params)
    assert not m.truncated[:6].any() and not m.overflow.any()
    np.testing.assert_array_equal(m.ids[:6], -1)
    np.testing.assert_array_equal(m.logz[:6], 0.0)
    np.testing.assert_array_equal(m.count[:6], (x[:6] > -np.inf).sum(-1))
    assert [ids for ids, _ in m.to_lists()[:6]] == [None] * 6
    assert json.dumps(m.to_json()[:6]) == "[[null], [null], [null], [null], [null], [null]]"
  np.testing.assert_array_equal(listed(m, 6), np.argsort(-x[6], kind="stable")[:4])


# ---------------------------------------------------------------------------
# The kernel path's masks vs the float64 oracle.
# ---------------------------------------------------------------------------


def kernel_mask_batch(vocab):
  """``test_threshold.kept_set_batch`` at T = 1 (the oracle grid: every row
  kind x p x k x min-p; tail rows; NaN and +inf rows), then each kind's grid
  row with top-p 0.9 alone at T = 0.5 and 2 (powers of 2: ``x / T`` is
  exact in numpy) and at T = 0 (greedy: flat and ties rows tie at the max),
  and the NaN row at T = 0: ``(x, temps, ks, ps, ms, kinds)``."""
  x, ks, ps, ms, kinds = kept_set_batch(vocab)
  ks, ps, ms = map(np.asarray, (ks, ps, ms))
  top_p = [int(np.flatnonzero((kinds == kind) & (ps == 0.9) & (ks == vocab) &
                              (ms == 0))[0]) for kind in KINDS]
  nan_row = int(np.flatnonzero(kinds == "invalid")[0])
  rows = top_p * 3 + [nan_row]
  temps = np.concatenate([np.ones(len(x)), np.repeat([0.5, 2.0, 0.0],
                                                     len(top_p)), [0.0]])
  x, ks, ps, ms, kinds = (np.concatenate([a, a[rows]])
                          for a in (x, ks, ps, ms, kinds))
  return x, temps, ks, ps, ms, kinds


def assert_kernel_masks_match_oracle(x, temps, ks, ps, ms, result, m, kinds):
  """Per row of ``x`` (sampled with ``result`` and mask ``m`` under these
  params; ``temps`` powers of 2 or 0) against the float64 oracle on
  ``y = x / T``:

  * sampled valid rows: ``count`` is the oracle's ``|K|`` and
    ``{y >= count-th largest}`` its kept set (an admissible one near a top-p
    rounding boundary); ``truncated == (count < #finite)``; ``overflow ==
    truncated & (count > K_cap)``; truncated rows list the first ``min(count,
    K_cap)`` ids of ``K`` by descending ``y``, smallest id first on ties, then
    -1; untruncated ones list nothing, ``logz`` exactly 0 and ``to_lists``
    ``None``; ``lse`` and ``logz`` within ``mass_tolerance`` of float64; the
    token lies in ``K`` with ``logprob == y_token - lse - logz``;
  * greedy rows: the argmax (smallest id on ties) alone, ``count`` 1,
    ``logz`` 0, ``lse = max(y)``, logprob 0;
  * invalid rows (NaN, +inf): ``valid`` False, logprob -inf, ``count`` 0,
    ids -1, truncated, no overflow, ``logz = lse = -inf``, ``to_lists``
    ``([], -inf)``.

  Returns ``(near, overflow)``: the rows near a boundary (at most 2% of the
  sampled valid rows) and the number of overflowing rows."""
  batch, vocab = x.shape
  cap = m.ids.shape[1]
  assert_mask_types(m, batch, cap)
  y = np.stack([tempered(x[b], temps[b]) for b in range(batch)])
  valid = np.isfinite(y.max(axis=-1))  # NaN propagates through max
  np.testing.assert_array_equal(result.valid, valid)
  lists = m.to_lists()
  near = []
  for b in range(batch):
    ctx = (f"row {b} kind={kinds[b]} T={temps[b]} k={ks[b]} p={ps[b]} "
           f"m={ms[b]} count={m.count[b]} K_cap={cap}")
    host_ids, host_logz = lists[b]
    assert host_logz == m.logz[b], ctx
    if not valid[b]:
      assert m.count[b] == 0 and m.truncated[b] and not m.overflow[b], ctx
      np.testing.assert_array_equal(m.ids[b], -1, err_msg=ctx)
      assert m.logz[b] == -np.inf and m.lse[b] == -np.inf, ctx
      assert host_ids == [] and result.logprobs[b] == -np.inf, ctx
      continue
    if temps[b] == 0:
      argmax = int(np.argmax(y[b]))  # the first of a tie
      assert result.tokens[b] == argmax, ctx
      assert m.count[b] == 1 and m.truncated[b] and not m.overflow[b], ctx
      np.testing.assert_array_equal(m.ids[b], [argmax] + [-1] * (cap - 1),
                                    err_msg=ctx)
      assert m.logz[b] == 0 and m.lse[b] == y[b].max(), ctx
      assert result.logprobs[b] == 0 and host_ids == [argmax], ctx
      continue
    o = oracle_keep(y[b], ks[b], ps[b], ms[b])
    finite = y[b] > -np.inf
    count = int(m.count[b])
    assert 0 < count <= finite.sum(), ctx
    kept = (y[b] >= np.sort(y[b])[::-1][count - 1]) & finite
    assert kept.sum() == count, ctx  # a whole tie group at the threshold
    if o.near_boundary:
      near.append(b)
      assert o.admits(kept), ctx
    else:
      np.testing.assert_array_equal(kept, o.kept, err_msg=ctx)
    assert m.truncated[b] == (count < finite.sum()), ctx
    assert m.overflow[b] == (m.truncated[b] and count > cap), ctx
    if m.truncated[b]:
      ids = oracle_order(y[b], kept)[:cap].tolist()
      if m.overflow[b]:  # the token listed (its last slot if not among them)
        ids = with_token(ids, result.tokens[b])
      np.testing.assert_array_equal(listed(m, b), ids, err_msg=ctx)
      assert host_ids == (dict(ids=ids, count=count, overflow=True)
                          if m.overflow[b] else ids), ctx
    else:  # no filter removed anything
      np.testing.assert_array_equal(m.ids[b], -1, err_msg=ctx)
      assert m.logz[b] == 0 and host_ids is None, ctx
    lse = logsumexp64(y[b], finite)
    assert abs(m.lse[b] - lse) <= mass_tolerance(lse, LSE_ATOL), (
        ctx, m.lse[b], lse)
    logz = logsumexp64(y[b], kept) - lse
    assert abs(m.logz[b] - logz) <= mass_tolerance(lse, LOGZ_ATOL), (
        ctx, m.logz[b], logz)
    token = result.tokens[b]
    assert kept[token], (ctx, token)
    rebuilt = float(y[b, token]) - float(m.lse[b]) - float(m.logz[b])
    assert abs(result.logprobs[b] - rebuilt) <= mass_tolerance(
        lse, LOGPROB_ATOL) + LOGPROB_RTOL * abs(rebuilt), (
            ctx, result.logprobs[b], rebuilt)
  sampled = valid & (temps > 0)
  assert len(near) <= 0.02 * sampled.sum(), (
      f"{len(near)} of {sampled.sum()} rows near a boundary")
  return near, int(m.overflow.sum())


@pytest.mark.kernels
@pytest.mark.parametrize("vocab,cap,overflows", [
    (1007, 8, 200), on_gpu(1007, 1024, 0), on_gpu(151936, 8, 200),
    on_gpu(151936, 1024, 150)])
def test_kernel_masks_match_oracle(vocab, cap, overflows):
  """``sample(..., return_mask=True)`` on the kernels (``kernel_mask_batch``:
  the oracle grid of every row kind, incl. ties, flat, peaked and -inf rows,
  x p in {1e-6, 0.5, 0.9, 0.999999, 1} x k in {1, 2, 50, V - 1, V} x min-p;
  tail, NaN and +inf rows; tempered and greedy rows) against float64 per
  row (``assert_kernel_masks_match_oracle``): count, kept ids by
  probability (the first K_cap), truncated and overflow flags, ``logz`` and
  ``lse``; the token in the mask with the logprob rebuilt from it.  By the
  oracle, K_cap 8 overflows on 201 rows (V = 1007) and 218 (V = 151936);
  K_cap 1024 on 180 at V = 151936 (large kept sets: listed from the K_cap
  window), none at V = 1007.  Interpret mode: V = 1007, K_cap 8 (one
  compile); the rest compiled on a GPU."""
  x, temps, ks, ps, ms, kinds = kernel_mask_batch(vocab)
  params = SamplingParams.make(len(x), temperature=temps, top_k=ks, top_p=ps,
                               min_p=ms)
  result, m = sample_with_mask(x, params, jax.random.key(vocab),
                               impl="pallas", max_mask_ids=cap)
  _, overflow = assert_kernel_masks_match_oracle(x, temps, ks, ps, ms, result,
                                                 m, kinds)
  assert overflow >= overflows, overflow


# ---------------------------------------------------------------------------
# Overflow: ids capped at K_cap, count and logz exact.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_overflow_ties_at_the_cap_take_the_smallest_ids(impl):
  vocab = 64
  x = np.zeros((3, vocab), np.float32)
  x[0, :8] = [1, 3, 2, 3, 2, 2, 0, 2]
  x[0, 8:] = -np.inf
  tied = [50, 3, 17, 40, 9, 60, 22, 31, 5, 12]
  x[1, tied] = 5.0
  x[2] = np.random.default_rng(6).standard_normal(vocab)
  params = SamplingParams.make(3, top_k=[5, 3, 20])
  key = jax.random.key(6)
  result, m = sample_with_mask(x, params, key, impl=impl, max_mask_ids=4)
  firsts = [[1, 3, 2, 4], [3, 5, 9, 12], np.argsort(-x[2], kind="stable")[:4]]
  np.testing.assert_array_equal(m.ids, [with_token(ids, t) for ids, t in zip(
      firsts, result.tokens)])
  np.testing.assert_array_equal(m.count, [6, 10, 20])  # past K_cap = 4 and k
  assert m.overflow.all() and m.truncated.all()
  for b, kept in enumerate([x[0] >= 2, x[1] == 5.0, x[2] >= np.sort(x[2])[-20]]):
    logz = logsumexp_np(x[b], kept) - logsumexp_np(x[b], x[b] > -np.inf)
    np.testing.assert_allclose(m.logz[b], logz, rtol=1e-5, atol=2e-6)
    assert kept[result.tokens[b]]
    np.testing.assert_allclose(rebuilt_logprob(m, b, x[b], result.tokens[b]),
                               result.logprobs[b], rtol=1e-5, atol=1e-5)
  assert m.to_lists()[1][0] == {"ids": with_token([3, 5, 9, 12],
                                                  result.tokens[1]),
                                "count": 10, "overflow": True}
  # A larger cap lists the same order further.
  _, wide = sample_with_mask(x, params, key, impl=impl, max_mask_ids=32)
  np.testing.assert_array_equal([with_token(ids[:4], t) for ids, t in zip(
      wide.ids, result.tokens)], m.ids)
  np.testing.assert_array_equal(wide.count, m.count)
  np.testing.assert_array_equal(wide.logz, m.logz)
  assert not wide.overflow.any()


def test_overflow_random_rows_match_oracle():
  vocab, cap = 1007, 8
  r = np.random.default_rng(7)
  x = (r.standard_normal((4, vocab)) * 1.5).astype(np.float32)
  ks, ps, ms = [50, 0, 0, 9], [1.0, 0.95, 1.0, 1.0], [0.0, 0.0, 0.05, 0.0]
  m = extract(x, SamplingParams.make(4, top_k=ks, top_p=ps, min_p=ms),
              max_mask_ids=cap)
  assert_mask_types(m, 4, cap)
  for b in range(4):
    o = oracle_keep(x[b], ks[b], ps[b], ms[b])
    assert not o.near_boundary
    assert m.count[b] == o.kept.sum() > cap and m.overflow[b]
    np.testing.assert_array_equal(m.ids[b], oracle_order(x[b], o.kept)[:cap])
    logz = logsumexp_np(x[b], o.kept) - logsumexp_np(x[b], x[b] > -np.inf)
    np.testing.assert_allclose(m.logz[b], logz, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("fp64,cap", [
    (False, 8), slow_case(False, 12), slow_case(True, 12), slow_case(True, 8)])
def test_kernel_lists_large_kept_sets_like_the_reference(fp64, cap):
  """Kept sets too large for the candidate buffer (16: ``sample_large``, or
  ``kept_sets`` on the FP64 path) and for K_cap: at 8 (<= 16 / 2) the
  candidate buffer of top-k = 8 lists the ids, at 12 the window search by
  count finds the 12th largest kept value, and its buffer lists them; a row
  whose sample (every 32nd logit, all low) hides a flat kept set of 975
  ties, so its candidates overflow with no window (``top_ids`` over the
  whole row), a small kept set (the candidate buffer lists it), a row with
  no filter, and a large row (top-k 10 > 16 / 2) whose kept set fits K_cap
  12 (the window lists it from its own threshold): tokens, logprobs, ids,
  counts and logz equal the reference's."""
  vocab = 1007
  r = np.random.default_rng(11)
  x = (r.standard_normal((8, vocab)) * 1.5).astype(np.float32)
  x[1, r.choice(vocab, 30, replace=False)] = 2.5  # ties across the cap
  x[4] = 0.0
  x[4, ::32] = -10.0
  params = SamplingParams.make(8, temperature=[1, 0.7, 1.3, 1, 1, 1, 1, 0.8],
                               top_k=[0, 0, 0, 300, 0, 5, 0, 10],
                               top_p=[0.95, 0.9, 0.5, 1, 0.5, 1, 1, 1],
                               min_p=[0, 0, 0.01, 0, 0, 0, 0, 0])
  key = jax.random.key(3)
  with jax.enable_x64(fp64):
    got, got_mask = sample_with_mask(x, params, key, impl="pallas",
                                     max_candidates=16, max_mask_ids=cap,
                                     use_fp64_gumbel=fp64)
    want, want_mask = sample_with_mask(x, params, key, impl="xla",
                                       max_mask_ids=cap, use_fp64_gumbel=fp64)
  np.testing.assert_array_equal(got_mask.overflow,
                                [True] * 5 + [False] * 2 + [cap < 10])
  np.testing.assert_array_equal(got_mask.truncated,
                                [True] * 6 + [False, True])
  np.testing.assert_array_equal(got_mask.count[5:], [5, vocab, 10])
  assert got_mask.count[4] == vocab - 32
  for f in ("ids", "count", "truncated", "overflow"):
    np.testing.assert_array_equal(getattr(got_mask, f),
                                  getattr(want_mask, f), err_msg=f)
  np.testing.assert_allclose(got_mask.logz, want_mask.logz, rtol=1e-5,
                             atol=2e-6)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("cap", [slow_case(40), 8])
def test_masks_from_kept_sets_equal_the_samplers(cap):
  """``sampler.kept_set_masks`` of ``kept_sets(..., measure_all=True)``
  (``extract_sampling_mask``'s kernel path; the spec sampler's masks)
  equals the mask of ``sample`` on the kernels: kept sets the candidate
  buffer or a window search measured, a min-p row and a row with flat ties
  that no search measures (a floored counting pass counts them), a greedy,
  an untruncated and an invalid row."""
  vocab = 20000
  r = np.random.default_rng(12)
  x = (r.standard_normal((8, vocab)) * 1.5).astype(np.float32)
  x[2] = 0.0
  x[2, ::32] = -10.0  # flat ties hidden from the sample
  x[6, 5] = np.nan
  params = SamplingParams.make(8, temperature=[1, 0.7, 1, 1.3, 0, 1, 1, 0.8],
                               top_k=[0, 0, 0, 5, 0, 0, 0, 3000],
                               top_p=[0.95, 0.9, 0.5, 1, 0.9, 1, 0.9, 1],
                               min_p=[0, 0, 0, 0, 0, 0.02, 0, 0])
  config = SamplerConfig(implementation="pallas", max_candidates=64,
                         max_mask_ids=cap)
  canon = params.canonical(vocab)

  @jax.jit
  def masks(x):  # extract_sampling_mask's kernel path, sets included
    sets = threshold.kept_sets(x, canon, config, order_width=cap,
                               measure_all=True)
    return sets, sampler.kept_set_masks(x, canon, sets, config)

  sets, got = to_np(masks(jnp.asarray(x)))
  kept = sets.threshold > -np.inf
  np.testing.assert_array_equal(kept, [True] * 4 + [False, True, False, True])
  # The candidate buffer (3) and window searches by count (7) and mass (1)
  # measure their sets; min-p alone (5) and the hidden ties (2) are counted
  # by a pass (the counts below would be undefined otherwise).
  np.testing.assert_array_equal(sets.measured, kept)
  result, want = sample_with_mask(x, params, jax.random.key(0), impl="pallas",
                                  max_candidates=64, max_mask_ids=cap)
  # sample's mask also lists its token (the last slot when a set overflows).
  got = to_np(sampling_mask.with_token(jax.tree.map(jnp.asarray, got),
                                       jnp.asarray(result.tokens),
                                       jnp.asarray(result.valid)))
  assert_masks_equal(got, want, exact_floats=False)


# ---------------------------------------------------------------------------
# The mask is the set the sampler drew from.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("truncating,impl", [
    (True, "xla"), (False, "xla"), (True, "pallas"), slow_case(False, "pallas")])
def test_sampled_token_in_mask_with_consistent_logprob(impl, truncating):
  batch, vocab = 64, 256
  x, temps, params = mixed_batch(8, batch, vocab, truncating=truncating)
  expected = extract(x, params)
  assert expected.truncated.sum() >= (batch // 2 if truncating else 5)
  # extract_sampling_mask on the backend: the same mask, with no token.
  alone = extract(x, params, implementation=impl)
  assert_masks_equal(alone, expected, exact_floats=impl == "xla")
  for seed in range(8):
    result, m = sample_with_mask(x, params, jax.random.key(seed), impl=impl)
    # One kept set per row, whatever the key (the kernels' masses in
    # another compiled program: a batch without filters takes the Gumbel
    # route alone when closed over).
    assert_masks_equal(m, alone, exact_floats=impl == "xla")
    assert result.valid.all()
    for b in range(batch):
      y, token = tempered(x[b], temps[b]), result.tokens[b]
      assert mask_kept(m, b, y)[token], (seed, b, token)
      np.testing.assert_allclose(rebuilt_logprob(m, b, y, token),
                                 result.logprobs[b], rtol=1e-5, atol=1e-5)


# STAT_CONFIGS (conftest): the untruncated ones run the Pallas kernel.


@pytest.mark.parametrize("name,impl", [
    *((name, "xla") for name in STAT_CONFIGS),
    *((name, "pallas") if name == "combined" else slow_case(name, "pallas")
      for name in STAT_CONFIGS)])
def test_tokens_follow_the_rebuilt_distribution(impl, name):
  """Chi-square at alpha = 1e-3 over STAT_DRAWS draws of one row against
  ``exp(y_i - lse - logz)`` on the mask; at this sample count the same test
  rejects the untruncated distribution for every truncating config."""
  cfg = STAT_CONFIGS[name]
  logits = (np.random.default_rng(42).standard_normal(STAT_VOCAB) * 1.2).astype(
      np.float32)
  x = np.broadcast_to(logits, (STAT_DRAWS, STAT_VOCAB))
  params = SamplingParams.make(STAT_DRAWS, **cfg)
  result, m = sample_with_mask(x, params, jax.random.key(1234), impl=impl)
  # Identical rows, identical masks (the kernel's sum-exp shares the noisy
  # race's reference point: its lse varies by an ulp or so with the noise).
  assert_masks_equal(m, jax.tree.map(lambda a: np.broadcast_to(a[:1], a.shape), m),
                     exact_floats=impl == "xla")
  y = tempered(logits, cfg["temperature"])
  kept = mask_kept(m, 0, y)
  probs = np.where(kept, np.exp(y.astype(np.float64) - m.lse[0] - m.logz[0]), 0.0)
  assert abs(probs.sum() - 1) < 1e-5
  o = oracle_keep(y, cfg.get("top_k", 0), cfg.get("top_p", 1.0),
                  cfg.get("min_p", 0.0))
  assert not o.near_boundary
  np.testing.assert_allclose(probs, o.probs(y), rtol=1e-5, atol=1e-7)
  assert_chi2_fits(result.tokens, probs)
  full = np.exp(y - logsumexp_np(y, y > -np.inf))
  stat, df = chi2_statistic(np.bincount(result.tokens, minlength=STAT_VOCAB), full)
  assert (stat > chi2_critical(df, 1e-3)) == m.truncated[0]


# Kept sets too large for a 16-slot candidate buffer, one V = 1007 row each:
# (params, sampled every 32nd logit at -30 (a misleading sample), found by a
# window search).
LARGE_STAT_ROWS = {
    "window_top_p": (dict(temperature=1.0, top_p=0.9), False, True),
    "window_top_k": (dict(temperature=0.8, top_k=300), False, True),
    "pivot_top_p": (dict(temperature=1.0, top_p=0.9), True, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LARGE_STAT_ROWS))
def test_large_kept_sets_follow_the_rebuilt_distribution(name):
  """The kernel path's large-set routes (``sample_large``: a window search,
  or the pivot search where the row's sample misleads the window), checked
  as ``test_tokens_follow_the_rebuilt_distribution`` checks the candidate
  buffer's: chi-square at alpha = 1e-3 over 1024 draws, 16 bins of about
  equal mass (``assert_binned_chi2_fits``), against ``exp(y_i - lse -
  logz)`` on the mask (equal to the oracle's truncated distribution), and
  the same draws reject the untruncated one (their count outside the kept
  set).  Resolution: a temperature 30% off (total variation 0.12) fails the
  fit by a wide margin (chi-square 116-128 against 37.8), 10% off (0.04)
  does not at this draw count."""
  cfg, misleading, windowed = LARGE_STAT_ROWS[name]
  vocab, draws = 1007, 1024
  logits = (np.random.default_rng(43).standard_normal(vocab) * 1.2).astype(
      np.float32)
  if misleading:
    logits[::32] = -30.0
  config = dict(max_candidates=16, max_mask_ids=vocab)
  sets = jax.jit(functools.partial(
      threshold.kept_sets, config=SamplerConfig(**config)))(
          jnp.asarray(logits[None]),
          SamplingParams.make(1, **cfg).canonical(vocab))
  assert bool(sets.measured[0]) == windowed  # measured: a window found it
  x = np.broadcast_to(logits, (draws, vocab))
  params = SamplingParams.make(draws, **cfg)
  result, m = sample_with_mask(x, params, jax.random.key(4321), impl="pallas",
                               **config)
  assert_masks_equal(m, jax.tree.map(lambda a: np.broadcast_to(a[:1], a.shape),
                                     m), exact_floats=False)
  # extract_sampling_mask on the kernels (the kept sets) finds the same.
  assert_masks_equal(extract(logits[None], SamplingParams.make(1, **cfg),
                             implementation="pallas", **config),
                     jax.tree.map(lambda a: a[:1], m), exact_floats=False)
  y = tempered(logits, cfg["temperature"])
  kept = mask_kept(m, 0, y)
  assert 16 < kept.sum() < vocab and not m.overflow[0]
  probs = np.where(kept, np.exp(y.astype(np.float64) - m.lse[0] - m.logz[0]),
                   0.0)
  o = oracle_keep(y, cfg.get("top_k", 0), cfg.get("top_p", 1.0), 0.0)
  assert not o.near_boundary
  np.testing.assert_allclose(probs, o.probs(y), rtol=1e-5, atol=1e-7)
  assert_binned_chi2_fits(result.tokens, probs)
  # Kept against dropped tokens: the untruncated distribution expects
  # (1 - kept mass) of the draws outside the kept set.
  full = np.exp(y - logsumexp_np(y, y > -np.inf))
  outside = np.sum(~kept[result.tokens])
  stat, df = chi2_statistic([draws - outside, outside],
                            [full[kept].sum(), full[~kept].sum()])
  assert stat > chi2_critical(df, 1e-3)


@pytest.mark.parametrize("truncating,impl", [
    (True, "xla"), (False, "xla"), (True, "pallas"), slow_case(False, "pallas")])
def test_rows_never_exchange_masks(impl, truncating):
  """Shuffling the batch (per-request keys) permutes tokens and masks alike."""
  batch, vocab = 16, 256
  x, temps, params = mixed_batch(9, batch, vocab, truncating=truncating)
  x[3, 7] = np.nan  # an invalid row
  keys = jax.random.split(jax.random.key(9), batch)
  positions = jnp.arange(batch, dtype=jnp.int32) * 3
  perm = np.random.default_rng(9).permutation(batch)
  permuted = jax.tree.map(lambda a: a[perm], params)
  a = sample_with_mask(x, params, keys, impl=impl, positions=positions)
  b = sample_with_mask(x[perm], permuted, keys[perm], impl=impl,
                       positions=positions[perm])
  for got, want in zip(jax.tree.leaves(b), jax.tree.leaves(a)):
    np.testing.assert_array_equal(got, want[perm])
  assert a[1].truncated.sum() >= (batch // 2 if truncating else 3)
  assert len(set(a[1].lse.tolist())) == batch  # every row's mask differs
  lists = a[1].to_lists()
  assert b[1].to_lists() == [lists[i] for i in perm]


# ---------------------------------------------------------------------------
# Greedy and invalid rows.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_greedy_rows_report_the_argmax(impl):
  vocab = 64
  x = np.random.default_rng(10).standard_normal((6, vocab)).astype(np.float32)
  x[0, [5, 9, 40]] = 10.0  # ties at the max: smallest id
  x[1] = 0.0
  x[2, :3] = -np.inf
  x[3] = -np.inf
  x[3, 62:] = -1.0  # one finite tie group
  x[4, 63] = 100.0
  params = SamplingParams.make(6, temperature=0.0, top_k=[0, 1, 2, 0, 5, 0],
                               top_p=[1.0, 0.5, 1.0, 0.2, 1.0, 1.0],
                               min_p=[0.0, 0.0, 0.3, 0.0, 0.0, 1.0])
  argmax = np.argmax(x, axis=-1)
  for cap in (1, 1024):
    result, m = sample_with_mask(x, params, jax.random.key(10), impl=impl,
                                 max_mask_ids=cap)
    np.testing.assert_array_equal(result.tokens, argmax)
    np.testing.assert_array_equal(m.ids[:, 0], argmax)
    np.testing.assert_array_equal(m.ids[:, 1:], -1)
    np.testing.assert_array_equal(m.count, 1)
    assert m.truncated.all() and not m.overflow.any()
    np.testing.assert_array_equal(m.logz, 0.0)
    np.testing.assert_array_equal(m.lse, x.max(-1))
    # The point mass: y_argmax - lse - logz = 0, the sampler's logprob.
    np.testing.assert_array_equal(x[np.arange(6), argmax] - m.lse - m.logz,
                                  result.logprobs)
    assert m.to_lists() == [([int(a)], 0.0) for a in argmax]


def invalid_batch(vocab):
  """Rows 0-6 are invalid (NaN, +inf, all -inf, tempered overflow, greedy
  with NaN), row 7 valid and truncating."""
  r = np.random.default_rng(11)
  x = r.standard_normal((8, vocab)).astype(np.float32)
  x[0, 5] = np.nan
  x[1, 3] = np.inf
  x[2] = -np.inf
  x[3, :] = np.nan
  x[4, 9] = 3e38  # / 0.5 overflows
  x[5, 2] = np.nan
  x[6, [2, 7]] = np.inf
  x[6, 8:] = -np.inf
  params = SamplingParams.make(8, temperature=[1, 1, 1, 0.7, 0.5, 0, 0, 1],
                               top_k=[0, 3, 0, 0, 5, 2, 0, 4],
                               top_p=[1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 0.9, 1.0])
  return x, params


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_invalid_rows_keep_nothing(impl):
  vocab = 64
  x, params = invalid_batch(vocab)
  result, m = sample_with_mask(x, params, jax.random.key(11), impl=impl)
  np.testing.assert_array_equal(result.valid, [False] * 7 + [True])
  np.testing.assert_array_equal(m.count[:7], 0)
  np.testing.assert_array_equal(m.ids[:7], -1)
  assert m.truncated.all() and not m.overflow.any()
  np.testing.assert_array_equal(m.logz[:7], -np.inf)
  np.testing.assert_array_equal(m.lse[:7], -np.inf)
  assert m.to_lists()[:7] == [([], -math.inf)] * 7
  assert m.to_json()[:7] == [[[]]] * 7
  # The valid row's mask is the one it has alone.
  alone = extract(x[7:], jax.tree.map(lambda a: a[7:], params))
  assert_masks_equal(jax.tree.map(lambda a: a[7:], m), alone,
                     exact_floats=impl == "xla")
  np.testing.assert_array_equal(listed(m, 7), np.argsort(-x[7], kind="stable")[:4])


# ---------------------------------------------------------------------------
# Shapes, jit, dtypes, empty batches.
# ---------------------------------------------------------------------------


def test_jit_fixed_shapes_one_compilation():
  """One compilation serves untruncated, truncating, greedy and invalid
  batches; jitted equals eager; dtypes stay int32/fp32 under x64."""
  vocab, cap = 64, 100  # K_cap > V: ids padded to K_cap
  config = SamplerConfig(max_mask_ids=cap)
  # A function of its own: jit caches are shared per wrapped function.
  jitted = jax.jit(lambda l, p: jaxsample.extract_sampling_mask(l, p,
                                                                config=config))
  x, params = invalid_batch(vocab)
  batches = [(x, params),
             (x[::-1].copy(), SamplingParams.make(8)),
             (np.abs(x), SamplingParams.make(8, temperature=0.0)),
             (x, SamplingParams.make(8, top_p=0.3))]
  for logits, p in batches:
    got = to_np(jitted(jnp.asarray(logits), p))
    assert_mask_types(got, 8, cap)
    assert_masks_equal(got, to_np(jaxsample.extract_sampling_mask(
        jnp.asarray(logits), p, config=config)))
  assert jitted._cache_size() == 1
  with jax.enable_x64(True):
    assert_mask_types(to_np(jitted(jnp.asarray(x), params)), 8, cap)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_SLOW_KERNELS)
def test_bf16_logits_equal_their_fp32_upcast(impl):
  batch, vocab = 8, 1007
  x = jnp.asarray(np.random.default_rng(12).standard_normal((batch, vocab)) * 3,
                  jnp.bfloat16)  # bf16 rounding: many ties
  params = SamplingParams.make(batch, temperature=[1.0, 0.0, 0.7, 1.3] * 2,
                               top_k=[0, 0, 20, 0, 0, 5, 0, 0],
                               top_p=[1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 0.5],
                               min_p=[0.0] * 6 + [0.1, 0.0])
  key = jax.random.key(12)
  low = sample_with_mask(x, params, key, impl=impl, max_mask_ids=16)
  high = sample_with_mask(x.astype(jnp.float32), params, key, impl=impl,
                          max_mask_ids=16)
  for got, want in zip(jax.tree.leaves(low), jax.tree.leaves(high)):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(low[1].overflow, [0, 0, 1, 1, 0, 0, 0, 0])
  assert low[1].truncated.sum() == 6


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_empty_batch(impl):
  x, params = jnp.zeros((0, 1007), jnp.float32), SamplingParams.make(0)
  outs = [jaxsample.extract_sampling_mask(
      x, params, config=SamplerConfig(implementation=impl, max_mask_ids=7)),
          jaxsample.sample(x, params, jax.random.key(0), return_mask=True,
                           config=SamplerConfig(implementation=impl,
                                                max_mask_ids=7))[1],
          _sample(x, params, jax.random.key(0),
                  config=SamplerConfig(implementation=impl, max_mask_ids=7))[1]]
  for m in map(to_np, outs):
    assert_mask_types(m, 0, 7)
    assert m.to_lists() == [] and m.to_json() == []


# ---------------------------------------------------------------------------
# Host forms: to_lists, to_json, a leading token axis.
# ---------------------------------------------------------------------------


def test_to_lists_and_json_per_request():
  """Invalid, overflowing top-4 (K_cap 3), greedy and untruncated rows."""
  x = np.random.default_rng(13).standard_normal((4, 64)).astype(np.float32)
  x[0, 7] = np.nan
  params = SamplingParams.make(4, temperature=[1, 1, 0, 1], top_k=[0, 4, 0, 0])
  m = extract(x, params, max_mask_ids=3)
  top3 = np.argsort(-x[1], kind="stable")[:3].tolist()
  argmax = int(np.argmax(x[2]))
  over = {"ids": top3, "count": 4, "overflow": True}  # never cut silently
  assert m.to_lists() == [([], -math.inf), (over, float(m.logz[1])),
                          ([argmax], 0.0), (None, 0.0)]
  assert m.overflow.tolist() == [False, True, False, False]
  js = m.to_json()
  assert js == [[[]], [over], [[argmax]], [None]]
  assert json.loads(json.dumps(js)) == js
  assert all(type(i) is int for i in js[1][0]["ids"])
  for host_form in (m.to_lists, m.to_json):
    with pytest.raises(MaskOverflowError, match=r"requests \[1\].*max_mask_ids"):
      host_form(on_overflow="raise")


def test_leading_token_axis():
  """One mask per emitted token: ``[T, B, ...]`` from vmap over target rows,
  or a stacked list of per-step masks."""
  steps, batch, vocab = 3, 4, 64
  r = np.random.default_rng(14)
  x = r.standard_normal((batch, steps, vocab)).astype(np.float32)  # [B, T, V]
  params = SamplingParams.make(batch, temperature=[1, 0, 1, 1],
                               top_k=[5, 0, 0, 0], top_p=[1, 1, 0.5, 1])
  config = SamplerConfig(max_mask_ids=8)
  per_step = [jaxsample.extract_sampling_mask(x[:, t], params, config=config)
              for t in range(steps)]
  vmapped = jax.vmap(
      lambda l: jaxsample.extract_sampling_mask(l, params, config=config),
      in_axes=1)(jnp.asarray(x))
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_step)
  assert isinstance(vmapped, SamplingMask) and vmapped.ids.shape == (steps, batch, 8)
  assert_masks_equal(to_np(vmapped), to_np(stacked))
  lists = [m.to_lists() for m in per_step]
  assert vmapped.to_lists() == [[lists[t][b] for t in range(steps)]
                                for b in range(batch)]
  js = vmapped.to_json()
  assert js == [[lists[t][b][0] for t in range(steps)] for b in range(batch)]
  assert js[3] == [None] * steps and all(len(e) == 5 for e in js[0])
  assert json.loads(json.dumps(js)) == js


@pytest.mark.parametrize("value", [0, -3, True, 2.5, None, "8"])
def test_max_mask_ids_validated(value):
  with pytest.raises(ValueError, match="max_mask_ids"):
    SamplerConfig(max_mask_ids=value)


def test_max_mask_ids_default_and_static():
  assert SamplerConfig().max_mask_ids == 1024
  assert SamplerConfig(max_mask_ids=np.int64(8)) == SamplerConfig(max_mask_ids=8)
  assert len({SamplerConfig(max_mask_ids=8), SamplerConfig()}) == 2
