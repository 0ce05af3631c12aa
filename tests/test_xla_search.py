"""jaxsample._src.xla_search: the sorting-free XLA path against the sort-based reference.

Kept sets must be the reference's (or, where a top-p crossing lies within
fp32 rounding of ``p``, another set the float64 oracle admits), tokens the
reference's bit for bit wherever the kept sets agree, logprobs and mask
``logz``/``lse`` within a few fp32 ulps, mask ids, counts and flags equal.
Rows are drawn fresh per case (seeded by the case); some force each fallback
(count search, mass search, a full pass for the top-p total, the full race).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import backends, reference, rng
from jaxsample._src import xla_search

from helpers.cases import params_by_row
from helpers.oracle import FP32_EPS, oracle_keep
from helpers.parametrize import slow_case
from helpers.programs import sort_operands

GENERATORS = ("philox", "threefry")
# One shape for every batch below: the jitted samplers compile once per
# config (a compile costs seconds on CPU).
BATCH, VOCAB = 16, 2048


# ---------------------------------------------------------------------------
# Order keys and the counting search.
# ---------------------------------------------------------------------------


def test_order_keys_follow_value_order():
  r = np.random.default_rng(0)
  specials = np.array([0.0, -0.0, np.inf, -np.inf, 1.1754942e-38,
                       -3.4028235e38, 3.4028235e38, 1.0, -1.0], np.float32)
  values = np.concatenate([specials, (r.standard_normal(4000) * 10.0 ** r.
                                      integers(-37, 38, 4000)).astype(
                                          np.float32)])
  values = values[(np.abs(values) >= np.finfo(np.float32).tiny) |
                  (values == 0)]
  keys = np.asarray(xla_search.order_keys(jnp.asarray(values)))
  order = np.argsort(values, kind="stable")
  assert np.all(np.diff(keys[order].astype(np.int64)) >= 0)
  # equal values (0 and -0 included) share a key; others do not
  same = values[order][1:] == values[order][:-1]
  assert np.all((np.diff(keys[order].astype(np.int64)) == 0) == same)
  assert np.all(keys >= 1)
  back = np.asarray(xla_search.key_value(jnp.asarray(keys)))
  np.testing.assert_array_equal(back, np.where(values == 0, 0.0, values))
  assert np.asarray(xla_search.key_value(jnp.uint32(0))) == -np.inf
  # XLA:CPU compares subnormals as zero; their keys follow its comparisons.
  subnormal = jnp.asarray([1e-45, -1e-45, 0.0], jnp.float32)
  if bool(subnormal[0] == 0):
    assert len(set(np.asarray(xla_search.order_keys(subnormal)))) == 1


@pytest.mark.parametrize("seed", range(3))
def test_reaching_key_is_the_largest_key_reaching_the_goal(seed):
  r = np.random.default_rng(seed)
  batch, vocab = 6, 300
  y = np.round(r.standard_normal((batch, vocab)) * 4, 1).astype(np.float32)
  keys = xla_search.order_keys(jnp.asarray(y))
  weights = r.uniform(0, 1, (batch, vocab)).astype(np.float32) * (
      r.uniform(size=(batch, vocab)) < 0.8)
  goal = (r.uniform(0, 1.1, batch) * weights.sum(-1)).astype(np.float32)
  found = np.asarray(xla_search.key_value(xla_search.reaching_key(
      keys, jnp.asarray(weights), jnp.asarray(goal))))
  for b in range(batch):
    reach = [float(v) for v in np.unique(y[b])
             if weights[b][y[b] >= v].sum(dtype=np.float64) >= goal[b] * (
                 1 + 1e-5)]
    miss = [float(v) for v in np.unique(y[b])
            if weights[b][y[b] >= v].sum(dtype=np.float64) < goal[b] * (
                1 - 1e-5)]
    if reach:
      assert found[b] >= max(reach)
    else:
      assert found[b] < min(y[b]) or found[b] == -np.inf
    if miss:
      assert found[b] < min(miss)
  counts = jnp.ones((batch, vocab), jnp.int32)
  kth = np.asarray(xla_search.key_value(xla_search.reaching_key(
      keys, counts, jnp.full((batch,), 17))))
  np.testing.assert_array_equal(kth, -np.sort(-y, axis=-1)[:, 16])


# ---------------------------------------------------------------------------
# Batches: rows and per-row params.
# ---------------------------------------------------------------------------


def _rows(kind: str, batch: int, vocab: int, r) -> np.ndarray:
  if kind == "peaked":  # LLM-like: randn * 3 and a few large heads
    x = r.standard_normal((batch, vocab)) * 3
    heads = r.integers(0, vocab, (batch, 3))
    np.put_along_axis(x, heads, r.uniform(12, 25, (batch, 3)), axis=-1)
    return x
  if kind == "flat":
    return r.standard_normal((batch, vocab))
  if kind == "tied":  # few distinct values: ties at every threshold
    return r.integers(-6, 3, (batch, vocab)) * 0.5
  if kind == "neg_inf":  # most entries -inf, some rows with a handful finite
    x = r.standard_normal((batch, vocab)) * 2
    x[r.uniform(size=(batch, vocab)) < 0.9] = -np.inf
    x[0, 3:] = -np.inf
    return x
  raise ValueError(kind)


def _mixed_params(batch: int, vocab: int, r) -> SamplingParams:
  """Per-row params cycling through greedy, no filter, each filter alone,
  combinations, k past the candidate widths, p near 0 and 1, min-p 1."""
  cases = [dict(temperature=0.0, top_k=5), dict(),
           dict(top_k=50, top_p=0.9), dict(top_p=0.95), dict(min_p=0.05),
           dict(top_k=1), dict(top_k=vocab // 2 + 7), dict(top_p=0.999),
           dict(top_k=300, top_p=0.7, min_p=0.01), dict(top_p=1e-6),
           dict(min_p=1.0), dict(top_k=2000, min_p=0.2),
           dict(top_p=0.5, temperature=0.3), dict(top_k=64, temperature=2.0)]
  return params_by_row(cases, batch, r)


@functools.partial(jax.jit, static_argnames=("impl", "generator", "width"))
def _run(logits, params, key, *, impl, generator, width):
  """``(result, mask)`` with a mask ``width`` wide, or ``(result, None)``
  for ``width = 0`` (the search path's candidates then come from the fp32
  logits themselves, not the tempered row)."""
  config = SamplerConfig(implementation=impl, rng=generator,
                         max_mask_ids=max(width, 1))
  if not width:
    return jaxsample.sample(logits, params, key, config=config), None
  return jaxsample.sample(logits, params, key, config=config, return_mask=True)


@functools.partial(jax.jit, static_argnames=("fn",))
def _process(logits, params, *, fn):
  return fn(logits, params.canonical(logits.shape[1])).keep


def _compare(logits, params, key, *, generator="philox", width=16):
  """Asserts the search path equals the reference on one batch, with a mask
  and without; returns the search path's (result, mask)."""
  ref, ref_mask = _run(logits, params, key, impl="xla", generator=generator,
                       width=width)
  out, out_mask = _run(logits, params, key, impl="xla_search",
                       generator=generator, width=width)
  unmasked, _ = _run(logits, params, key, impl="xla_search",
                     generator=generator, width=0)
  vocab = logits.shape[1]
  canon = params.canonical(vocab)
  keep_ref = np.asarray(_process(logits, params, fn=reference.process))
  keep = np.asarray(_process(logits, params, fn=xla_search.process))
  y = np.asarray(reference.temper(reference.sanitize(logits),
                                  canon.temperature))
  ulps = 8 * FP32_EPS * (1 + np.abs(y[np.isfinite(y)]).max())
  sampled = np.asarray(ref.valid) & (np.asarray(canon.temperature) > 0)
  same_set = np.ones(logits.shape[0], bool)
  for b in np.flatnonzero(sampled):
    if np.array_equal(keep[b], keep_ref[b]):
      continue
    same_set[b] = False
    oracle = oracle_keep(y[b], int(canon.top_k[b]), float(canon.top_p[b]),
                         float(canon.min_p[b]))
    assert oracle.near_boundary and oracle.admits(keep[b]), (
        f"row {b}: kept {keep[b].sum()} entries, reference {keep_ref[b].sum()}"
        f" (params {jax.tree.map(lambda a: a[b], canon)})")
  assert same_set.mean() >= 0.9
  for got in (out, unmasked):
    np.testing.assert_array_equal(np.asarray(got.valid), np.asarray(ref.valid))
    np.testing.assert_array_equal(np.asarray(got.tokens)[same_set],
                                  np.asarray(ref.tokens)[same_set])
    np.testing.assert_allclose(np.asarray(got.logprobs)[same_set],
                               np.asarray(ref.logprobs)[same_set], rtol=0,
                               atol=ulps)
  for name in ("ids", "count", "truncated", "overflow"):
    np.testing.assert_array_equal(np.asarray(getattr(out_mask, name))[same_set],
                                  np.asarray(getattr(ref_mask, name))[same_set],
                                  err_msg=name)
  for name in ("logz", "lse"):
    a, b = (np.asarray(getattr(m, name))[same_set] for m in (out_mask, ref_mask))
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
    finite = np.isfinite(a)
    np.testing.assert_allclose(a[finite], b[finite], rtol=0,
                               atol=ulps, err_msg=name)
  return out, out_mask


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("kind", ["peaked", "flat", "tied", "neg_inf"])
def test_matches_reference(kind, generator):
  r = np.random.default_rng([hash(kind) % 1000, len(generator)])
  batch, vocab = BATCH, VOCAB
  logits = jnp.asarray(_rows(kind, batch, vocab, r), jnp.float32)
  params = _mixed_params(batch, vocab, r)
  key = jax.random.key(int(r.integers(2**31)))
  _compare(logits, params, key, generator=generator)


