"""Public API ``jaxsample.sample`` on both backends (``implementation="xla"`` and
``"pallas"``; on CPU the Pallas kernel runs in interpret mode).

The Gumbel kernel's parity tests here use untruncated params (top_k=0,
top_p=1, min_p=0); truncated batches are tested here through the public
API and kernel by kernel in ``test_threshold.py`` and
``test_truncated_sampling.py``.

Most tests reuse the shape (5, 4096) so that jit compilations are shared.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from conftest import (GENERATORS, GENERATORS_SLOW_THREEFRY, IMPLEMENTATIONS,
                      IMPLEMENTATIONS_BY_GENERATOR, assert_chi2_fits,
                      make_params, on_gpu, oracle_keep, outside_conds,
                      run_sample, slow_case)
from jaxsample import SamplerConfig, SamplingParams
from jaxsample.pallas.tuning import RaceLaunch, Tuning

B, V = 5, 4096  # the shared workhorse shape


def race(**launch) -> Tuning:
  """A tuning override of the Gumbel race's launch (``tuning.RaceLaunch``)."""
  return Tuning(gumbel=RaceLaunch(**launch))


def random_logits(seed, batch, vocab, scale=2.0, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  return jnp.asarray(r.standard_normal((batch, vocab)) * scale,
                     jnp.float32).astype(dtype)


def random_temps(seed, batch, lo=0.4, hi=1.8):
  return np.random.default_rng(seed + 1000).uniform(lo, hi, batch).astype(np.float32)


def assert_same_result(a, b):
  """Tokens and validity bit-identical, logprobs within 1e-5."""
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.valid, b.valid)
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


def assert_result_types(out, batch, vocab):
  assert out.tokens.shape == (batch,) and out.tokens.dtype == np.int32
  assert out.logprobs.shape == (batch,) and out.logprobs.dtype == np.float32
  assert out.valid.shape == (batch,) and out.valid.dtype == np.bool_
  assert np.all((out.tokens >= 0) & (out.tokens < vocab))


def parity(x, params, key, gen, positions=None, **kw):
  """Runs both backends, checks parity, returns the pallas result."""
  a = run_sample(x, params, key, positions=positions, impl="pallas", rng=gen, **kw)
  b = run_sample(x, params, key, positions=positions, impl="xla", rng=gen, **kw)
  assert_result_types(a, *x.shape)
  assert_same_result(a, b)
  return a


# ---------------------------------------------------------------------------
# Kernel vs reference parity (untruncated params: the kernel runs).
# ---------------------------------------------------------------------------


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}


def parity_cases():
  """``(shape, dtype, generator, fp64)``: fp32 at five shapes in interpret
  mode (every backend; threefry's beyond V = 4096 ``slow``); on a GPU
  every production shape x dtype x generator x noise precision."""
  def name(shape, dtype, gen, fp64):
    return f"{shape[0]}x{shape[1]}-{dtype}-{gen}-{'fp64' if fp64 else 'fp32'}"
  cases = [(pytest.param if gen == "philox" or shape[1] <= V else slow_case)(
               shape, "float32", gen, False,
               id=name(shape, "float32", gen, False))
           for shape in [(1, 1007), (B, V), (3, 32000), (2, 151936),
                         (513, 1007)] for gen in GENERATORS]
  cases += [on_gpu(shape, dtype, gen, fp64, id=name(shape, dtype, gen, fp64))
            for shape in [(1, 151936), (8, 151936), (128, 151936), (4, 32000),
                          (2, 1007)]
            for dtype in DTYPES for gen in GENERATORS for fp64 in (False, True)]
  cases += [on_gpu((513, 1007), dtype, gen, fp64,
                   id=name((513, 1007), dtype, gen, fp64))
            for dtype in DTYPES for gen in GENERATORS for fp64 in (False, True)
            if (dtype, fp64) != ("float32", False)]
  return cases


@pytest.mark.kernels
@pytest.mark.parametrize("shape,dtype,gen,fp64", parity_cases())
def test_pallas_matches_xla(shape, dtype, gen, fp64):
  """Untruncated rows (the Gumbel kernel), every third one greedy and a -inf
  prefix in row 0: tokens and validity equal the reference's bit for bit,
  logprobs within 1e-5; greedy rows take the argmax with logprob 0, and the
  noise matters (not every sampled row takes its argmax)."""
  batch, vocab = shape
  seed = batch * 7 + vocab
  x = random_logits(seed, batch, vocab, scale=3.0)
  x = x.at[0, :7].set(-jnp.inf).astype(DTYPES[dtype])
  temps = random_temps(seed, batch)
  temps[1::3] = 0.0
  params = SamplingParams.make(batch, temperature=temps)
  out = parity(x, params, jax.random.key(seed), gen, fp64=fp64)
  assert out.valid.all()
  greedy = temps == 0
  xf = np.asarray(x.astype(jnp.float32))
  np.testing.assert_array_equal(out.tokens[greedy], np.argmax(xf[greedy], -1))
  np.testing.assert_array_equal(out.logprobs[greedy], 0.0)
  if (~greedy).sum() > 1:
    assert not np.array_equal(out.tokens[~greedy], np.argmax(xf[~greedy], -1))


def test_static_and_traced_params_agree():
  """The kernel path with params the jit closes over (``rowwise.cond`` takes
  the Gumbel branch alone; most kernel tests here run that way,
  ``conftest.closing_over``) equals the path with traced params (a
  ``lax.cond`` on the device), and a truncating batch with traced params
  still takes its branch."""
  x = random_logits(41, B, V)
  params = SamplingParams.make(B, temperature=random_temps(41, B))
  key = jax.random.key(41)
  closed = run_sample(x, params, key, impl="pallas")
  assert_same_result(closed, run_sample(x, params, key, impl="pallas",
                                        traced_params=True))
  truncating = SamplingParams.make(B, temperature=1.0, top_k=[0, 3, 0, 0, 0])
  assert_same_result(
      run_sample(x, truncating, key, impl="pallas", traced_params=True),
      run_sample(x, truncating, key, impl="xla"))


