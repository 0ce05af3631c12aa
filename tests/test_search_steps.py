"""Radix steps of the kernels' threshold searches
(``threshold.search.largest_keys``'s ``bits_per_step``, the launch configs'
``search_bits_per_step``): the same keys, and the same sampling results, as
the bit-by-bit search for every number of key bits per step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import tuning
from jaxsample._src.pallas import common, threshold
from jaxsample._src.tuning import BoundsLaunch, Tuning, WindowLaunch

from helpers.cases import sample_with_mask
from helpers.parametrize import on_gpu, slow_case

search = threshold.search
STEPS = range(1, tuning.MAX_SEARCH_BITS_PER_STEP + 1)


@functools.cache
def _searches(bits_per_step: int):
  """Per row ``y`` (``-inf``: not a survivor): the keys of the count
  predicate (``n``-th largest survivor) and of a fp32 mass predicate (upper
  mass of the survivors reaches ``target``), searched over 20 and 32 bits,
  from the top and from ``key_prefix(lower, upper)``."""

  def run(y, n, target, lower, upper):
    key = common.order_key(y)
    survives = y > -jnp.inf
    e = jnp.where(survives, jnp.exp(y - jnp.max(y)), 0.0)
    reaches = (search.count_reaches(key, survives, n),
               lambda v: jnp.sum(jnp.where(survives & (key >= v), e,
                                           0.0)) >= target)
    start = search.key_prefix(lower, upper)
    return [search.largest_keys(reaches, bits, begin, bits_per_step)
            for bits in (20, 32) for begin in (None, start)]

  return jax.jit(run)


def _count_answer(y, n, bits, start=None):
  """Sort-based: the largest key with its low ``32 - bits`` bits zero that at
  least ``n`` survivors reach (in the block of ``start = (prefix, known)``,
  ``known <= bits``: its largest such key, 0 if none there); 0 if none."""
  keys = np.sort(np.asarray(common.order_key(jnp.asarray(y)))[y > -np.inf])
  grid = (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF
  want = int(keys[-n]) & grid if 1 <= n <= len(keys) else 0
  if start is None:
    return want
  prefix, known = int(start[0]), int(start[1])
  block = (0xFFFFFFFF << (32 - known)) & 0xFFFFFFFF if known else 0
  largest = (prefix | (~block & 0xFFFFFFFF)) & grid
  return 0 if want < prefix else min(want, largest)


def test_radix_steps_find_the_bit_by_bit_keys():
  """Every ``bits_per_step`` finds the bit-by-bit search's keys (20 and 32
  bits, from the top and from a window's prefix) on rows with ties, -inf
  entries, all-false predicates (``n`` above the survivors, a mass target
  above the row's), an all-true one (target 0) and windows between two of
  the row's values or over every key; the count keys are the sort-based
  answers (20 bits from the top, 32 bits from the top and the prefix)."""
  r = np.random.default_rng(17)
  for trial in range(6):
    y = (r.standard_normal(203) * r.choice([0.01, 1, 30])).astype(np.float32)
    y[:40] = np.round(y[:40])  # ties
    y[r.choice(203, 25, replace=False)] = -np.inf
    survivors = int(np.sum(y > -np.inf))
    n = [1, 7, survivors, survivors + 1, 60, 120][trial]
    target = np.float32([0.5, 3.0, 1e9, 0.0, 20.0, 1.0][trial])
    lower, upper = np.sort(r.choice(y[y > -np.inf], 2))
    if trial == 3:
      lower, upper = -np.inf, np.inf  # nothing known: the whole key range
    args = [jnp.asarray(v) for v in (y, np.int32(n), target,
                                     np.float32(lower), np.float32(upper))]
    found = {steps: jax.tree.map(int, _searches(steps)(*args))
             for steps in STEPS}
    for steps in STEPS:
      assert found[steps] == found[1], (trial, steps, found[steps], found[1])
    start = search.key_prefix(args[3], args[4])
    counted = [keys[0] for keys in found[1]]  # 20, 20 + start, 32, 32 + start
    assert [counted[0], counted[2], counted[3]] == [
        _count_answer(y, n, 20), _count_answer(y, n, 32),
        _count_answer(y, n, 32, start)], trial


@pytest.mark.kernels
@pytest.mark.parametrize("vocab,steps", [
    slow_case(6000, 2), (6000, 3), slow_case(6000, 4),
    on_gpu(151936, 2), on_gpu(151936, 3), on_gpu(151936, 4)])
def test_radix_steps_sample_the_same_bits(vocab, steps):
  """Flat rows (``2 * randn``) whose top-p and large top-k kept sets take
  the window searches, beside top-k + top-p and min-p rows: tokens,
  logprobs and sampling masks (ids, counts, logZ) are bit-identical with
  every search at ``steps`` key bits per step and at 1."""
  batch = 6
  x = jnp.asarray(2 * np.random.default_rng(vocab + steps).standard_normal(
      (batch, vocab)), jnp.float32)
  params = SamplingParams.make(
      batch, temperature=[1, 0.7, 1, 1.3, 1, 1],
      top_k=[0, 0, 50, 0, vocab // 4, 0],
      top_p=[0.95, 0.9, 0.9, 0.5, 1, 1], min_p=[0, 0, 0, 0, 0, 0.1])
  key = jax.random.key(steps)
  runs = [sample_with_mask(
      x, params, key, impl="pallas", max_candidates=256,
      tuning=Tuning(bounds=BoundsLaunch(search_bits_per_step=r),
                    window=WindowLaunch(search_bits_per_step=r)))
          for r in (1, steps)]
  (one, one_mask), (many, many_mask) = runs
  np.testing.assert_array_equal(one.tokens, many.tokens)
  np.testing.assert_array_equal(one.logprobs, many.logprobs)
  np.testing.assert_array_equal(one.valid, many.valid)
  assert one.valid.all()
  for field in ("ids", "count", "logz", "truncated", "overflow"):
    np.testing.assert_array_equal(getattr(one_mask, field),
                                  getattr(many_mask, field), err_msg=field)


@pytest.mark.parametrize("config", [BoundsLaunch, WindowLaunch])
@pytest.mark.parametrize("value", [0, 5, 2.0, True, None])
def test_search_bits_per_step_is_validated(config, value):
  with pytest.raises(ValueError, match=f"{config.__name__}.search_bits_per_"
                     r"step must be an int in 1\.\.4"):
    config(search_bits_per_step=value)


def test_a_bound_mode_select_needs_a_search_launch():
  y = jnp.zeros((1, 16), jnp.float32)
  one = jnp.zeros((1,), jnp.float32)
  with pytest.raises(ValueError, match="SearchLaunch"):
    threshold.select_threshold(
        y, one, one, SamplingParams.make(1, top_p=0.9).canonical(16), one,
        bound=True, interpret=True, launch=tuning.SelectLaunch())