# Both half dtypes take one branch of ``xla_search.search`` (candidates from
# the tempered row: the logits are not fp32); float16's case is ``slow``.
@pytest.mark.parametrize("dtype", [
    jnp.bfloat16, slow_case(jnp.float16, id="float16")])
def test_matches_reference_half_precision(dtype):
  r = np.random.default_rng(int(jnp.dtype(dtype).itemsize) + 7)
  batch, vocab = BATCH, VOCAB
  logits = jnp.asarray(_rows("peaked", batch, vocab, r), dtype)
  logits = logits.at[: batch // 2].set(jnp.asarray(
      _rows("flat", batch // 2, vocab, r), dtype))
  _compare(logits, _mixed_params(batch, vocab, r), jax.random.key(5))


def test_invalid_and_special_rows():
  r = np.random.default_rng(11)
  batch, vocab = BATCH, VOCAB
  x = r.standard_normal((batch, vocab)).astype(np.float32)
  x[0, 5] = np.nan
  x[1, 9] = np.inf
  x[2] = -np.inf
  x[3] = 1.0  # all equal
  x[4, :] = 0.0
  x[4, ::2] = -0.0  # -0 and +0 tie
  x[4, 600:] = -1.0
  x[5] = 3e38  # tempered overflow at T < 1
  x[8, 100] = np.copysign(np.nan, -1.0)  # a NaN the fp32 top-k ranks last
  x[15] = -1.0  # greedy: -0 and +0 tie for the max, -0 first
  x[15, 3], x[15, 9] = -0.0, 0.0
  params = SamplingParams.make(
      batch, temperature=[1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0] * 2,
      top_k=[5, 0, 3, 10, 9, 2, 100, 3] * 2, top_p=0.9, min_p=0.0)
  out, out_mask = _compare(jnp.asarray(x), params, jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(out.valid)[:8],
                                [False, False, False, True, True, False, True,
                                 True])
  np.testing.assert_array_equal(np.asarray(out_mask.ids)[4, :9],
                                np.arange(9))
  assert not out.valid[8] and out.tokens[8] == 100 and out.tokens[15] == 3


@pytest.mark.parametrize("width", [8, 1024, 4096])
def test_masks_of_each_width(width):
  """K_cap below, at and past the candidate widths (past V: every id)."""
  r = np.random.default_rng(width)
  batch, vocab = BATCH, VOCAB
  logits = jnp.asarray(_rows("peaked", batch, vocab, r), jnp.float32)
  out, out_mask = _compare(logits, _mixed_params(batch, vocab, r),
                           jax.random.key(2), width=width)
  assert out_mask.ids.shape == (batch, width)
  overflow = np.asarray(out_mask.overflow)
  assert np.any(overflow) if width == 8 else True
  assert not np.any(overflow) if width > VOCAB else True


# ---------------------------------------------------------------------------
# Fallbacks: each one taken, by rows that need it.
# ---------------------------------------------------------------------------


def _search(logits, params, key, generator="philox"):
  vocab = logits.shape[1]
  streams, _ = rng.row_streams(key, None, logits.shape[0], vocab)
  columns = jax.tree.map(lambda a: a[:, None], streams)
  noise_at = lambda ids: rng.gumbel(rng.uniform(rng.bits_at(
      generator, columns, ids)))
  return jax.jit(lambda l, p: xla_search.search(
      l, p.canonical(vocab), noise_at=noise_at))(logits, params)


def test_fallback_rows():
  """Each row's kept set is past every candidate width (so a search found
  its threshold) or, for the no-filter rows, the race needs the whole row."""
  r = np.random.default_rng(3)
  batch, vocab = BATCH, VOCAB
  logits = jnp.asarray(r.standard_normal((batch, vocab)), jnp.float32)
  params = SamplingParams.make(
      batch, top_k=[1500, 0, 0, 1800, 1100, 0] + [0] * 10,
      top_p=[1.0, 0.99, 0.95, 0.9, 1.0, 1.0] + [0.98] * 10,
      min_p=[0.0, 0.0, 0.01, 0.0, 0.05, 0.0] + [0.0] * 10)
  key = jax.random.key(4)
  out, out_mask = _compare(logits, params, key)
  counts = np.asarray(out_mask.count)
  # No top-k of at most 1024: the batch takes the narrowest candidates.
  assert np.all(counts[:5] > min(xla_search.CANDIDATE_WIDTHS)), counts
  assert counts[5] == vocab
  found = _search(logits, params, key)
  np.testing.assert_array_equal(np.asarray(found.decided), False)


def test_candidate_race_decides_peaked_rows_without_a_filter():
  """No filter on rows 1.., but no entry past the candidates can beat the
  best kept candidate by the Gumbel bound: the candidate race is the
  reference's (row 0's top-p makes the batch take the candidates)."""
  r = np.random.default_rng(5)
  batch, vocab = BATCH, VOCAB
  x = r.standard_normal((batch, vocab)) - 30.0
  x[:, :4] = [0.0, -0.5, -1.0, -2.0]
  logits = jnp.asarray(x, jnp.float32)
  params = SamplingParams.make(batch, top_p=[0.9] + [1.0] * (batch - 1))
  key = jax.random.key(6)
  found = _search(logits, params, key)
  assert np.all(np.asarray(found.decided))
  out, _ = _compare(logits, params, key)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(
      found.token))


def test_untruncated_batch_reads_rows_not_candidates():
  """No sampled row truncates (a greedy row's top-k does not count): the
  batch takes no candidates (no top-k in the program of closed-over
  params) and gives the reference's tokens and logprobs bit for bit, with
  a mask and without, peaked, NaN, -inf and greedy rows included."""
  r = np.random.default_rng(9)
  x = r.standard_normal((BATCH, VOCAB)) * 3
  x[1, :] = -np.inf
  x[2, 5] = np.nan
  x[3, :4] = [20.0, 19.5, 19.0, 18.0]
  logits = jnp.asarray(x, jnp.float32)
  params = SamplingParams.make(
      BATCH, temperature=[0.0, 1.0, 1.0, 0.7] + [1.3] * (BATCH - 4),
      top_k=[5] + [0] * (BATCH - 1))
  key = jax.random.key(10)
  for width in (0, 16):
    want, _ = _run(logits, params, key, impl="xla", generator="philox",
                   width=width)
    got, _ = _run(logits, params, key, impl="xla_search", generator="philox",
                  width=width)
    for name in ("tokens", "logprobs", "valid"):
      np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                    np.asarray(getattr(want, name)),
                                    err_msg=f"{name}, mask width {width}")
  canon = params.canonical(VOCAB)
  closed = str(jax.make_jaxpr(lambda l: xla_search.search(l, canon))(logits))
  assert "top_k" not in closed
  assert "top_k" in str(jax.make_jaxpr(xla_search.search)(logits, canon))


