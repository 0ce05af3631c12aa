"""jaxsample._src.reference: the documented sampling semantics (reference.py docstring).

Kept sets are checked against the numpy float64 oracle (helpers/oracle.py); the
sampled distribution against the exact processed distribution by chi-square;
Gumbel-max against ``jax.random.categorical``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplingParams
from jaxsample._src import reference, rng

from helpers.cases import KINDS, oracle_grid
from helpers.oracle import oracle_keep
from helpers.sampling import make_params
from helpers.stats import (STAT_CONFIGS, STAT_DRAWS, STAT_VOCAB,
                           assert_chi2_fits, chi2_critical, chi2_statistic)


@functools.partial(jax.jit, static_argnames=("generator",))
def ref_sample(logits, params, key, positions=None, *, generator="threefry"):
  """The reference sampler on raw params (canonicalised, as ``sample`` does)."""
  batch, vocab = logits.shape
  streams, _ = rng.row_streams(key, positions, batch, vocab)
  return reference.sample_reference(logits, params.canonical(vocab), streams,
                                    generator=generator)


def to_np(result):
  return jax.tree.map(np.asarray, result)


def temper_np(x, t):
  """fp32 IEEE division x / T (step 3), in numpy."""
  return (np.asarray(x, np.float32) / np.float32(t)).astype(np.float32)


# ---------------------------------------------------------------------------
# The chi-square helper itself (textbook table values).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("df,alpha,table", [(1, 0.05, 3.841), (5, 0.01, 15.086),
                                            (10, 0.05, 18.307),
                                            (30, 0.001, 59.703),
                                            (100, 0.01, 135.807)])
def test_chi2_critical_helper(df, alpha, table):
  assert chi2_critical(df, alpha) == pytest.approx(table, rel=0.03)


def test_chi2_statistic_rejects_a_wrong_distribution():
  r = np.random.default_rng(0)
  p = np.array([0.5, 0.3, 0.2])
  tokens = r.choice(3, size=4000, p=p)
  stat, df = chi2_statistic(np.bincount(tokens, minlength=3), p)
  assert df == 2 and stat < chi2_critical(df, 1e-3)
  stat, df = chi2_statistic(np.bincount(tokens, minlength=3), [0.45, 0.35, 0.2])
  assert stat > chi2_critical(df, 1e-3)


# ---------------------------------------------------------------------------
# keep_threshold vs the numpy oracle.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [16, 1007])
def test_keep_threshold_matches_oracle(vocab):
  y, ks, ps, ms, combos = oracle_grid(vocab, seed=vocab)
  params = SamplingParams.make(len(y), top_k=ks, top_p=ps,
                               min_p=ms).canonical(vocab)
  t = np.asarray(jax.jit(reference.keep_threshold)(jnp.asarray(y), params))
  kept = (y >= t[:, None]) & (y > -np.inf)
  near = 0
  for i in range(len(y)):
    o = oracle_keep(y[i], ks[i], ps[i], ms[i])
    near += o.near_boundary
    ctx = (f"row {i} kind={KINDS[i // len(combos)]} k={ks[i]} p={ps[i]} "
           f"m={ms[i]}: reference keeps {kept[i].sum()}, oracle {o.kept.sum()}")
    assert kept[i].any(), ctx  # a valid row always keeps its max
    if o.near_boundary:
      # fp32 mass rounding may pick the adjacent top-p (or min-p) threshold.
      assert o.admits(kept[i]), ctx
    else:
      np.testing.assert_array_equal(kept[i], o.kept, err_msg=ctx)
  assert near <= 0.02 * len(y), f"{near} of {len(y)} rows near a boundary"


def test_keep_threshold_ties_at_top_k_kept():
  y = np.float32([[3, 1, 2, 2, 2, 0, -np.inf, 2]])
  for k, want in [(1, 1), (2, 5), (3, 5), (4, 5), (5, 5), (6, 6), (7, 7)]:
    params = SamplingParams.make(1, top_k=k).canonical(8)
    t = float(reference.keep_threshold(jnp.asarray(y), params)[0])
    kept = (y[0] >= t) & (y[0] > -np.inf)
    assert kept.sum() == want, (k, t)


def test_keep_threshold_top_p_crossing_token_kept():
  # probabilities 0.5, 0.25, 0.125, 0.125 (exact in fp32 and fp64).
  y = np.log(np.float32([[0.125, 0.5, 0.125, 0.25]])).astype(np.float32)
  for p, want in [(0.3, [1]), (0.5, [1]), (0.51, [1, 3]), (0.75, [1, 3]),
                  (0.76, [0, 1, 2, 3]), (0.99, [0, 1, 2, 3])]:
    params = SamplingParams.make(1, top_p=p).canonical(4)
    t = float(reference.keep_threshold(jnp.asarray(y), params)[0])
    assert np.flatnonzero(y[0] >= t).tolist() == want, p


def test_keep_threshold_top_p_renormalizes_after_top_k_and_min_p():
  # probs 0.4, 0.3, 0.2, 0.1.  top_k=2 leaves {0.4, 0.3} -> renormalised 4/7,
  # 3/7: top_p=0.5 keeps only the first; without top_k it keeps two (0.4<0.5).
  y = np.log(np.float32([[0.4, 0.3, 0.2, 0.1]])).astype(np.float32)
  cases = [(dict(top_p=0.5), 2), (dict(top_p=0.5, top_k=2), 1),
           (dict(top_p=0.6, top_k=2), 2), (dict(top_p=0.5, min_p=0.7), 1),
           (dict(top_p=0.6, min_p=0.7), 2), (dict(min_p=0.55), 2),
           (dict(min_p=0.24), 4), (dict(min_p=0.26), 3)]
  for kw, want in cases:
    params = SamplingParams.make(1, **kw).canonical(4)
    t = float(reference.keep_threshold(jnp.asarray(y), params)[0])
    assert int((y[0] >= t).sum()) == want, kw


@pytest.mark.parametrize("field,value", [("top_p", 0.0), ("top_p", -3.0),
                                         ("min_p", 1.0), ("min_p", 1.5),
                                         ("min_p", math.inf), ("top_k", 1)])
def test_out_of_range_keeps_only_the_top_tie_group(field, value):
  """top_p <= 0 and min_p >= 1 keep the most probable tie group (params doc)."""
  y = np.float32([[0.5, 2.0, -np.inf, 2.0, 1.9999, 2.0, -4.0]])
  params = make_params(1, **{field: value}).canonical(7)
  t = float(reference.keep_threshold(jnp.asarray(y), params)[0])
  kept = (y[0] >= t) & (y[0] > -np.inf)
  np.testing.assert_array_equal(kept, y[0] == 2.0)


@pytest.mark.parametrize("width", [1, 7, 64, 300])
def test_top_ids_is_a_stable_descending_order(width):
  """``top_ids`` equals a stable argsort of -y cut to ``width``: ties (also at
  the cut, also -0.0 vs +0.0 and -inf) in vocab order."""
  r = np.random.default_rng(width)
  y = np.round(r.standard_normal((5, 300)) * 2).astype(np.float32)  # many ties
  y[1, ::3] = -np.inf
  y[2, :] = -np.inf
  y[2, 17] = 1.0
  y[3, ::2] = 0.0
  y[3, 1::2] = -0.0
  y[4] = r.standard_normal(300).astype(np.float32)
  ys = -np.sort(-y, axis=-1)
  want = np.argsort(-(y + np.float32(0.0)), axis=-1, kind="stable")[:, :width]
  top_ids = jax.jit(reference.top_ids, static_argnums=2)
  for rows in (slice(None), slice(4, 5)):  # ties past the cut; none
    got = np.asarray(top_ids(jnp.asarray(y[rows]),
                             jnp.asarray(ys[rows, width - 1]), width))
    np.testing.assert_array_equal(got, want[rows])


def test_temper_is_xla_division_and_leaves_greedy_rows():
  """Step 2: y = x / T by the platform's XLA fp32 division (correctly rounded
  on GPU: test_race_kernel.py's GPU division test checks that); greedy rows
  (T = 0) keep y = x."""
  r = np.random.default_rng(12)
  x = (r.standard_normal((6, 4096)) * 10).astype(np.float32)
  x[0, :5] = [np.inf, -np.inf, 0.0, -0.0, 3e38]
  temps = np.float32([0.7, 0.3, 1.9, 3.3, 0.0, 1e-3])
  got = np.asarray(reference.temper(jnp.asarray(x), jnp.asarray(temps)))
  divide = jax.jit(lambda a, t: a / t)
  sampled = temps > 0
  want = np.asarray(divide(jnp.asarray(x[sampled]),
                           jnp.asarray(temps[sampled])[:, None]))
  np.testing.assert_array_equal(got[sampled], want)
  np.testing.assert_array_equal(got[~sampled], x[~sampled])
  assert got[0, 4] == np.inf  # 3e38 / 0.7 overflows: an invalid row


# ---------------------------------------------------------------------------
# Gumbel-max parity with jax.random.categorical.
# ---------------------------------------------------------------------------


def test_threefry_one_key_matches_jax_random_categorical():
  batch, vocab = 64, 1007
  r = np.random.default_rng(3)
  x = jnp.asarray(r.standard_normal((batch, vocab)) * 2, jnp.float32)
  temps = jnp.asarray(r.uniform(0.3, 3.0, batch), jnp.float32)
  params = SamplingParams(temps, jnp.zeros(batch, jnp.int32),
                          jnp.ones(batch, jnp.float32), jnp.zeros(batch, jnp.float32))
  key = jax.random.key(17)
  got = to_np(ref_sample(x, params, key))
  want = np.asarray(jax.random.categorical(key, x / temps[:, None]))
  np.testing.assert_array_equal(got.tokens, want)
  assert np.mean(want == np.argmax(np.asarray(x), -1)) < 0.5  # noise matters
  lp = np.asarray(jax.nn.log_softmax(x / temps[:, None]))
  np.testing.assert_allclose(got.logprobs, lp[np.arange(batch), want],
                             rtol=1e-5, atol=1e-5)
  assert got.valid.all()


def test_threefry_per_request_keys_position0_match_categorical():
  batch, vocab = 6, 1007
  r = np.random.default_rng(4)
  x = jnp.asarray(r.standard_normal((batch, vocab)), jnp.float32)
  keys = jax.random.split(jax.random.key(5), batch)
  params = SamplingParams.make(batch, temperature=0.8)
  got = to_np(ref_sample(x, params, keys, jnp.zeros(batch, jnp.int32)))
  for b in range(batch):
    assert got.tokens[b] == int(jax.random.categorical(keys[b], x[b] / 0.8))


# ---------------------------------------------------------------------------
# Statistics: sampled frequencies vs the exact processed distribution.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stat_logits():
  return (np.random.default_rng(42).standard_normal(STAT_VOCAB) * 1.2).astype(
      np.float32)


@pytest.fixture(scope="module", params=["philox", "threefry"])
def stat_samples(request, stat_logits):
  """One batch: STAT_DRAWS rows per config, one batch key (independent rows)."""
  names = list(STAT_CONFIGS)
  cols = {f: [] for f in ("temperature", "top_k", "top_p", "min_p")}
  for name in names:
    cfg = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    cfg.update(STAT_CONFIGS[name])
    for f in cols:
      cols[f] += [cfg[f]] * STAT_DRAWS
  batch = len(names) * STAT_DRAWS
  params = SamplingParams.make(batch, **cols)
  logits = jnp.broadcast_to(jnp.asarray(stat_logits), (batch, STAT_VOCAB))
  out = to_np(ref_sample(logits, params, jax.random.key(1234),
                         generator=request.param))
  return {name: jax.tree.map(lambda a: a[i * STAT_DRAWS:(i + 1) * STAT_DRAWS], out)
          for i, name in enumerate(names)}


@pytest.mark.parametrize("name", list(STAT_CONFIGS))
def test_sampled_frequencies_match_processed_distribution(name, stat_logits,
                                                          stat_samples):
  cfg = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
  cfg.update(STAT_CONFIGS[name])
  y = temper_np(stat_logits, cfg["temperature"])
  o = oracle_keep(y, cfg["top_k"], cfg["top_p"], cfg["min_p"])
  assert not o.near_boundary  # the expected distribution is unambiguous
  probs = o.probs(y)
  out = stat_samples[name]
  assert out.valid.all()
  assert o.kept[out.tokens].all(), "sampled outside the kept set"
  assert_chi2_fits(out.tokens, probs)
  # logprob of the sampled token = log of its processed probability.
  np.testing.assert_allclose(out.logprobs, np.log(probs[out.tokens]), rtol=0,
                             atol=2e-5)


def test_random_rows_and_params_sample_in_kept_set_with_exact_logprob():
  batch, vocab = 600, 1007
  r = np.random.default_rng(7)
  x = (r.standard_normal((batch, vocab)) * r.uniform(0.5, 4, (batch, 1))).astype(
      np.float32)
  x[r.random((batch, vocab)) < 0.05] = -np.inf
  temps = r.choice([0.3, 0.7, 1.0, 1.7], batch)
  ks = r.choice([0, 1, 3, 40, vocab - 1, vocab, vocab + 3], batch)
  ps = r.choice([1.0, 0.99, 0.9, 0.5, 0.1], batch)
  ms = r.choice([0.0, 0.0, 0.01, 0.2], batch)
  params = SamplingParams.make(batch, temperature=temps, top_k=ks, top_p=ps,
                               min_p=ms)
  out = to_np(ref_sample(jnp.asarray(x), params, jax.random.key(0)))
  assert out.valid.all()
  near = 0
  for b in range(batch):
    y = temper_np(x[b], temps[b])
    o = oracle_keep(y, ks[b], ps[b], ms[b])
    near += o.near_boundary
    ok = []
    for kept in o.admissible:
      probs = oracle_probs(y, kept)
      ok.append(kept[out.tokens[b]] and
                abs(out.logprobs[b] - math.log(probs[out.tokens[b]])) <= 2e-5 * (
                    1 + abs(out.logprobs[b])))
    assert ok[0] or (o.near_boundary and any(ok)), (
        b, out.tokens[b], out.logprobs[b], o.kept.sum())
  assert near <= 0.02 * batch


def oracle_probs(y, kept):
  z = np.where(kept, np.asarray(y, np.float64), -np.inf)
  z = np.exp(z - z.max())
  return z / z.sum()


# ---------------------------------------------------------------------------
# Greedy and invalid rows.
# ---------------------------------------------------------------------------


def test_greedy_rows_take_first_argmax_with_logprob_zero():
  vocab = 64
  r = np.random.default_rng(8)
  x = r.standard_normal((12, vocab)).astype(np.float32)
  x[0, [5, 9, 40]] = 10.0  # ties at the max: smallest index wins
  x[1, :] = 0.0  # all equal: token 0
  x[2, :3] = -np.inf
  x[2, [3, 63]] = 7.0
  x[3, :] = -np.inf
  x[3, 62:] = [-1.0, -1.0]  # only ties among -inf: token 62
  x[4, 63] = 100.0
  temps = np.zeros(12)
  temps[6:] = [1.0, 0.5, 1.0, 2.0, 0.7, 1.0]  # mixed with sampled rows
  params = SamplingParams.make(12, temperature=temps,
                               top_k=[0, 1, 2, 0, 5, 0] * 2,
                               top_p=[1.0, 0.5, 1.0, 0.2, 1.0, 1.0] * 2,
                               min_p=[0.0, 0.0, 0.3, 0.0, 0.0, 1.0] * 2)
  out = to_np(ref_sample(jnp.asarray(x), params, jax.random.key(0)))
  np.testing.assert_array_equal(out.tokens[:6], [5, 0, 3, 62, 63, int(np.argmax(x[5]))])
  np.testing.assert_array_equal(out.logprobs[:6], 0.0)
  assert out.valid.all()
  assert np.all(out.logprobs[6:] <= 0) and np.all(np.isfinite(out.logprobs[6:]))


@pytest.mark.parametrize("temperature,filters", [
    (1.0, {}), (0.0, {}), (0.5, dict(top_k=3, top_p=0.5, min_p=0.1))])
def test_invalid_rows(temperature, filters):
  vocab = 40
  rows, want = [], []

  def row(*sets, fill=None):
    x = (np.random.default_rng(len(rows)).standard_normal(vocab)
         if fill is None else np.full(vocab, fill))
    for idx, v in sets:
      x[idx] = v
    rows.append(x)

  row((5, np.nan)); want.append(5)
  row((9, np.nan), (3, np.inf)); want.append(3)
  row((9, np.nan), (12, np.inf)); want.append(9)
  row(fill=-np.inf); want.append(0)
  row((0, np.nan), fill=-np.inf); want.append(0)
  row((vocab - 1, np.inf)); want.append(vocab - 1)
  row((2, np.inf), (7, np.inf), fill=-np.inf); want.append(2)
  row((slice(None), np.nan)); want.append(0)
  row((20, -np.inf), (30, np.nan), fill=1.0); want.append(30)
  row(); want.append(None)  # a valid row in the same batch
  x = np.asarray(rows, np.float32)
  params = SamplingParams.make(len(rows), temperature=temperature, **filters)
  out = to_np(ref_sample(jnp.asarray(x), params, jax.random.key(1)))
  np.testing.assert_array_equal(out.valid, [w is None for w in want])
  np.testing.assert_array_equal(out.tokens[:-1], want[:-1])
  assert np.all(out.logprobs[:-1] == -np.inf)
  assert np.isfinite(out.logprobs[-1]) and 0 <= out.tokens[-1] < vocab


# ---------------------------------------------------------------------------
# Input dtypes.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("generator", ["philox", "threefry"])
def test_low_precision_logits_equal_their_fp32_upcast(dtype, generator):
  batch, vocab = 8, 1007
  r = np.random.default_rng(9)
  x = jnp.asarray(r.standard_normal((batch, vocab)) * 3, jnp.float32).astype(dtype)
  x = x.at[1, :50].set(-jnp.inf)
  params = SamplingParams.make(batch, temperature=[1.0, 0.0, 0.7, 1.3] * 2,
                               top_k=[0, 0, 20, 0, 0, 5, 0, 0],
                               top_p=[1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 0.5],
                               min_p=[0.0] * 6 + [0.1, 0.0])
  key = jax.random.key(3)
  low = to_np(ref_sample(x, params, key, generator=generator))
  high = to_np(ref_sample(x.astype(jnp.float32), params, key,
                          generator=generator))
  np.testing.assert_array_equal(low.tokens, high.tokens)
  np.testing.assert_array_equal(low.logprobs, high.logprobs)
  assert low.valid.all() and low.logprobs.dtype == np.float32
