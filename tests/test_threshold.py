"""The truncated-sampling kernels (``jaxsample.pallas.threshold``) in interpret mode.

Kept sets against the numpy sort-based oracle, the exactness certificate
(``complete``), the window and fixed-pass pivot searches for rows whose kept
set no buffer holds, and the lowering.  Tokens of whole batches against the
XLA reference: ``test_truncated_sampling.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import on_gpu, oracle_keep, run_sample, slow_case, sort_operands
import jaxsample
from jaxsample import SamplerConfig, SamplingParams, reference, rng
from jaxsample.pallas import common, gumbel, threshold, tuning
from jaxsample.pallas.tuning import PivotLaunch, Tuning

from cases import kept_set_batch


@functools.cache
def _truncated_sampler(config):
  """One jitted ``sample_truncated`` per config: params and streams are
  arguments, so calls of one shape compile once."""
  return jax.jit(functools.partial(threshold.sample_truncated, config=config))


def truncate(x, params, config=SamplerConfig(), key=jax.random.key(0)):
  batch, vocab = x.shape
  canon = params.canonical(vocab)
  streams, _ = rng.row_streams(key, None, batch, vocab)
  return jax.tree.map(np.asarray, _truncated_sampler(config)(
      jnp.asarray(x), canon, streams))


def test_order_key_is_monotone_and_invertible():
  values = np.float32([-np.inf, -3e38, -1.5, -1e-30, -0.0, 0.0, 1e-30, 2.5,
                       3e38, np.inf])
  keys = np.asarray(common.order_key(jnp.asarray(values)))
  assert np.all(np.diff(keys.astype(np.int64)) >= 0)
  assert keys[4] == keys[5]  # -0.0 == +0.0
  # Compiled too (XLA folds ``y + 0.0`` away: it kept -0.0's key apart).
  np.testing.assert_array_equal(
      jax.jit(common.order_key)(jnp.asarray(values)), keys)
  back = np.asarray(common.key_value(jnp.asarray(keys)))
  np.testing.assert_array_equal(back, values + np.float32(0.0))


def test_key_searches_from_a_shared_prefix():
  """``_key_prefix(lower, upper)`` holds the high bits every key in
  ``[lower, upper]`` shares; a search started there (``_largest_key``'s
  ``start``) finds the answer when it lies in that block, the block's
  largest key when it lies above, and 0 when it lies below."""
  r = np.random.default_rng(3)
  a = (r.standard_normal(60) * r.choice([1e-3, 1, 1e3], 60)).astype(
      np.float32)
  b = (a + np.abs(r.standard_normal(60)) * r.choice([0, 1e-6, 1e-2, 10],
                                                     60)).astype(np.float32)
  a[:3], b[:3] = [-np.inf, 1.5, -2.0], [np.inf, 1.5, -1.999]
  for lower, upper in zip(a, b):
    prefix, known = threshold.search._key_prefix(jnp.float32(lower),
                                                 jnp.float32(upper))
    middle = (lower / 2 + upper / 2) if np.isfinite(lower) and np.isfinite(
        upper) else 0.0
    keys = common.order_key(jnp.float32([lower, upper, middle]))
    mask = np.uint32(0) if int(known) == 0 else np.uint32(
        (0xFFFFFFFF << (32 - int(known))) & 0xFFFFFFFF)
    np.testing.assert_array_equal(np.asarray(keys) & mask, int(prefix))
    assert int(known) == 32 or (int(keys[0]) ^ int(keys[1])) >> (
        31 - int(known)) & 1
    for answer in (keys[2], keys[0] - 1, keys[1] + 1):
      found = threshold.search.largest_key(
          lambda v, answer=answer: v <= answer, 32, (prefix, known))
      block_max = int(prefix) | (~int(mask) & 0xFFFFFFFF)
      want = (int(answer) if int(prefix) <= int(answer) <= block_max else
              block_max if int(answer) > block_max else 0)
      assert int(found) == want, (lower, upper, int(answer))


@pytest.mark.kernels
@pytest.mark.parametrize("seed", [0, on_gpu(1), on_gpu(2), on_gpu(3)])
def test_logit_floor_splits_like_the_quotient(seed):
  """``x < logit_floor(floor, T)`` iff ``reference.divide(x, T) < floor`` (the
  kernels' ``y``), for x within 64 ulps of the logit floor and at random,
  on rows whose floors are tempered logits (as thresholds are), arbitrary
  values, -inf, +inf and values no finite x reaches."""
  r = np.random.default_rng(seed)
  rows = 512
  t = r.choice([0.05, 0.3, 0.7, 1.0, 1.3, 3.0, 1e-3], rows).astype(np.float32)
  x_at = (r.standard_normal(rows) * r.choice([1, 30, 1e4], rows)).astype(
      np.float32)
  floor = np.array(reference.divide(jnp.asarray(x_at), jnp.asarray(t)))
  floor[::5] = r.standard_normal(rows)[::5] * 20
  floor[1::37], floor[2::37], floor[3::37] = -np.inf, np.inf, 3.4e38
  x_floor = jax.jit(common.logit_floor)(jnp.asarray(floor), jnp.asarray(t))
  x_floor = np.asarray(x_floor)
  assert np.all(x_floor[1::37] == -np.inf)
  # Only x = inf reaches floor = inf where T >= 1 (x / T overflows below 1).
  assert np.all(x_floor[2::37][t[2::37] >= 1] == np.inf)
  near = np.where(np.isfinite(x_floor), x_floor, np.float32(0))[:, None]
  # Steps of one ulp are steps of one order key (across zero and signs).
  keys = np.asarray(common.order_key(jnp.asarray(near))).astype(np.int64)
  keys = np.clip(keys + np.arange(-64, 65)[None, :], 0x00800000, 0xFF7FFFFF)
  x = np.asarray(common.key_value(jnp.asarray(keys.astype(np.uint32))))
  spread = np.minimum(np.abs(near), np.float32(1e37)) * 2
  x = np.concatenate([x, r.standard_normal((rows, 64)).astype(np.float32) *
                      spread, np.float32([[-np.inf, np.inf]] * rows)], axis=1)
  y = np.asarray(jax.jit(reference.divide)(
      jnp.asarray(x), jnp.asarray(np.broadcast_to(t[:, None], x.shape))))
  np.testing.assert_array_equal(x < x_floor[:, None], y < floor[:, None])


@pytest.mark.parametrize("k,p", [(1, 1.0), (50, 1.0), (50, 0.9), (200, 1.0),
                                 (0, 0.9), (0, 0.5), (0, 1e-6)])
def test_bound_mode_rounds_the_exact_threshold_down(k, p):
  """Bound mode on a whole row: top-k on, the k-th largest value; else the
  top-p threshold; either rounded down by less than 2^-11 of its magnitude."""
  r = np.random.default_rng(k + int(p * 100))
  y = (r.standard_normal((4, 256)) * np.float32([[1], [3], [10], [30]])
       ).astype(np.float32)
  y[:, 200:] = -np.inf  # padding
  y[1, :100] = np.round(y[1, :100])  # ties
  params = SamplingParams.make(4, top_k=k, top_p=p).canonical(256)
  target = SamplingParams.make(4, top_k=k, top_p=1.0 if k else p).canonical(256)
  row_max = y.max(axis=-1)
  mass = np.sum(np.exp(y - row_max[:, None]), axis=-1)
  bound, *_ = threshold.select_threshold(
      jnp.asarray(y), jnp.asarray(row_max), jnp.full((4,), -jnp.inf), params,
      jnp.asarray(mass), bound=True, interpret=True)
  exact = np.asarray(reference.keep_threshold(jnp.asarray(y), target))
  bound = np.asarray(bound)
  assert np.all(bound <= exact), (bound, exact)
  assert np.all(exact - bound <= 2.0**-11 * np.abs(exact)), (bound, exact)


@pytest.mark.kernels
@pytest.mark.parametrize("vocab", [slow_case(16), 1007, on_gpu(151936)])
def test_kept_sets_match_oracle(vocab):
  """Every kind of row x p x k x min-p: every valid truncating row is
  complete and keeps the oracle's set (an admissible one on a rounding
  boundary, at most 2% of the rows), with its count and mass; top-p
  0.999999 rows are checked exactly, those where it drops a tail
  (``tail_rows``) too.  Invalid rows in the batch (``invalid_rows``) are
  left to the Gumbel kernel (not complete, not unfinished), which gives the
  reference's token, ``valid`` False and logprob -inf; the other rows keep
  the oracle's sets beside them.  On a GPU the kernels run compiled; at
  V = 151936 the rows whose ties at a threshold overflow the candidate
  buffer or span a window (flat rows, rows of a few values, peaked rows
  whose 151935 other entries tie) take the pivot search."""
  y, ks, ps, ms, kinds = kept_set_batch(vocab)
  params = SamplingParams.make(len(y), top_k=ks, top_p=ps, min_p=ms)
  canon = params.canonical(vocab)
  tr = truncate(y, params)
  truncating = np.asarray(canon.truncates())
  assert not tr.complete[~truncating].any()
  near, exact_top = 0, {"kept": 0, "trimmed": 0}
  for i in np.flatnonzero(tr.complete):
    o = oracle_keep(y[i], ks[i], ps[i], ms[i])
    kept = (y[i] >= tr.threshold[i]) & (y[i] > -np.inf)
    ctx = f"row {i} kind={kinds[i]} k={ks[i]} p={ps[i]} m={ms[i]}"
    near += o.near_boundary
    if o.near_boundary:
      assert o.admits(kept), ctx
    else:
      np.testing.assert_array_equal(kept, o.kept, err_msg=ctx)
      if ps[i] == 0.999999:  # does top-p drop a survivor of min-p and top-k?
        trimmed = o.kept.sum() < oracle_keep(y[i], ks[i], 1.0,
                                             ms[i]).kept.sum()
        exact_top["trimmed" if trimmed else "kept"] += 1
    assert tr.count[i] == kept.sum(), ctx
    mass = np.sum(np.exp(y[i][kept].astype(np.float64) - y[i].max()))
    np.testing.assert_allclose(tr.log_kept[i], np.log(mass), rtol=1e-5,
                               atol=1e-5, err_msg=ctx)
    assert kept[tr.token[i]], ctx
  valid = np.isfinite(y.max(axis=-1))
  left = truncating & ~tr.complete & valid
  assert not left.any(), [(kinds[i], ks[i], ps[i], ms[i])
                          for i in np.flatnonzero(left)]
  assert near <= 0.02 * valid.sum(), f"{near} of {valid.sum()} rows near"
  # Top-p 0.999999 rows are checked exactly (9 in 10 at least), also where
  # it drops a tail (``tail_rows``), not only where every survivor is kept.
  top = np.sum(tr.complete & (np.asarray(ps) == 0.999999))
  assert exact_top["trimmed"] >= 2, exact_top
  assert sum(exact_top.values()) >= 0.9 * top, (exact_top, top)
  check_invalid_rows(y[~valid], canon, tr, ~valid)


def check_invalid_rows(x, canon, tr, invalid):
  """Invalid rows ``x`` (``invalid`` of a batch of canonical params
  ``canon`` whose truncation is ``tr``) take the Gumbel kernel, as in
  ``jaxsample.sample``: the truncation kernels leave them (not complete,
  not ``unfinished``: no large-set search), and the Gumbel kernel gives the
  reference's token (the first NaN or +inf) bit for bit, ``valid`` False
  and logprob -inf."""
  batch, vocab = x.shape
  assert not tr.complete[invalid].any()
  assert not np.asarray(tr.unfinished(canon))[invalid].any()
  assert not np.isfinite(tr.row_max[invalid]).any()
  rows = jax.tree.map(lambda a: a[np.flatnonzero(invalid)], canon)
  streams, _ = rng.row_streams(jax.random.key(0), None, batch, vocab)
  got, *_ = jax.jit(lambda x: gumbel.sample_untruncated(
      x, rows, streams, SamplerConfig()))(jnp.asarray(x))
  want = reference.sample_reference(jnp.asarray(x), rows, streams,
                                    generator="philox")
  got, want = jax.tree.map(np.asarray, (got, want))
  first = np.argmax(np.isnan(x) | (x == np.inf), axis=-1)
  np.testing.assert_array_equal(want.tokens, first)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert not got.valid.any() and not want.valid.any()
  assert ((0 <= got.tokens) & (got.tokens < vocab)).all(), got.tokens
  np.testing.assert_array_equal(got.logprobs, -np.inf)
  np.testing.assert_array_equal(want.logprobs, -np.inf)


def test_small_kept_sets_are_always_certified():
  """top-k <= 50 and peaked top-p rows never need the fallback."""
  vocab = 5000
  r = np.random.default_rng(3)
  x = r.standard_normal((12, vocab)).astype(np.float32) * 2
  x[6:] *= 4  # peaked
  params = SamplingParams.make(12, top_k=[1, 2, 50, 50, 7, 0] * 2,
                               top_p=[1, 1, 1, 0.9, 0.5, 0.3] * 2,
                               min_p=[0, 0, 0, 0, 0, 0.2] * 2)
  tr = truncate(x, params)
  assert tr.complete.all()


def test_overflowing_rows_take_the_pivot_search():
  """A row with top-k at most ``C / 2`` whose candidates overflow the buffer
  (here: the tie at the threshold) is left incomplete by the buffer and
  finished by the pivot search; rows with a larger top-k take the window
  searches.  All keep the oracle's set."""
  vocab = 3000
  x = np.random.default_rng(4).standard_normal((4, vocab)).astype(np.float32)
  x[0, :200] = 5.0
  params = SamplingParams.make(4, top_k=[5, 100, 200, 5], top_p=[1, 1, 0.99, 1])
  config = SamplerConfig(max_candidates=64)
  tr = truncate(x, params, config)
  unfinished = truncate_unfinished(x, params, config)
  np.testing.assert_array_equal(unfinished, [True, True, True, False])
  np.testing.assert_array_equal(tr.large != 0, [False, True, True, False])
  assert tr.complete.all()
  for i in range(4):
    o = oracle_keep(x[i], int(params.top_k[i]), float(params.top_p[i]), 0.0)
    np.testing.assert_array_equal(x[i] >= tr.threshold[i], o.kept)
    assert tr.count[i] == o.kept.sum()