@pytest.mark.parametrize("generator", GENERATORS)
def test_fp64_noise_matches_reference(generator):
  r = np.random.default_rng(8)
  batch, vocab = BATCH, VOCAB
  logits = jnp.asarray(_rows("peaked", batch, vocab, r), jnp.float32)
  params = _mixed_params(batch, vocab, r)
  key = jax.random.key(9)
  outs = {}
  with jax.enable_x64(True):
    for impl in ("xla", "xla_search"):
      config = SamplerConfig(implementation=impl, rng=generator,
                             use_fp64_gumbel=True)
      outs[impl] = jax.jit(lambda l, p, k, c=config: jaxsample.sample(
          l, p, k, config=c))(logits, params, key)
  np.testing.assert_array_equal(np.asarray(outs["xla_search"].tokens),
                                np.asarray(outs["xla"].tokens))


def test_per_request_keys_and_positions():
  r = np.random.default_rng(12)
  batch, vocab = BATCH, VOCAB
  logits = jnp.asarray(_rows("peaked", batch, vocab, r), jnp.float32)
  params = _mixed_params(batch, vocab, r)
  keys = jax.random.split(jax.random.key(13), batch)
  positions = jnp.arange(batch) * 7
  run = lambda impl: jax.jit(lambda l, p, k, pos: jaxsample.sample(
      l, p, k, positions=pos, config=SamplerConfig(implementation=impl)))(
          logits, params, keys, positions)
  np.testing.assert_array_equal(np.asarray(run("xla_search").tokens),
                                np.asarray(run("xla").tokens))


