"""jaxsample._src.mask: the kept set each token was drawn from (mask.py docstring).

Masks are checked against the numpy float64 oracle (helpers/oracle.py), and masks
returned by ``sample(..., return_mask=True)`` against the tokens and logprobs
drawn with them, on both backends.  The kernel path's masks (truncation
kernels, interpret mode) against the oracle on ``test_threshold``'s kept-set
batch, and overflowing (capped) masks, are ``test_mask_kernels.py``'s.
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
from jaxsample import SamplerConfig, SamplingMask, SamplingParams
from jaxsample._src.mask import MaskOverflowError
from jaxsample._src.backends import pallas as pallas_backend

from helpers.cases import (KINDS, M_VALUES, P_VALUES, assert_mask_types,
                           assert_masks_equal, extract, k_values, listed, logsumexp64,
                           make_row, mask_kept, oracle_order, rebuilt_logprob,
                           sample_masked, sample_with_mask, tempered, to_np)
from helpers.oracle import oracle_keep
from helpers.parametrize import (IMPLEMENTATIONS, IMPLEMENTATIONS_SLOW_KERNELS,
                                 slow_case)
from helpers.stats import (STAT_CONFIGS, STAT_DRAWS, STAT_VOCAB,
                           assert_binned_chi2_fits, assert_chi2_fits,
                           chi2_critical, chi2_statistic)


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
      logz = logsumexp64(y, kept) - logsumexp64(y, finite)
      np.testing.assert_allclose(mask.logz[b], logz, rtol=1e-5, atol=2e-6,
                                 err_msg=ctx)
    else:
      assert mask.logz[b] == 0.0, ctx
    np.testing.assert_allclose(mask.lse[b], logsumexp64(y, finite), rtol=1e-6,
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
# The mask is the set the sampler drew from.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("truncating,impl", [
    (True, "xla"), (False, "xla"), slow_case(True, "pallas"),
    slow_case(False, "pallas")])
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


# STAT_CONFIGS (helpers.stats): the untruncated ones run the Pallas kernel.


@pytest.mark.parametrize("name,impl", [
    *((name, "xla") for name in STAT_CONFIGS),
    *(slow_case(name, "pallas") for name in STAT_CONFIGS)])
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
  full = np.exp(y - logsumexp64(y, y > -np.inf))
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
      pallas_backend.kept_sets, config=SamplerConfig(**config)))(
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
  full = np.exp(y - logsumexp64(y, y > -np.inf))
  outside = np.sum(~kept[result.tokens])
  stat, df = chi2_statistic([draws - outside, outside],
                            [full[kept].sum(), full[~kept].sum()])
  assert stat > chi2_critical(df, 1e-3)


@pytest.mark.parametrize("truncating,impl", [
    (True, "xla"), (False, "xla"), (True, "pallas"), slow_case(False, "pallas")])
def test_rows_never_exchange_masks(impl, truncating):
  """Shuffling the batch (per-request keys) permutes tokens and masks alike.
  (``invalid_batch``'s shape: the kernels' program is compiled once.)"""
  batch, vocab = 8, 64
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
  # Per-request keys and positions: test_rows_never_exchange_masks's program
  # (a batch key on the kernels: test_mask_kernels).
  result, m = sample_with_mask(x, params, jax.random.split(jax.random.key(11), 8),
                               impl=impl, positions=jnp.arange(8, dtype=jnp.int32))
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
          sample_masked(x, params, jax.random.key(0),
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
  # Jitted: two compiles (eager, every op of every call compiled: 305).
  step = lambda l: jaxsample.extract_sampling_mask(l, params, config=config)
  per_step = [jax.jit(step)(x[:, t]) for t in range(steps)]
  vmapped = jax.jit(jax.vmap(step, in_axes=1))(jnp.asarray(x))
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