@pytest.mark.parametrize("return_mask,fp64", [(False, False), (True, False),
                                              (False, True)])
def test_traced_params_send_one_predicate_to_the_host(return_mask, fp64):
  """With traced params the kernel path sends one cond's predicate to the
  host per call (a round trip on a GPU), with or without a mask or FP64
  noise: fp32 noise runs every route's kernels outside any cond (rows skip
  the routes they do not take) except the large-set route, whose branch
  holds no cond of its own but the mask listing's fallback."""
  x = random_logits(43, B, V)
  params = SamplingParams.make(B, temperature=1.0, top_k=[0, 3, 0, 0, 0])
  config = SamplerConfig(implementation="pallas", use_fp64_gumbel=fp64)
  with jax.enable_x64(fp64):
    jaxpr = jax.make_jaxpr(lambda x, params: jaxsample.sample(
        x, params, jax.random.key(0), config=config,
        return_mask=return_mask))(x, params)
  found = outside_conds(jaxpr.jaxpr)
  assert found["cond"] == 1
  assert found["nested"] == int(return_mask)
  if fp64:  # the batch cond: the kept sets, or the Gumbel kernel alone
    return
  for kernel in ("jaxsample_row_stats", "jaxsample_collect_candidates",
                 "jaxsample_select_threshold", "jaxsample_gumbel_max"):
    assert found.get(kernel), kernel


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
@pytest.mark.parametrize("offset,scale,temperature", [
    (0.0, 1.0, 0.05), (1000.0, 2.0, 1.0), (-3000.0, 2.0, 1.0),
    (4100.0, 1.0, 1.0), (-5000.0, 3.0, 1.0), (20.0, 3.0, 0.01), (0.0, 0.01, 1.0)])
def test_pallas_matches_xla_extreme_magnitudes(gen, offset, scale, temperature):
  """Large / small tempered logits and near-ties between leaders."""
  r = np.random.default_rng(int(abs(offset)) + 3)
  x = (r.standard_normal((B, V)) * scale + offset).astype(np.float32)
  for b in range(B):  # a few near-tied leaders spread over the row
    lead = r.choice(V, size=4, replace=False)
    x[b, lead] = x[b].max() + np.float32([0.0, 0.001, 0.002, 0.5]) * scale
  params = SamplingParams.make(B, temperature=temperature)
  key = jax.random.key(int(offset) + 7)
  a = run_sample(jnp.asarray(x), params, key, impl="pallas", rng=gen)
  b = run_sample(jnp.asarray(x), params, key, impl="xla", rng=gen)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.valid, b.valid)
  # logprob = y_token - logsumexp(y) cancels at large |y|: allow a few ulps of
  # the tempered logits on top of 1e-5.
  y_abs = float(np.max(np.abs(x))) / temperature
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0,
                             atol=1e-5 + 8 * float(np.spacing(np.float32(y_abs))))


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
@pytest.mark.parametrize("overrides", [dict(block_size=16, num_splits=7),
                                       dict(block_size=128, num_splits=1),
                                       dict(num_splits=2, num_warps=4, num_stages=2),
                                       dict(num_warps=1), dict(num_warps=2,
                                                               num_splits=1)])
def test_kernel_plan_overrides_keep_parity(gen, overrides):
  """Any plan, 1-warp programs walking Philox tiles in lane groups included:
  the reference's result (a greedy row of ties takes its smallest id)."""
  x = random_logits(99, B, V)
  # 1-warp programs visit 517 before 133 (one lane, two lane groups).
  x = x.at[1].set(jnp.full((V,), -1.0).at[jnp.array([133, 517, 4000])].set(3.0))
  temps = random_temps(99, B)
  temps[1] = 0.0
  params = SamplingParams.make(B, temperature=temps)
  key = jax.random.key(99)
  a = run_sample(x, params, key, impl="pallas", rng=gen,
                 tuning=race(**overrides))
  b = run_sample(x, params, key, impl="xla", rng=gen)
  assert_same_result(a, b)


# ---------------------------------------------------------------------------
# The kernel's opt-in tile skip (no random bits for tiles that cannot win).
# ---------------------------------------------------------------------------

SKIP_B, SKIP_V = 6, 16384  # 8 philox tiles (16 threefry tiles) per row