# ---------------------------------------------------------------------------
# Dispatch, masks without a token, no sort, traced and concrete params.
# ---------------------------------------------------------------------------


def test_auto_off_gpu_is_the_search_path():
  on_gpu = jax.default_backend() == "gpu"
  assert backends.backend_name(SamplerConfig()) == (
      "pallas" if on_gpu else "xla_search")
  assert backends.backend_name(SamplerConfig(implementation="xla")) == "xla"


def test_extract_sampling_mask_matches_reference():
  r = np.random.default_rng(14)
  batch, vocab = BATCH, VOCAB
  logits = jnp.asarray(_rows("flat", batch, vocab, r), jnp.float32)
  params = _mixed_params(batch, vocab, r)
  masks = {impl: jax.jit(lambda l, p, c=SamplerConfig(
      implementation=impl, max_mask_ids=32): jaxsample.extract_sampling_mask(
          l, p, config=c))(logits, params) for impl in ("auto", "xla")}
  for name in ("ids", "count", "truncated", "overflow"):
    np.testing.assert_array_equal(np.asarray(getattr(masks["auto"], name)),
                                  np.asarray(getattr(masks["xla"], name)))
  np.testing.assert_allclose(np.asarray(masks["auto"].logz),
                             np.asarray(masks["xla"].logz), atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="checks XLA:CPU's TopK call in optimized HLO")