def truncate_unfinished(x, params, config):
  """``Truncation.unfinished``: the rows the buffers left to ``sample_large``."""
  batch, vocab = x.shape
  canon = params.canonical(vocab)
  streams, _ = rng.row_streams(jax.random.key(0), None, batch, vocab)
  tr = jax.jit(lambda x: threshold.sample_truncated(
      x, canon, streams, config, finish_large=False))(jnp.asarray(x))
  return np.asarray(tr.unfinished(canon))


def test_rows_read_only_their_listed_segments_when_they_can():
  """Top-k rows, min-p rows whose bound is t1 and top-p rows without min-p
  read only the segments reaching their bound; top-p + min-p rows and rows
  with too many listed segments read the whole row.  Both give the oracle's
  kept set, count and mass."""
  vocab = 20000
  r = np.random.default_rng(21)
  scale = np.float32([1, 1, 5, 5, 5, 1, 5, 1])[:, None]
  x = (r.standard_normal((8, vocab)) * scale).astype(np.float32)
  ks = [50, 300, 0, 0, 0, 0, 0, 7]
  ps = [0.9, 1, 0.9, 0.5, 0.9, 1, 1, 0.8]
  ms = [0, 0, 0, 0, 0.001, 0.05, 0.2, 0]
  params = SamplingParams.make(8, top_k=ks, top_p=ps, min_p=ms)
  tr = truncate(x, params, SamplerConfig(max_candidates=4096))
  np.testing.assert_array_equal(
      tr.gathered, [True, False, True, True, False, False, True, True])
  assert tr.complete.all()
  for i in range(8):
    o = oracle_keep(x[i], ks[i], ps[i], ms[i])
    kept = x[i] >= tr.threshold[i]
    assert o.admits(kept) if o.near_boundary else (kept == o.kept).all(), i
    assert tr.count[i] == kept.sum(), i
    mass = np.sum(np.exp(x[i][kept].astype(np.float64) - x[i].max()))
    np.testing.assert_allclose(tr.log_kept[i], np.log(mass), rtol=1e-5,
                               atol=1e-5, err_msg=str(i))
    assert kept[tr.token[i]], i


