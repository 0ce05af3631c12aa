"""jaxsample._src.mask on the kernel path: the truncation kernels' masks (interpret
mode here, GPU-marked cases compiled at V = 151936) against the numpy float64
oracle on ``test_threshold``'s kept-set batch (``test_kernel_masks_match_oracle``),
and overflowing masks (ids capped at K_cap, count and logz exact) on both
backends.  The mask's semantics on both backends are ``test_mask.py``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import sampling_mask
from jaxsample._src.backends import pallas as pallas_backend
from jaxsample._src.pallas import threshold

from helpers.cases import (KINDS, LOGPROB_ATOL, LOGPROB_RTOL, LOGZ_ATOL, LSE_ATOL,
                           assert_mask_types, assert_masks_equal, extract,
                           kept_set_batch, listed, logsumexp64, mass_tolerance,
                           oracle_order, rebuilt_logprob, sample_with_mask, tempered,
                           to_np)
from helpers.oracle import oracle_keep
from helpers.parametrize import IMPLEMENTATIONS_SLOW_KERNELS, on_gpu


def with_token(ids, token) -> list:
  """An overflowed row's listed ``ids`` (the first ``K_cap`` of its kept
  set) as the sampler lists them: its ``token`` in the last slot if it is
  not among them (``sampling_mask.with_token``)."""
  ids = [int(i) for i in ids]
  return ids if int(token) in ids else ids[:-1] + [int(token)]


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


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_SLOW_KERNELS)
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
    logz = logsumexp64(x[b], kept) - logsumexp64(x[b], x[b] > -np.inf)
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
    logz = logsumexp64(x[b], o.kept) - logsumexp64(x[b], x[b] > -np.inf)
    np.testing.assert_allclose(m.logz[b], logz, rtol=1e-5, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("fp64,cap", [(False, 8), (False, 12), (True, 12),
                                      (True, 8)])
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


@pytest.mark.slow
@pytest.mark.parametrize("cap", [40, 8])
def test_masks_from_kept_sets_equal_the_samplers(cap):
  """``pallas_backend.kept_set_masks`` of ``kept_sets(..., measure_all=True)``
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
    sets = pallas_backend.kept_sets(x, canon, config, order_width=cap,
                               measure_all=True)
    return sets, pallas_backend.kept_set_masks(x, canon, sets, config)

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