def llm_like_rows(seed, batch=SKIP_B, vocab=SKIP_V):
  """Rows whose bulk lies far below a few head tokens (the skip path), and
  rows of the kinds every kernel change must keep: ties, -inf, greedy."""
  r = np.random.default_rng(seed)
  x = (r.standard_normal((batch, vocab)) * 2).astype(np.float32)
  heads = r.choice(vocab, size=(batch, 4), replace=False)
  for b in range(batch):
    x[b, heads[b]] = r.uniform(15, 25, 4)
  x[1, heads[1, :2]] = 24.0  # two tied heads (far apart in the row)
  x[1, heads[1, 2:]] = -np.inf
  x[2, : vocab // 2] = -np.inf  # a whole -inf half (skipped tiles of -inf)
  x[2, vocab - 3] = 30.0
  x[[0, 3], 5] = 40.0  # a head in the first tile: every later tile skips
  # Bulk right at the skip boundary: head race ~ 30 + g, bulk 16 below it.
  x[4] = np.float32(14.0) + (r.standard_normal(vocab) * 1e-3).astype(np.float32)
  x[4, heads[4, 0]] = 30.0
  temps = np.float32([0.7, 1.0, 0.9, 0.0, 1.0, 1.3])[:batch]  # row 3 greedy
  return jnp.asarray(x), SamplingParams.make(batch, temperature=temps)


def run_partials(x, params, key, config, skip=True):
  """Kernel partials (with the raced-tile counts), tile skip on (opt-in)."""
  from jaxsample.pallas import gumbel
  streams, _ = jaxsample.rng.row_streams(key, None, *x.shape)
  with gumbel.options(tile_skip=skip):
    # A fresh jit: the flags are read while tracing.
    fn = jax.jit(lambda x: gumbel.gumbel_partials(
        x, params.canonical(x.shape[1]).temperature, streams, config))
    return jax.tree.map(np.asarray, fn(x))


def test_kernel_counts_finite_entries():
  """``count_finite``: each row's entries ``> -inf`` (NaN and -inf not
  counted), on sampled and greedy rows, summed over vocab splits."""
  from jaxsample.pallas import gumbel
  x = np.array(random_logits(47, 4, 6001))
  x[0, ::5] = -np.inf
  x[1, 3], x[1, 10:20] = np.nan, -np.inf
  x[2] = -np.inf
  x[3, 500:] = -np.inf  # a greedy row
  temperature = jnp.asarray([1.0, 0.7, 1.0, 0.0])
  streams, _ = jaxsample.rng.row_streams(jax.random.key(47), None, *x.shape)
  config = SamplerConfig(implementation="pallas", tuning=race(num_splits=3))
  partials = jax.jit(lambda x: gumbel.gumbel_partials(
      x, temperature, streams, config, count_finite=True))(jnp.asarray(x))
  assert partials.kept.shape == (4, 3)  # three splits
  np.testing.assert_array_equal(np.sum(partials.kept, axis=-1),
                                (x > -np.inf).sum(-1))


@pytest.mark.parametrize("skip", [False, True])
def test_kernel_excludes_one_id(skip):
  """``exclude``: a sampled row's partials are those of the row with that id
  set to -inf (race, token and sum-exp), the winner excluded included;
  greedy rows and -1 ignore it."""
  from jaxsample.pallas import gumbel
  x, params = llm_like_rows(53)
  x = np.array(x)
  temperature = params.canonical(x.shape[1]).temperature
  streams, _ = jaxsample.rng.row_streams(jax.random.key(53), None, *x.shape)
  config = SamplerConfig(implementation="pallas", tuning=race(num_splits=3))
  run = lambda x, exclude: jax.tree.map(np.asarray, jax.jit(
      lambda x: gumbel.combine_partials(gumbel.gumbel_partials(
          x, temperature, streams, config, exclude=exclude)))(jnp.asarray(x)))
  with gumbel.options(tile_skip=skip):
    token, *_ = run(x, None)
    exclude = token.copy()
    exclude[3] = 7  # the greedy row: ignored
    exclude[5] = -1
    got = run(x, jnp.asarray(exclude, jnp.int32))
    sampled = np.arange(len(x)) != 3
    removed = x.copy()
    rows = np.flatnonzero((exclude >= 0) & sampled)
    removed[rows, exclude[rows]] = -np.inf
    want = run(removed, None)
  assert not np.array_equal(got[0][sampled], token[sampled])
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)