@pytest.mark.parametrize("setting", [
    pytest.param(dict(top_p=0.9), id="top_p=0.9"),
    slow_case(dict(top_p=0.5), id="top_p=0.5"),
    slow_case(dict(top_p=0.95, min_p=0.01), id="top_p=0.95,min_p=0.01"),
    slow_case(dict(min_p=0.05), id="min_p=0.05"),
    slow_case(dict(top_k=19999), id="top_k=19999"),
    slow_case(dict(top_k=5000, min_p=0.001), id="top_k=5000,min_p=0.001"),
    pytest.param(dict(top_k=[3000, 200, 12000, 600], top_p=[0.9, 1, 0.5, 0.95]),
                 id="per-request")])
def test_large_kept_sets_are_decided_by_the_window_search(setting):
  """Rows with top-k off or above ``C / 2`` whose kept sets overflow the
  candidate buffer take the window searches: complete (so not by the
  buffer), with the oracle's kept set, count and mass and the reference's
  token and logprob."""
  batch, vocab = 4, 20000
  r = np.random.default_rng(11)
  x = (r.standard_normal((batch, vocab)) * np.float32([[1], [2], [1], [3]])
       ).astype(np.float32)
  x[2, :7] = -np.inf
  params = SamplingParams.make(batch, temperature=[1, 0.7, 1.3, 1], **setting)
  config = SamplerConfig(max_candidates=256)
  key = jax.random.key(12)
  tr = truncate(x, params, config, key)
  y = np.asarray(reference.temper(jnp.asarray(x), params.temperature))
  large = 0
  for i in range(batch):
    o = oracle_keep(y[i], int(params.top_k[i]), float(params.top_p[i]),
                    float(params.min_p[i]))
    large += o.kept.sum() > config.max_candidates
    kept = (y[i] >= tr.threshold[i]) & (y[i] > -np.inf)
    if o.near_boundary:
      assert o.admits(kept), i
    else:
      np.testing.assert_array_equal(kept, o.kept, err_msg=str(i))
    assert tr.count[i] == kept.sum(), i
    mass = np.sum(np.exp(y[i][kept].astype(np.float64) - y[i].max()))
    np.testing.assert_allclose(tr.log_kept[i], np.log(mass), rtol=1e-5,
                               atol=1e-5)
  assert large >= 2
  assert (tr.large != 0).sum() >= 2
  assert tr.complete.all()
  streams, _ = rng.row_streams(key, None, batch, vocab)
  want = reference.sample_reference(jnp.asarray(x), params.canonical(vocab),
                                    streams, generator="philox")
  np.testing.assert_array_equal(tr.token, want.tokens)
  np.testing.assert_allclose(tr.logprob, want.logprobs, rtol=1e-5, atol=1e-5)
  if setting == dict(top_p=0.9):  # and through jaxsample.sample
    a = run_sample(x, params, key, impl="pallas", max_candidates=256)
    np.testing.assert_array_equal(a.tokens, want.tokens)


