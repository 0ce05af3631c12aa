"""The truncated-sampling kernels (``jaxsample._src.pallas.threshold``) in interpret mode.

Kept sets against the numpy sort-based oracle, the exactness certificate
(``complete``), invalid rows and the lowering.  The window and fixed-pass
pivot searches for rows whose kept set no buffer holds:
``test_threshold_search.py``.  Tokens of whole batches against the XLA
reference: ``test_truncated_sampling.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import reference, rng
from jaxsample._src.pallas import common, gumbel, threshold

from helpers.cases import kept_set_batch, truncate
from helpers.oracle import oracle_keep
from helpers.parametrize import on_gpu, slow_case
from helpers.programs import sort_operands


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
  """``key_prefix(lower, upper)`` holds the high bits every key in
  ``[lower, upper]`` shares; a search started there (``largest_key``'s
  ``start``) finds the answer when it lies in that block, the block's
  largest key when it lies above, and 0 when it lies below."""
  r = np.random.default_rng(3)
  a = (r.standard_normal(60) * r.choice([1e-3, 1, 1e3], 60)).astype(
      np.float32)
  b = (a + np.abs(r.standard_normal(60)) * r.choice([0, 1e-6, 1e-2, 10],
                                                     60)).astype(np.float32)
  a[:3], b[:3] = [-np.inf, 1.5, -2.0], [np.inf, 1.5, -1.999]
  for lower, upper in zip(a, b):
    prefix, known = threshold.search.key_prefix(jnp.float32(lower),
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


@pytest.mark.slow  # the GPU run compiles these kernels (docs/testing.md, "Tiers")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_kernels_lower_to_triton(monkeypatch, dtype):
  """The sampler with truncation (stats, select and candidate kernels, and the
  Gumbel kernel for the other rows) lowers to Triton IR for an abstract H100;
  the PTX compile and the run are the GPU suite's.  (bf16 logits through
  the same threshold kernels lower in the default suite too:
  ``test_spec_kernels.test_kernels_lower_to_triton[threefry-bf16]``.)"""
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