def run_sample_skip(x, params, key, *, fp64=False, **config_kw):
  """``sample`` through the kernel with the tile skip on (opt-in)."""
  from jaxsample.pallas import gumbel
  config = SamplerConfig(implementation="pallas", use_fp64_gumbel=fp64,
                         **config_kw)
  with gumbel.options(tile_skip=True):
    fn = jax.jit(lambda x: jaxsample.sample(x, params, key, config=config))
    with jax.enable_x64(fp64):
      return jax.tree.map(np.asarray, fn(x))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_tile_skip_keeps_tokens(gen, num_splits):
  """Rows where most tiles are skipped draw the reference's tokens bit for
  bit."""
  x, params = llm_like_rows(31 + num_splits)
  key = jax.random.key(31)
  a = run_sample_skip(x, params, key, rng=gen, tuning=race(num_splits=num_splits))
  b = run_sample(x, params, key, impl="xla", rng=gen)
  assert_same_result(a, b)
  assert a.valid.all()
  assert a.tokens[0] == 5 and a.tokens[3] == 5 and a.logprobs[3] == 0.0
  config = SamplerConfig(implementation="pallas", rng=gen,
                         tuning=race(num_splits=num_splits))
  p = run_partials(x, params, key, config)
  tile = 2048 if gen == "philox" else 1024
  n_tiles = SKIP_V // tile
  raced = p.raced_tiles.sum(axis=1)
  assert raced[3] == 0  # greedy: no noise at all
  # Row 0: the head in tile 0 makes every later tile of its program skip;
  # programs of other splits skip only tiles after their own first race.
  assert 1 <= raced[0] < n_tiles, raced
  if num_splits == 1:
    assert raced[0] == 1, raced
  sampled = np.asarray(params.temperature) > 0
  assert np.all(raced[sampled] >= 1) and np.all(raced <= n_tiles), raced


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_tile_skip_never_on_flat_rows(gen):
  """randn rows: every tile may hold the winner, so none is skipped (the
  worst case; also shows the counts are real)."""
  x = random_logits(32, 3, SKIP_V, scale=2.0)
  params = SamplingParams.make(3, temperature=0.7)
  key = jax.random.key(32)
  config = SamplerConfig(implementation="pallas", rng=gen, tuning=race(num_splits=1))
  tile = 2048 if gen == "philox" else 1024
  for skip in (True, False):  # counted by the kernel / all tiles (default)
    p = run_partials(x, params, key, config, skip=skip)
    np.testing.assert_array_equal(p.raced_tiles.sum(axis=1), SKIP_V // tile)
  a = run_sample_skip(x, params, key, rng=gen, tuning=race(num_splits=1))
  assert_same_result(a, run_sample(x, params, key, impl="xla", rng=gen))


def _exact_race_tie(gen, key, vocab, a, b, level=30.0):
  """Logits where ids ``a < b`` tie exactly for the best fp32 race (T = 1)."""
  streams, _ = jaxsample.rng.row_streams(key, None, 1, vocab)
  g = np.asarray(jaxsample.rng.gumbel_noise(gen, streams, vocab))[0]
  x = np.full(vocab, -np.inf, np.float32)
  race = lambda v, i: np.float32(np.float32(v) + g[i])
  xa = np.float32(level) - g[a]
  target = race(xa, a)
  xb = np.float32(target - g[b])
  for _ in range(64):  # walk xb until its race equals target exactly
    rb = race(xb, b)
    if rb == target:
      break
    xb = np.nextafter(xb, np.float32(np.inf if rb < target else -np.inf),
                      dtype=np.float32)
  assert race(xb, b) == target
  x[a], x[b] = xa, xb
  # A bulk far below (skipped once a bound exists) and a few runners-up.
  r = np.random.default_rng(a + b)
  bulk = np.arange(vocab) % 3 == 0
  x[bulk] = (r.standard_normal(bulk.sum()) * 2).astype(np.float32)
  x[a], x[b] = xa, xb
  return x


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_exact_race_tie_takes_smallest_id(gen):
  """Two ids with bit-equal race values in different splits: the smaller id
  wins (the reference's argmax; an element equal to the bound is never
  skipped).  (133, 517) share a lane of 1-warp programs, which visit 517
  first (lane groups of 128 ids: ``common.KernelPlan``)."""
  key = jax.random.key(33)
  for a, b in [(100, SKIP_V - 50), (SKIP_V // 2 + 7, SKIP_V - 1), (133, 517)]:
    x = _exact_race_tie(gen, key, SKIP_V, a, b)
    xs = jnp.asarray(x[None])
    params = SamplingParams.make(1, temperature=1.0)
    ref = run_sample(xs, params, key, impl="xla", rng=gen)
    assert ref.tokens[0] == a
    for splits, warps in [(1, None), (2, None), (4, None), (1, 1)]:
      got = run_sample_skip(xs, params, key, rng=gen,
                            tuning=race(num_splits=splits, num_warps=warps))
      assert got.tokens[0] == a, (splits, warps, got.tokens)
      np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_tile_skip_fp64(gen):
  x, params = llm_like_rows(34)
  key = jax.random.key(34)
  a = run_sample_skip(x, params, key, fp64=True, rng=gen,
                      tuning=race(num_splits=2))
  b = run_sample(x, params, key, impl="xla", rng=gen, fp64=True)
  assert_same_result(a, b)


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_tile_skip_with_invalid_rows(gen):
  """Invalid rows (NaN, +inf, all -inf) keep their documented tokens next to
  rows that skip most tiles."""
  x, params = llm_like_rows(35)
  x = np.array(x)
  x[0, 700] = np.nan
  x[2, :] = -np.inf
  x[5, 9000] = np.inf
  key = jax.random.key(35)
  a = run_sample_skip(jnp.asarray(x), params, key, rng=gen,
                      tuning=race(num_splits=3))
  b = run_sample(jnp.asarray(x), params, key, impl="xla", rng=gen)
  assert_same_result(a, b)
  np.testing.assert_array_equal(a.valid, [False, True, False, True, True, False])
  np.testing.assert_array_equal(a.tokens[[0, 2, 5]], [700, 0, 9000])


def test_gumbel_noise_bound():
  """G_MAX bounds every Gumbel value the generators can produce."""
  from jaxsample.pallas import gumbel
  top32 = jaxsample.rng.uniform(jnp.uint32(0xFFFFFFFF))
  assert float(top32) == 1 - 2.0**-23 == 1 - gumbel.MIN_ONE_MINUS_U[False]
  assert float(jaxsample.rng.gumbel(top32)) <= gumbel.G_MAX[False]
  np.testing.assert_allclose(gumbel.G_MAX[False], 23 * math.log(2))
  np.testing.assert_allclose(gumbel.G_MAX[True], 52 * math.log(2))
  with jax.enable_x64(True):
    top64 = jaxsample.rng.uniform((jnp.uint32(0xFFFFFFFF), jnp.uint32(0xFFFFFFFF)))
    assert float(top64) == 1 - gumbel.MIN_ONE_MINUS_U[True]
    assert float(jaxsample.rng.gumbel(top64)) <= gumbel.G_MAX[True]


# ---------------------------------------------------------------------------
# Row kinds.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_mixed_greedy_and_sampled_rows(gen):
  x = np.array(random_logits(5, B, V, scale=1.0))
  x[0, [100, 7, 4000]] = 9.0  # ties at the max of a greedy row
  x[2, :] = 0.5  # all-equal greedy row: token 0
  x[4, :10] = -np.inf
  temps = np.float32([0.0, 1.0, 0.0, 0.7, 0.0])
  params = SamplingParams.make(B, temperature=temps)
  out = parity(jnp.asarray(x), params, jax.random.key(5), gen)
  np.testing.assert_array_equal(out.tokens[[0, 2, 4]],
                                [7, 0, int(np.argmax(x[4]))])
  np.testing.assert_array_equal(out.logprobs[[0, 2, 4]], 0.0)
  assert np.all(out.logprobs[[1, 3]] < 0)
  assert out.valid.all()


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_rows_with_neg_inf_entries(gen):
  r = np.random.default_rng(6)
  x = r.standard_normal((B, V)).astype(np.float32)
  x[0, r.random(V) < 0.3] = -np.inf
  x[1, r.random(V) < 0.99] = -np.inf
  x[2, :] = -np.inf
  x[2, 1234] = -50.0  # a single finite entry
  x[3, :-1] = -np.inf  # only the last id is finite
  x[4, ::2] = -np.inf
  params = SamplingParams.make(B, temperature=[1.0, 2.0, 0.5, 1.0, 0.9])
  out = parity(jnp.asarray(x), params, jax.random.key(6), gen)
  assert out.valid.all()
  assert np.all(np.isfinite(x[np.arange(B), out.tokens]))
  assert out.tokens[2] == 1234 and out.tokens[3] == V - 1
  np.testing.assert_allclose(out.logprobs[[2, 3]], 0.0, atol=1e-6)


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_all_equal_rows(gen):
  values = np.float32([0.0, -3.5, 100.0, -60.0, 7.0])
  x = jnp.asarray(np.repeat(values[:, None], V, axis=1))
  params = SamplingParams.make(B, temperature=[1.0, 0.3, 2.0, 1.0, 1.0])
  out = parity(x, params, jax.random.key(8), gen)
  # Uniform over V tokens: logprob -log(V).
  np.testing.assert_allclose(out.logprobs, -math.log(V), rtol=0, atol=1e-5)
  assert len(set(out.tokens.tolist())) > 1  # ties are broken by the noise


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_logprob_precision_at_low_temperature(impl):
  """logprob = y_token - logsumexp_K(y) must not lose precision to fp32
  cancellation when the tempered logits are large (low temperature or large
  logits): here T = 1e-3 on logits ~ 20, and an all-equal row of -1e30 whose
  exact logprob is -log(V)."""
  r = np.random.default_rng(25)
  x = (r.standard_normal((B, V)) * 3 + 20).astype(np.float32)
  for b in range(3):  # near-ties at the top so the noise picks either token
    top = np.argsort(-x[b])[:2]
    x[b, top[1]] = x[b, top[0]] - 0.0005 * (b + 1)
  x[3, :] = -1e30
  temps = np.float32([1e-3, 1e-3, 1e-3, 1.0, 1e-3])
  out = run_sample(jnp.asarray(x), SamplingParams.make(B, temperature=temps),
                   jax.random.key(25), impl=impl)
  # The sampler's own fp32 tempered logits (XLA's division: on CPU it is not
  # always the correctly rounded quotient), so only the logprob arithmetic is
  # under test; the expectation is then exact float64 arithmetic on them.
  y_all = np.asarray(jnp.asarray(x) / jnp.asarray(temps)[:, None], np.float64)
  for b in range(B):
    y = y_all[b]
    # Shifted form: y - y.max() is exact in float64, so want carries no
    # cancellation either (for the -1e30 row it is exactly -log(V)).
    want = (y[out.tokens[b]] - y.max()) - np.log(np.sum(np.exp(y - y.max())))
    # The kernel sums exp(x * (1/T) - bound): each term's exponent is within
    # ~1 ulp of fl(x / T), so its documented bound adds a few ulp of max|y|.
    slack = 4 * np.spacing(np.float32(np.abs(y).max())) if impl == "pallas" else 0
    assert abs(out.logprobs[b] - want) <= 1e-5 * max(1.0, abs(want)) + slack, (
        b, out.logprobs[b], want)


@pytest.mark.parametrize("impl,gen", IMPLEMENTATIONS_BY_GENERATOR)
def test_tempered_overflow_rows_are_invalid(impl, gen):
  """Validity is a property of the tempered logits (finite max of x / T): a
  row whose x / T overflows fp32 is invalid, its token is the first entry of
  max(y) and its logprob -inf (never NaN); other rows are unaffected."""
  x = np.array(random_logits(26, B, V, scale=1.0))
  x[0, 5] = 1e35  # with T = 1e-4 (sampled: T >= MIN_TEMPERATURE): y = +inf
  x[0, 9] = 2e35  # also +inf: the first +inf entry (5) is the token
  x[1, :] = -3e38  # with T = 0.5: every y overflows to -inf
  params = SamplingParams.make(B, temperature=[1e-4, 0.5, 1.0, 1.0, 1.0])
  out = run_sample(jnp.asarray(x), params, jax.random.key(26), impl=impl, rng=gen)
  assert_result_types(out, B, V)
  np.testing.assert_array_equal(out.valid, [False, False, True, True, True])
  np.testing.assert_array_equal(out.tokens[:2], [5, 0])
  np.testing.assert_array_equal(out.logprobs[:2], -np.inf)
  assert not np.any(np.isnan(out.logprobs)), out.logprobs
  assert np.all(out.logprobs[2:] <= 0), out.logprobs


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_input_dtypes(gen, dtype):
  x = random_logits(10, B, V, scale=3.0, dtype=dtype)
  x = x.at[1, :100].set(-jnp.inf)
  params = SamplingParams.make(B, temperature=[1.0, 0.0, 0.6, 1.5, 1.0])
  key = jax.random.key(10)
  out = parity(x, params, key, gen)
  assert out.valid.all()
  # Logits are read in their own dtype and computed in fp32: same result as
  # the exact fp32 upcast.
  for impl in IMPLEMENTATIONS:
    up = run_sample(x.astype(jnp.float32), params, key, impl=impl, rng=gen)
    np.testing.assert_array_equal(up.tokens, out.tokens)
    np.testing.assert_allclose(up.logprobs, out.logprobs, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Invalid rows through the kernel (untruncated params).
# ---------------------------------------------------------------------------


def _invalid_batches():
  r = np.random.default_rng(11)
  def base():
    return r.standard_normal(V).astype(np.float32)
  rows1, want1 = [], []
  x = base(); x[7] = np.nan; rows1.append(x); want1.append(7)
  x = base(); x[9] = np.nan; x[3] = np.inf; rows1.append(x); want1.append(3)
  x = np.full(V, -np.inf, np.float32); rows1.append(x); want1.append(0)
  x = np.full(V, -np.inf, np.float32); x[0] = np.nan; rows1.append(x); want1.append(0)
  rows1.append(base()); want1.append(None)
  rows2, want2 = [], []
  x = base(); x[V - 1] = np.inf; rows2.append(x); want2.append(V - 1)
  x = np.full(V, np.nan, np.float32); rows2.append(x); want2.append(0)
  x = np.full(V, -np.inf, np.float32); rows2.append(x); want2.append(0)
  x = np.full(V, -np.inf, np.float32); x[[2, 5]] = np.inf; x[9] = 1.0
  rows2.append(x); want2.append(2)
  x = base(); x[3000] = np.nan; x[2999] = -np.inf; rows2.append(x); want2.append(3000)
  return [(np.stack(rows1), want1, [1.0, 0.5, 1.0, 0.0, 1.0]),
          (np.stack(rows2), want2, [1.0, 0.0, 0.0, 0.7, 2.0])]


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
@pytest.mark.parametrize("batch", [0, 1])
def test_invalid_rows_through_kernel(gen, batch):
  x, want, temps = _invalid_batches()[batch]
  params = SamplingParams.make(B, temperature=temps)
  out = parity(jnp.asarray(x), params, jax.random.key(12), gen)
  invalid = np.array([w is not None for w in want])
  np.testing.assert_array_equal(out.valid, ~invalid)
  np.testing.assert_array_equal(out.tokens[invalid],
                                [w for w in want if w is not None])
  assert np.all(out.logprobs[invalid] == -np.inf)
  assert np.all(np.isfinite(out.logprobs[~invalid]))


# ---------------------------------------------------------------------------
# FP64 Gumbel path.
# ---------------------------------------------------------------------------

FP64_SHAPE = (4, 3000)


@pytest.fixture(scope="module")
def fp64_case():
  x = random_logits(64, *FP64_SHAPE)
  temps = np.float32([1.0, 0.0, 0.7, 1.6])
  return x, SamplingParams.make(FP64_SHAPE[0], temperature=temps), jax.random.key(64)


@pytest.fixture(scope="module")
def fp64_eager(fp64_case):
  """Eager FP64 results per (implementation, generator)."""
  x, params, key = fp64_case
  return {(impl, gen): run_sample(x, params, key, impl=impl, rng=gen, fp64=True,
                                  jit=False)
          for impl in IMPLEMENTATIONS for gen in GENERATORS}


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_fp64_eager_pallas_matches_xla(gen, fp64_eager):
  a, b = fp64_eager["pallas", gen], fp64_eager["xla", gen]
  assert_result_types(a, *FP64_SHAPE)
  assert_same_result(a, b)
  assert a.valid.all() and a.logprobs[1] == 0.0


def test_fp64_threefry_matches_jax_random_categorical_fp64(fp64_case, fp64_eager):
  """FP64: noise is jax.random.gumbel(key, shape, float64) and the race uses
  the fp32 tempered logits widened (reference docstring)."""
  x, params, key = fp64_case
  temps = np.asarray(params.temperature)
  sampled = temps > 0
  y = np.asarray(x / jnp.where(temps > 0, temps, 1.0)[:, None])  # fp32 division
  with jax.enable_x64(True):
    want = np.asarray(jax.random.categorical(key, jnp.asarray(y, jnp.float64)))
  for impl in IMPLEMENTATIONS:
    got = fp64_eager[impl, "threefry"]
    np.testing.assert_array_equal(got.tokens[sampled], want[sampled])


@pytest.mark.parametrize("impl,gen", IMPLEMENTATIONS_BY_GENERATOR)
def test_fp64_jit_inside_enable_x64_equals_eager(impl, gen, fp64_case, fp64_eager):
  x, params, key = fp64_case
  got = run_sample(x, params, key, impl=impl, rng=gen, fp64=True, jit=True)
  assert_result_types(got, *FP64_SHAPE)
  np.testing.assert_array_equal(got.tokens, fp64_eager[impl, gen].tokens)
  np.testing.assert_allclose(got.logprobs, fp64_eager[impl, gen].logprobs,
                             rtol=1e-6, atol=1e-6)


# (generator, position, vocab id, vocab, config overrides): per-request
# streams of jax.random.key(0) where the FP64 draw at ``vocab id`` has its high
# 32-bit word >= 0xFFFFFF80, i.e. u64 within 2^-25 of 1 and a Gumbel value of
# ~20; found by scanning the documented stream layout (rng module docstring).
EXTREME_FP64_DRAWS = [("philox", 28889, 898, 2048, {}),
                      ("threefry", 2223, 3663, 4096,
                       dict(tuning=race(num_splits=1)))]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("gen,position,v,vocab,overrides", EXTREME_FP64_DRAWS,
                         ids=[d[0] for d in EXTREME_FP64_DRAWS])
def test_fp64_extreme_noise_token_wins(impl, gen, position, v, vocab, overrides):
  """Gumbel-max over the documented FP64 noise picks the token with the
  largest y + g, also when its noise comes from a u64 extremely close to 1.

  Row: token 0 has logit L, token v has logit 0, the rest -inf; L is set so
  that v wins by ~2 in fp64 (its Gumbel value ~20 is only reachable with the
  full 64-bit uniform; the fp32 top word of u caps it at ~15.9).
  """
  keys = jax.random.key(0)[None]
  positions = jnp.array([position], jnp.int32)
  with jax.enable_x64(True):
    streams, _ = jaxsample.rng.row_streams(keys, positions, 1, vocab)
    g = np.asarray(jaxsample.rng.gumbel_noise(gen, streams, vocab, fp64=True))[0]
  assert g[v] > 19  # the precondition the stream was chosen for
  x = np.full((1, vocab), -np.inf, np.float32)
  x[0, 0] = np.float32((g[v] + 16.0) / 2 - g[0])  # race of token 0 ~ 18
  x[0, v] = 0.0
  race = x[0].astype(np.float64) + g
  expected = int(np.argmax(race))
  assert expected == v
  out = run_sample(jnp.asarray(x), SamplingParams.make(1), keys,
                   positions=positions, impl=impl, rng=gen, fp64=True,
                   **overrides)
  assert out.tokens[0] == expected, (impl, out.tokens, expected)
  np.testing.assert_allclose(out.logprobs[0], -x[0, 0], rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_fp64_jit_without_x64_raises(impl, fp64_case):
  x, params, key = fp64_case
  config = SamplerConfig(rng="philox", implementation=impl, use_fp64_gumbel=True)
  assert not jax.config.jax_enable_x64
  fn = jax.jit(lambda x, key: jaxsample.sample(x, params, key, config=config))
  with pytest.raises(ValueError, match="enable_x64"):
    fn(x, key)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_fp64_jit_traced_params_only_without_x64(impl, fp64_case, fp64_eager):
  """A jitted call whose only traced input is the params (logits and key
  closed over) must either give the FP64 result or the documented error."""
  x, params, key = fp64_case
  config = SamplerConfig(rng="philox", implementation=impl, use_fp64_gumbel=True)
  fn = jax.jit(lambda p: jaxsample.sample(x, p, key, config=config))
  try:
    got = jax.tree.map(np.asarray, fn(params))
  except ValueError as e:
    assert "enable_x64" in str(e)
  else:
    np.testing.assert_array_equal(got.tokens, fp64_eager[impl, "philox"].tokens)


# ---------------------------------------------------------------------------
# jax.random compatibility and batch invariance.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_threefry_one_key_matches_jax_random_categorical(impl):
  x = random_logits(13, B, V, scale=1.0)
  temps = random_temps(13, B, 0.5, 2.0)
  key = jax.random.key(13)
  out = run_sample(x, SamplingParams.make(B, temperature=temps), key, impl=impl,
                   rng="threefry")
  want = np.asarray(jax.random.categorical(key, x / jnp.asarray(temps)[:, None]))
  np.testing.assert_array_equal(out.tokens, want)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_threefry_per_request_position0_matches_categorical(impl):
  x = random_logits(14, B, V, scale=1.0)
  keys = jax.random.split(jax.random.key(14), B)
  out = run_sample(x, SamplingParams.make(B), keys, impl=impl, rng="threefry",
                   positions=jnp.zeros(B, jnp.int32))
  for b in range(B):
    assert out.tokens[b] == int(jax.random.categorical(keys[b], x[b]))


@pytest.mark.parametrize("impl,gen", IMPLEMENTATIONS_BY_GENERATOR)
def test_batch_invariance_per_request_keys(impl, gen):
  x = random_logits(15, B, V, scale=1.0)
  keys = jax.random.split(jax.random.key(15), B)
  positions = jnp.asarray([0, 3, 3, 1000, 2**20], jnp.int32)
  temps = np.float32([1.0, 0.8, 1.2, 0.0, 1.0])
  params = SamplingParams.make(B, temperature=temps)
  batch = run_sample(x, params, keys, positions=positions, impl=impl, rng=gen)
  assert batch.valid.all()
  # Alone.
  for b in range(B):
    alone = run_sample(x[b:b + 1], jax.tree.map(lambda a: a[b:b + 1], params),
                       keys[b:b + 1], positions=positions[b:b + 1], impl=impl,
                       rng=gen)
    assert alone.tokens[0] == batch.tokens[b]
    np.testing.assert_allclose(alone.logprobs[0], batch.logprobs[b], rtol=1e-5,
                               atol=1e-5)
  # Shuffled.
  perm = np.array([3, 1, 4, 0, 2])
  shuffled = run_sample(x[perm], jax.tree.map(lambda a: a[perm], params),
                        keys[perm], positions=positions[perm], impl=impl, rng=gen)
  np.testing.assert_array_equal(shuffled.tokens, batch.tokens[perm])
  np.testing.assert_allclose(shuffled.logprobs, batch.logprobs[perm], rtol=1e-5,
                             atol=1e-5)
  # Padded: 3 junk rows with their own keys around the requests.
  pad = 3
  xp = jnp.concatenate([jnp.zeros((2, V)), x, random_logits(16, 1, V)])
  kp = jnp.concatenate([jax.random.split(jax.random.key(99), 2), keys,
                        jax.random.split(jax.random.key(98), 1)])
  pp = jnp.concatenate([jnp.array([0, 7]), positions, jnp.array([5])])
  params_p = SamplingParams.make(B + pad, temperature=[1.0, 0.0, *temps, 1.0])
  padded = run_sample(xp, params_p, kp, positions=pp, impl=impl, rng=gen)
  np.testing.assert_array_equal(padded.tokens[2:2 + B], batch.tokens)
  # Positions matter: the next position gives other tokens somewhere.
  moved = run_sample(x, params, keys, positions=positions + 1, impl=impl, rng=gen)
  assert not np.array_equal(moved.tokens[temps > 0], batch.tokens[temps > 0])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_raw_key_data_equals_typed_keys(impl):
  x = random_logits(17, B, V, scale=1.0)
  params = SamplingParams.make(B)
  keys = jax.random.split(jax.random.key(17), B)
  pos = jnp.arange(B, dtype=jnp.int32)
  a = run_sample(x, params, keys, positions=pos, impl=impl)
  b = run_sample(x, params, jax.random.key_data(keys), positions=pos, impl=impl)
  assert_same_result(a, b)
  key = jax.random.key(18)
  a = run_sample(x, params, key, impl=impl)
  b = run_sample(x, params, jax.random.key_data(key), impl=impl)
  assert_same_result(a, b)


# ---------------------------------------------------------------------------
# Distribution of the kernel path.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_pallas_sampled_frequencies(gen):
  vocab, draws, t = 16, 4096, 0.8
  logits = (np.random.default_rng(19).standard_normal(vocab) * 1.2).astype(np.float32)
  x = jnp.broadcast_to(jnp.asarray(logits), (draws, vocab))
  out = run_sample(x, SamplingParams.make(draws, temperature=t),
                   jax.random.key(19), impl="pallas", rng=gen)
  y = (logits / np.float32(t)).astype(np.float64)
  probs = np.exp(y - y.max())
  probs /= probs.sum()
  assert_chi2_fits(out.tokens, probs)
  np.testing.assert_allclose(out.logprobs, np.log(probs[out.tokens]), rtol=0,
                             atol=2e-5)


# ---------------------------------------------------------------------------
# Truncation and canonical parameters through the public API.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl,gen", IMPLEMENTATIONS_BY_GENERATOR)
def test_truncated_rows_sample_in_kept_set(impl, gen):
  x = np.array(random_logits(20, B, V, scale=1.5))
  x[3, :50] = -np.inf
  temps = [1.0, 0.7, 1.3, 1.0, 0.0]
  ks, ps, ms = [40, 0, 0, 7, 3], [1.0, 0.9, 1.0, 0.8, 0.5], [0.0, 0.0, 0.1, 0.05, 0.0]
  params = SamplingParams.make(B, temperature=temps, top_k=ks, top_p=ps, min_p=ms)
  out = run_sample(jnp.asarray(x), params, jax.random.key(20), impl=impl, rng=gen)
  assert_result_types(out, B, V)
  for b in range(4):
    y = (x[b] / np.float32(temps[b])).astype(np.float32)
    o = oracle_keep(y, ks[b], ps[b], ms[b])
    assert not o.near_boundary
    assert o.kept[out.tokens[b]]
    np.testing.assert_allclose(out.logprobs[b], np.log(o.probs(y)[out.tokens[b]]),
                               rtol=1e-5, atol=2e-5)
  assert out.tokens[4] == np.argmax(x[4]) and out.logprobs[4] == 0.0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_canonical_out_of_range_values_through_sample(impl):
  """Traced out-of-range params follow SamplingParams.canonical."""
  x = np.array(random_logits(21, B, V, scale=1.0))
  x[3, [10, 20, 30]] = 8.0  # a top tie group of three
  x[4, 77] = 8.0
  params = make_params(B, temperature=[np.nan, -1.0, np.inf, 1.0, 1.0],
                       top_p=[1.0, 1.0, 1.0, 0.0, 1.0],
                       min_p=[0.0, 0.0, 0.0, 0.0, 2.0])
  out = run_sample(jnp.asarray(x), params, jax.random.key(21), impl=impl)
  np.testing.assert_array_equal(out.tokens[:3], np.argmax(x[:3], -1))
  np.testing.assert_array_equal(out.logprobs[:3], 0.0)  # greedy
  assert out.tokens[3] in (10, 20, 30)
  np.testing.assert_allclose(out.logprobs[3], -math.log(3), atol=1e-6)
  assert out.tokens[4] == 77
  np.testing.assert_allclose(out.logprobs[4], 0.0, atol=1e-6)


@pytest.mark.parametrize("impl,gen", IMPLEMENTATIONS_BY_GENERATOR)
def test_top_k_at_least_vocab_is_off(impl, gen):
  x = random_logits(22, B, V, scale=1.0)
  key = jax.random.key(22)
  off = run_sample(x, SamplingParams.make(B, top_k=0), key, impl="xla", rng=gen)
  for k in (V, V + 1, -1):
    got = run_sample(x, make_params(B, top_k=k), key, impl=impl, rng=gen)
    assert_same_result(got, off)


def test_auto_implementation():
  x = random_logits(23, B, V)
  params = SamplingParams.make(B, temperature=random_temps(23, B))
  key = jax.random.key(23)
  expected = "pallas" if jax.default_backend() == "gpu" else "xla"
  auto = run_sample(x, params, key, impl="auto")
  assert_same_result(auto, run_sample(x, params, key, impl=expected))


def test_default_config_runs_eagerly():
  x = random_logits(24, 2, 1007)
  out = jax.tree.map(np.asarray, jaxsample.sample(x, SamplingParams.make(2),
                                                  jax.random.key(0)))
  assert_result_types(out, 2, 1007)
  assert isinstance(jaxsample.sample(x, SamplingParams.make(2), jax.random.key(0)),
                    jaxsample.SampleResult)


# ---------------------------------------------------------------------------
# Edge cases and bad inputs.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("per_request", [False, True])
def test_empty_batch(impl, per_request):
  x = jnp.zeros((0, 1007), jnp.float32)
  key = (jax.random.split(jax.random.key(0), 0) if per_request
         else jax.random.key(0))
  out = run_sample(x, SamplingParams.make(0), key, impl=impl, jit=False)
  assert_result_types(out, 0, 1007)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", ["1d", "3d", "int", "bool", "v0", "batch"])
def test_bad_inputs_raise_value_error(impl, case):
  params = SamplingParams.make(2)
  x = {"1d": jnp.zeros((2,)), "3d": jnp.zeros((2, 3, 4)),
       "int": jnp.zeros((2, 10), jnp.int32), "bool": jnp.zeros((2, 10), bool),
       "v0": jnp.zeros((2, 0)), "batch": jnp.zeros((3, 10))}[case]
  with pytest.raises(ValueError):
    jaxsample.sample(x, params, jax.random.key(0),
                     config=SamplerConfig(implementation=impl))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_keys_and_positions_raise_value_error(impl):
  config = SamplerConfig(implementation=impl)
  x = jnp.zeros((2, 10))
  params = SamplingParams.make(2)
  with pytest.raises(ValueError, match="positions"):
    jaxsample.sample(x, params, jax.random.key(0), positions=jnp.zeros(2, jnp.int32),
                     config=config)
  with pytest.raises(ValueError):
    jaxsample.sample(x, params, jax.random.split(jax.random.key(0), 3), config=config)
  with pytest.raises(ValueError):
    jaxsample.sample(x, params, jax.random.split(jax.random.key(0), 2),
                     positions=jnp.zeros(3, jnp.int32), config=config)