def test_window_searched_kept_sets_come_measured():
  """``kept_sets`` of rows whose thresholds window searches found (top-p,
  top-k with min-p, both) reports their mass (``measured``), so the
  speculative sampler's pass 1 skips them; min-p alone keeps ``{y >= t1}``
  with no mass measured."""
  batch, vocab = 4, 20000
  x = (np.random.default_rng(14).standard_normal((batch, vocab)) *
       np.float32([[1], [2], [1], [1]])).astype(np.float32)
  ks, ps, ms = [0, 5000, 3000, 0], [0.9, 1, 0.9, 1], [0, 0.001, 0, 0.05]
  params = SamplingParams.make(batch, temperature=[1, 0.7, 1.3, 1],
                               top_k=ks, top_p=ps, min_p=ms)
  sets = jax.tree.map(np.asarray, jax.jit(functools.partial(
      threshold.kept_sets, config=SamplerConfig(max_candidates=256)))(
          jnp.asarray(x), params.canonical(vocab)))
  y = np.asarray(reference.temper(jnp.asarray(x), params.temperature))
  np.testing.assert_array_equal(sets.measured, [True, True, True, False])
  for i in range(batch):
    o = oracle_keep(y[i], ks[i], ps[i], ms[i])
    kept = y[i] >= sets.threshold[i]
    assert kept.sum() > 256, i
    if o.near_boundary:
      assert o.admits(kept), i
    else:
      np.testing.assert_array_equal(kept, o.kept, err_msg=str(i))
    if sets.measured[i]:
      mass = np.sum(np.exp(y[i][kept].astype(np.float64) - y[i].max()))
      assert sets.row_max[i] == y[i].max()
      np.testing.assert_allclose(sets.log_kept[i], np.log(mass), rtol=1e-5,
                                 atol=1e-5, err_msg=str(i))