@pytest.mark.parametrize("return_mask", [False, True])
def test_no_sort_of_the_vocabulary(return_mask):
  """Neither the lowered program nor XLA's optimized one sorts (XLA:CPU
  turns a top-k whose slice it folds into a gather into a full sort).  The
  programs are ``_run``'s at the parity tests' shapes: their compiles load
  from the compilation cache."""
  logits = jnp.zeros((BATCH, VOCAB))
  params = SamplingParams.make(BATCH, top_k=20, top_p=0.9)
  lower = lambda impl: _run.lower(logits, params, jax.random.key(0), impl=impl,
                                  generator="philox",
                                  width=16 if return_mask else 0)
  lowered = lower("xla_search")
  assert sort_operands(lowered.as_text()) == []
  compiled = lowered.compile().as_text()
  assert " sort(" not in compiled and '"TopK"' in compiled
  if return_mask:  # the check can fail
    assert " sort(" in lower("xla").compile().as_text()


def test_concrete_params_pick_one_candidate_width():
  """Params a jitted function closes over pick one width's branch (a top-k
  of 200: the 256-wide candidates); traced params switch among all three."""
  params = SamplingParams.make(BATCH, top_k=[200, 3, 0, 50] * 4, top_p=0.8)
  canon = params.canonical(VOCAB)
  logits = jnp.zeros((BATCH, VOCAB))
  closed = str(jax.make_jaxpr(lambda l: xla_search.search(l, canon))(logits))
  traced = str(jax.make_jaxpr(xla_search.search)(logits, canon))
  widths = lambda text: sorted(int(w) for w in re.findall(
      r"top_k\[axis=1 is_stable=True k=(\d+)\]", text))
  assert widths(closed) == [256]
  assert widths(traced) == list(xla_search.CANDIDATE_WIDTHS)


def test_spec_rejection_sample_matches_reference():
  """Speculative verification off GPU finds its kept sets by the search."""
  r = np.random.default_rng(17)
  batch, k = BATCH // 4, 3
  target = jnp.asarray(_rows("peaked", batch * (k + 1), VOCAB, r).reshape(
      batch, k + 1, VOCAB), jnp.float32)
  draft = jnp.asarray(_rows("peaked", batch * k, VOCAB, r).reshape(
      batch, k, VOCAB), jnp.float32)
  tokens = jnp.asarray(r.integers(0, VOCAB, (batch, k)), jnp.int32)
  params = SamplingParams.make(batch, top_k=[50, 0, 1500, 0],
                               top_p=[0.9, 0.95, 1.0, 1.0],
                               min_p=[0.0, 0.0, 0.0, 0.05])
  run = lambda impl: jax.tree.map(np.asarray, jax.jit(
      lambda t, d, tok, p: jaxsample._src.spec.rejection_sample(
          t, tok, jnp.full((batch,), k), p, jax.random.key(18),
          draft_logits=d, config=SamplerConfig(implementation=impl,
                                               max_mask_ids=16),
          return_mask=True))(target, draft, tokens, params))
  got, want = run("auto"), run("xla")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if np.issubdtype(a.dtype, np.floating):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    else:
      np.testing.assert_array_equal(a, b)
