"""The truncated-sampling kernels' searches for rows whose kept set no
candidate buffer holds (``jaxsample._src.pallas.threshold``, interpret mode): the
pivot search for overflowing top-k rows, the listed-segment reads, the
window searches of large kept sets (their measures and the masks they
list) and the fixed-pass pivot threshold, each against the numpy
sort-based oracle.  Kept sets of the buffers, the certificate and the
lowering: ``test_threshold.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import reference, rng
from jaxsample._src.backends import pallas as pallas_backend
from jaxsample._src.pallas import threshold
from jaxsample._src import tuning
from jaxsample._src.tuning import PivotLaunch, Tuning

from helpers.cases import truncate
from helpers.oracle import oracle_keep
from helpers.parametrize import slow_case
from helpers.sampling import run_sample


def test_overflowing_rows_take_the_pivot_search():
  """A row with top-k at most ``C / 2`` whose candidates overflow the buffer
  (here: the tie at the threshold) is left incomplete by the buffer and
  finished by the pivot search; rows with a larger top-k take the window
  searches.  All keep the oracle's set.  (The shape and config of
  ``test_large_kept_sets_are_decided_by_the_window_search``: one program.)"""
  vocab = 20000
  x = np.random.default_rng(4).standard_normal((4, vocab)).astype(np.float32)
  x[0, :300] = 5.0
  params = SamplingParams.make(4, top_k=[5, 200, 400, 5], top_p=[1, 1, 0.99, 1])
  config = SamplerConfig(max_candidates=256)
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
    slow_case(dict(top_p=0.9), id="top_p=0.9"),
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


@pytest.mark.slow
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
      pallas_backend.kept_sets, config=SamplerConfig(max_candidates=256)))(
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
  assert threshold.listing_width(width, config)
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
    _, _, _, held = threshold.route.window_threshold(
        listed.window, threshold.route.top_width_params(params, width),
        listed.listing.rows, tr.t1, lower, jnp.full_like(lower, jnp.inf),
        tr.row_max, listed.listing.capacity, launch, by_count=True)
    # The window kernel of each row's search placed the listing as a
    # by-count window of its own would (with no upper end).
    _, alone, upper = threshold.route.place_window(
        threshold.route.top_width_params(params, width), tr, rows, tr.t1,
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


@pytest.mark.slow
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