def test_large_rows_list_their_top_ids_in_the_narrow_pass():
  """With ``order_width <= C / 2``, the narrow pass (its bound, compact,
  pack and select launches) also takes the ``large`` rows, as top-k =
  ``order_width`` rows with min-p kept: their ``ordered_ids`` are their
  ``order_width`` largest survivors by descending ``y`` (smallest id first
  on ties), flagged ``top_listed`` and not ``complete``; the other rows'
  kept sets are unchanged."""
  batch, vocab, width = 6, 20000, 16
  r = np.random.default_rng(5)
  x = (r.standard_normal((batch, vocab)) * 1.5).astype(np.float32)
  x[1, r.choice(vocab, 40, replace=False)] = 5.0  # ties across the width
  params = SamplingParams.make(
      batch, temperature=[1, 0.7, 1.3, 1, 1, 0.9], top_k=[0, 0, 300, 0, 5, 0],
      top_p=[0.95, 0.9, 1, 1, 1, 0.5], min_p=[0, 0, 0, 0.001, 0, 0.2]
  ).canonical(vocab)
  config = SamplerConfig(max_candidates=64)
  streams, _ = rng.row_streams(jax.random.key(0), None, batch, vocab)
  tr = jax.tree.map(np.asarray, jax.jit(lambda x: threshold.sample_truncated(
      x, params, streams, config, order_width=width, finish_large=False))(
          jnp.asarray(x)))
  plain = jax.tree.map(np.asarray, jax.jit(lambda x: threshold.sample_truncated(
      x, params, streams, config, finish_large=False))(jnp.asarray(x)))
  large = [True, True, True, True, False, False]
  np.testing.assert_array_equal(tr.large != 0, large)
  np.testing.assert_array_equal(tr.top_listed, large)
  np.testing.assert_array_equal(tr.complete, np.logical_not(large))
  np.testing.assert_array_equal(plain.top_listed, False)
  y = np.asarray(reference.temper(jnp.asarray(x), params.temperature))
  for i in range(batch):
    kept = (y[i] >= tr.t1[i]) if large[i] else (y[i] >= tr.threshold[i])
    order = np.flatnonzero(kept)[np.lexsort((np.flatnonzero(kept),
                                             -y[i][kept]))]
    n = min(width, order.size)
    np.testing.assert_array_equal(tr.ordered_ids[i, :n], order[:n],
                                  err_msg=str(i))
    if not large[i]:
      np.testing.assert_array_equal(tr.ordered_ids[i, n:], -1)
      assert tr.threshold[i] == plain.threshold[i] and (
          tr.token[i] == plain.token[i]), i


