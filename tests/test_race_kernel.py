"""The Gumbel race kernel (``jaxsample._src.pallas.gumbel``) through
``jaxsample.sample``: launch-plan overrides keep the reference's result,
peaked rows (the chunk filter skips most chunks) keep their tokens, the
partials count finite entries and exclude one id, and exact race ties take
the smallest id.

Parity at the production shapes is ``test_sample.py``'s; the FP64 noise
path ``test_fp64_gumbel.py``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src.pallas import gumbel

from helpers.cases import (SAMPLE_SHAPE, assert_same_result, race, random_logits,
                           random_temps)
from helpers.parametrize import GENERATORS_SLOW_THREEFRY
from helpers.sampling import run_sample

B, V = SAMPLE_SHAPE  # the shared workhorse shape


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
# Peaked rows: the chunk filter skips the exact race of most chunks.
# ---------------------------------------------------------------------------

PEAKED_B, PEAKED_V = 6, 16384  # 8 philox tiles (16 threefry tiles) per row


def llm_like_rows(seed, batch=PEAKED_B, vocab=PEAKED_V):
  """Rows whose bulk lies far below a few head tokens (the filter's path),
  and rows of the kinds every kernel change must keep: ties, -inf, greedy."""
  r = np.random.default_rng(seed)
  x = (r.standard_normal((batch, vocab)) * 2).astype(np.float32)
  heads = r.choice(vocab, size=(batch, 4), replace=False)
  for b in range(batch):
    x[b, heads[b]] = r.uniform(15, 25, 4)
  x[1, heads[1, :2]] = 24.0  # two tied heads (far apart in the row)
  x[1, heads[1, 2:]] = -np.inf
  x[2, : vocab // 2] = -np.inf  # a whole -inf half
  x[2, vocab - 3] = 30.0
  x[[0, 3], 5] = 40.0  # a head in the first tile: every later chunk loses
  # Bulk 16 below the head: head race ~ 30 + g.
  x[4] = np.float32(14.0) + (r.standard_normal(vocab) * 1e-3).astype(np.float32)
  x[4, heads[4, 0]] = 30.0
  temps = np.float32([0.7, 1.0, 0.9, 0.0, 1.0, 1.3])[:batch]  # row 3 greedy
  return jnp.asarray(x), SamplingParams.make(batch, temperature=temps)


def test_kernel_counts_finite_entries():
  """``count_finite``: each row's entries ``> -inf`` (NaN and -inf not
  counted), on sampled and greedy rows, summed over vocab splits."""
  x = np.array(random_logits(47, 4, 6001))
  x[0, ::5] = -np.inf
  x[1, 3], x[1, 10:20] = np.nan, -np.inf
  x[2] = -np.inf
  x[3, 500:] = -np.inf  # a greedy row
  temperature = jnp.asarray([1.0, 0.7, 1.0, 0.0])
  streams, _ = jaxsample._src.rng.row_streams(jax.random.key(47), None, *x.shape)
  config = SamplerConfig(implementation="pallas", tuning=race(num_splits=3))
  partials = jax.jit(lambda x: gumbel.gumbel_partials(
      x, temperature, streams, config, count_finite=True))(jnp.asarray(x))
  assert partials.kept.shape == (4, 3)  # three splits
  np.testing.assert_array_equal(np.sum(partials.kept, axis=-1),
                                (x > -np.inf).sum(-1))


def test_kernel_excludes_one_id():
  """``exclude``: a sampled row's partials are those of the row with that id
  set to -inf (race, token and sum-exp), the winner excluded included;
  greedy rows and -1 ignore it."""
  x, params = llm_like_rows(53)
  x = np.array(x)
  temperature = params.canonical(x.shape[1]).temperature
  streams, _ = jaxsample._src.rng.row_streams(jax.random.key(53), None, *x.shape)
  config = SamplerConfig(implementation="pallas", tuning=race(num_splits=3))
  run = lambda x, exclude: jax.tree.map(np.asarray, jax.jit(
      lambda x: gumbel.combine_partials(gumbel.gumbel_partials(
          x, temperature, streams, config, exclude=exclude)))(jnp.asarray(x)))
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


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_peaked_rows_keep_tokens(gen):
  """Rows where the filter skips the exact race of most chunks draw the
  reference's tokens bit for bit."""
  x, params = llm_like_rows(34)
  key = jax.random.key(31)
  a = run_sample(x, params, key, impl="pallas", rng=gen,
                 tuning=race(num_splits=3))
  assert_same_result(a, run_sample(x, params, key, impl="xla", rng=gen))
  assert a.valid.all()
  assert a.tokens[0] == 5 and a.tokens[3] == 5 and a.logprobs[3] == 0.0


def _exact_race_tie(gen, key, vocab, a, b, level=30.0):
  """Logits where ids ``a < b`` tie exactly for the best fp32 race (T = 1)."""
  streams, _ = jaxsample._src.rng.row_streams(key, None, 1, vocab)
  g = np.asarray(jaxsample._src.rng.gumbel_noise(gen, streams, vocab))[0]
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
  # A bulk far below (its chunks lose once a bound exists) and a few runners-up.
  r = np.random.default_rng(a + b)
  bulk = np.arange(vocab) % 3 == 0
  x[bulk] = (r.standard_normal(bulk.sum()) * 2).astype(np.float32)
  x[a], x[b] = xa, xb
  return x


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_exact_race_tie_takes_smallest_id(gen):
  """Two ids with bit-equal race values in different splits: the smaller id
  wins (the reference's argmax; an element equal to the bound is never
  filtered out).  (133, 517) share a lane of 1-warp programs, which visit 517
  first (lane groups of 128 ids: ``common.KernelPlan``)."""
  key = jax.random.key(33)
  for a, b in [(100, PEAKED_V - 50), (PEAKED_V // 2 + 7, PEAKED_V - 1),
               (133, 517)]:
    x = _exact_race_tie(gen, key, PEAKED_V, a, b)
    xs = jnp.asarray(x[None])
    params = SamplingParams.make(1, temperature=1.0)
    ref = run_sample(xs, params, key, impl="xla", rng=gen)
    assert ref.tokens[0] == a
    for splits, warps in [(1, None), (2, None), (4, None), (1, 1)]:
      got = run_sample(xs, params, key, impl="pallas", rng=gen,
                       tuning=race(num_splits=splits, num_warps=warps))
      assert got.tokens[0] == a, (splits, warps, got.tokens)
      np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