def test_masks_of_large_sets_list_in_the_first_search_pass():
  """A mask wider than ``C / 2`` lists large kept sets from the compact pass
  of each row's first window search (top-k's; top-p's without top-k; a pass
  of its own for min-p alone): the listing holds exactly ``{y >= lower}`` in
  vocab order, its search by count holds the ``width``-th largest survivor,
  and the ids equal the oracle's order of the kept set."""
  batch, vocab, width = 4, 20000, 200
  r = np.random.default_rng(21)
  x = (r.standard_normal((batch, vocab)) * np.float32([[1], [2], [1], [1.5]])
       ).astype(np.float32)
  params = SamplingParams.make(
      batch, temperature=[1, 0.7, 1.3, 1], top_k=[0, 5000, 0, 3000],
      top_p=[0.9, 0.9, 1, 1], min_p=[0, 0, 0.05, 0]).canonical(vocab)
  config = SamplerConfig(max_candidates=256)
  assert threshold.route._listing_width(width, config)
  streams, _ = rng.row_streams(jax.random.key(0), None, batch, vocab)

  @jax.jit
  def listed_ids(x):
    tr = threshold.sample_truncated(x, params, streams, config,
                                    finish_large=False)
    rows = tr.unfinished(params)
    sets, listed = threshold.large_thresholds(x, params, tr, config, rows,
                                              list_width=width)
    lower = listed.listing.lower
    launch = tuning.resolve(config.tuning).window
    _, _, _, held = threshold.route._window_threshold(
        listed.window, threshold.route._top_width(params, width),
        listed.listing.rows, tr.t1, lower, jnp.full_like(lower, jnp.inf),
        tr.row_max, listed.listing.capacity, launch, by_count=True)
    # The window kernel of each row's search placed the listing as a
    # by-count window of its own would (with no upper end).
    _, alone, upper = threshold.route._place_window(
        threshold.route._top_width(params, width), tr, rows, tr.t1,
        listed.listing.capacity, launch, by_count=True)
    return rows, tr.large != 0, sets, listed, held, (alone, upper), (
        threshold.large_kept_ids(x, params, tr, config, rows, sets.threshold,
                                 width, listed))

  rows, large, sets, listed, held, (alone, upper), ids = jax.tree.map(
      np.asarray, listed_ids(jnp.asarray(x)))
  assert rows.all() and large.all() and held.all()
  np.testing.assert_array_equal(listed.listing.lower, alone)
  np.testing.assert_array_equal(upper, np.inf)
  y = np.asarray(reference.temper(jnp.asarray(x), params.temperature))
  window = listed.window
  for i in range(batch):
    inside = np.flatnonzero(y[i] >= listed.listing.lower[i])
    assert width < window.count[i] == inside.size <= listed.listing.capacity
    np.testing.assert_array_equal(window.ids[i, :inside.size], inside)
    o = oracle_keep(y[i], int(params.top_k[i]), float(params.top_p[i]),
                    float(params.min_p[i]))
    np.testing.assert_array_equal(
        (y[i] >= sets.threshold[i]) & (y[i] > -np.inf), o.kept)
    order = np.lexsort((np.arange(vocab), -y[i].astype(np.float64)))
    np.testing.assert_array_equal(ids[i], order[o.kept[order]][:width])


def test_a_misleading_sample_takes_the_pivot_search():
  """Every sampled element is far below the rest (top-p, top-k), or every
  element ties (top-k): the window misses, and the pivot search finds the
  oracle's threshold; tokens equal the reference's."""
  batch, vocab = 3, 20000
  x = np.random.default_rng(13).standard_normal((batch, vocab)).astype(
      np.float32)
  x[:, ::threshold.base.SAMPLE_STRIDE] = -30
  x[2] = 0.5
  params = SamplingParams.make(batch, top_p=[0.9, 1, 1],
                               top_k=[0, 10000, vocab - 1])
  key = jax.random.key(14)
  config = SamplerConfig(max_candidates=256)
  tr = truncate(x, params, config, key)
  assert tr.complete.all()
  for i in range(batch):
    o = oracle_keep(x[i], int(params.top_k[i]), float(params.top_p[i]), 0.0)
    np.testing.assert_array_equal(x[i] >= tr.threshold[i], o.kept)
  a = run_sample(x, params, key, impl="pallas", max_candidates=256)
  b = run_sample(x, params, key, impl="xla")
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


def test_a_window_holds_the_tie_group_at_its_upper_rank():
  """Sample values in groups of 16 equal bf16 values (positive and negative
  rows): the window by count reaches above the whole group of its upper
  rank's value, so a threshold there stays in the window (rounded down, the
  upper end left that group above the window)."""
  groups, size, capacity = 32, 16, 1024
  half = threshold.window.window_half(capacity)
  r = np.random.default_rng(21)
  values = np.repeat(np.arange(groups) * 0.0625, size)
  sample = np.stack([r.permutation(values) + 1.0,
                     r.permutation(values) - 12.0]).astype(np.float32)
  rank = 100  # sample rank of the k-th largest: k // _SAMPLE_STRIDE
  params = SamplingParams.make(
      2, top_k=rank * threshold.base.SAMPLE_STRIDE).canonical(
          sample.shape[1] * threshold.base.SAMPLE_STRIDE)
  row_max = jnp.asarray(sample.max(axis=1))
  lower, upper = threshold.threshold_window(
      jnp.asarray(sample), row_max, jnp.full((2,), -jnp.inf), params,
      jnp.ones((2,)), capacity, jnp.ones((2,), bool), by_count=True,
      interpret=True)
  descending = -np.sort(-sample, axis=1)
  # The (rank - half)-th and (rank + half)-th largest, 1-based.
  np.testing.assert_array_less(descending[:, rank - half - 1], upper)
  assert (np.asarray(lower) <= descending[:, rank + half - 1]).all()
  assert (np.asarray(upper) <= descending[:, rank - half - 1] + 0.0625).all()


def pivot_rows(vocab, r):
  """Rows for ``pivot_threshold``: random, wide (keys spanning most of the
  32-bit range), flat, a few values, ties at the top, -inf entries and one
  finite entry."""
  rows = [r.standard_normal(vocab),
          r.standard_normal(vocab) * 1e30 * 10.0 ** r.integers(-60, 8, vocab),
          np.full(vocab, 0.25),
          np.round(r.standard_normal(vocab) * 2) / 2,
          np.where(np.arange(vocab) < vocab // 3, 7.0, r.standard_normal(vocab)),
          np.where(r.random(vocab) < 0.6, -np.inf, r.standard_normal(vocab)),
          np.where(np.arange(vocab) == vocab // 2, -1e-3, -np.inf)]
  return np.asarray(rows, np.float32)


@pytest.mark.parametrize("vocab", [40, 3001])
def test_pivot_threshold_matches_oracle(vocab):
  """``pivot_threshold`` alone, on every kind of row: by count, the
  ``min(k, n)``-th largest survivor above a floor; by mass, top-p's threshold
  on the survivors (an admissible one where fp32 sums decide the crossing)."""
  r = np.random.default_rng(vocab)
  y = pivot_rows(vocab, r)
  batch = len(y)
  row_max = y.max(axis=-1)
  quantile = np.quantile(np.where(np.isfinite(y), y, row_max[:, None]), 0.3,
                         axis=-1)
  floor = np.where(np.arange(batch) % 2 == 0, -np.inf, quantile).astype(
      np.float32)
  floor = np.minimum(floor, row_max)
  survive = (y >= floor[:, None]) & (y > -np.inf)
  ks = np.int32([1, 2, vocab // 3, vocab - 1, vocab, 7, 1][:batch])
  ps = np.float32([0.9, 0.5, 1e-6, 0.999999, 0.3, 0.9, 0.7][:batch])
  params = SamplingParams.make(batch, top_k=ks, top_p=ps).canonical(vocab)
  config = SamplerConfig(tuning=Tuning(pivot=PivotLaunch(block_size=16))
                         if vocab < 100 else None)
  search = jax.jit(lambda y, lower, by_count: threshold.pivot_threshold(
      y, params, jnp.ones((batch,), bool), jnp.asarray(floor),
      jnp.asarray(row_max), config, by_count=by_count, lower=lower),
                   static_argnums=2)
  found = {by_count: np.asarray(search(jnp.asarray(y), None, by_count))
           for by_count in (True, False)}
  for by_count in (True, False):  # from a lower bound: the median survivor,
    # or the answer itself (no pass left to run)
    median = np.nanmedian(np.where(survive, y, np.nan), axis=-1)
    lower = np.where(np.arange(batch) % 3 == 0, found[by_count],
                     np.minimum(median, found[by_count])).astype(np.float32)
    np.testing.assert_array_equal(
        search(jnp.asarray(y), jnp.asarray(lower), by_count), found[by_count])
  for i in range(batch):
    values = np.sort(y[i][survive[i]])[::-1]
    want = values[min(ks[i], len(values)) - 1]
    assert found[True][i] == want, (i, found[True][i], want)
    o = oracle_keep(np.where(survive[i], y[i], -np.inf), 0, float(ps[i]), 0.0)
    kept = (y[i] >= found[False][i]) & survive[i]
    if o.near_boundary:
      assert o.admits(kept), i
    else:
      np.testing.assert_array_equal(kept, o.kept, err_msg=str(i))


def test_kernels_lower_to_triton(monkeypatch):
  """The sampler with truncation (stats, select and candidate kernels, and the
  Gumbel kernel for the other rows) lowers to Triton IR for an abstract H100;
  the PTX compile and the run are the GPU suite's."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                       num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  batch, vocab = 8, 151936

  def fn(x, temperature, top_k, top_p, min_p, key, return_mask=True):
    params = SamplingParams(temperature, top_k, top_p, min_p)
    return jaxsample.sample(x, params, key, return_mask=return_mask,
                            config=SamplerConfig(implementation="pallas"))

  S = jax.ShapeDtypeStruct
  for dtype in (jnp.float32, jnp.bfloat16):
    args = (S((batch, vocab), dtype), S((batch,), jnp.float32),
            S((batch,), jnp.int32), S((batch,), jnp.float32),
            S((batch,), jnp.float32), S((2,), jnp.uint32))
    with jax.sharding.use_abstract_mesh(mesh):
      text = jax.jit(fn).trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()
    # stats, bounds, candidates, their packing, select; gumbel (rows
    # without a filter, invalid rows; with traced params every route runs);
    # the rows they leave: the top-k and the top-p searches (each a window,
    # windowed candidates, their packing, an exact search, and the pivot
    # search), the floored Gumbel kernel; the mask's K_cap-th kept value, the
    # top-k = K_cap threshold: the listing's packing after each search's
    # compact pass (which filled it, in the window that the search's window
    # kernel placed), an exact search by count in it, and for rows it
    # misses the pivot search by count
    assert text.count("__gpu$xla.gpu.triton") == 17 + 2 + 1 + 1, dtype
    # No sort of the vocabulary: only the mask's [B, K_cap] pairs, listed
    # from the window's buffer or, for rows it missed, from the whole row.
    assert sort_operands(text) == [f"tensor<{batch}x1024xf32>, "
                                   f"tensor<{batch}x1024xi32>"] * 2, dtype
    # without a mask, no K_cap-th value
    no_mask = lambda *a: fn(*a, return_mask=False)
    with jax.sharding.use_abstract_mesh(mesh):
      text = jax.jit(no_mask).trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 17, dtype
    assert sort_operands(text) == [], dtype


def test_sort_operands_finds_the_reference_sort():
  """``sort_operands`` sees the XLA reference's sort of the vocabulary."""
  y = jax.ShapeDtypeStruct((4, 1000), jnp.float32)
  params = SamplingParams.make(4, top_p=0.9)
  text = jax.jit(lambda y: reference.keep_threshold(y, params)).lower(
      y).as_text()
  assert sort_operands(text) == ["tensor<4x1000xf32>"]
