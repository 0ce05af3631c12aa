"""The large-set route's fused race (``threshold.sample_large``, interpret
mode): where a row's last window search held its threshold, the compact
pass races the elements above the window and the pack kernel the window's,
in place of the Gumbel kernel with a floor (``floored_race``).  Against
that floored race on the same thresholds and against the XLA reference
(the ``gpu`` cases: compiled, at V = 151936).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import rng
from jaxsample._src.pallas import threshold

from helpers.cases import assert_tokens_off_boundary
from helpers.parametrize import on_gpu, slow_case
from helpers.sampling import run_sample

_CAPACITY = 256  # rows keeping more than C / 2 take the large-set route

# Rows: top-p alone, top-k (> C / 2) with top-p, top-k alone, min-p with
# top-p (these four raced by their window search), min-p alone, a top-p row
# whose sample misleads its window (the pivot search), then rows the route
# leaves alone: plain and greedy with top-p.
_ROWS = dict(temperature=[0.7, 1.0, 1.3, 1.0, 1.0, 1.0, 1.0, 0.0],
             top_k=[0, 3000, 2500, 0, 0, 0, 0, 0],
             top_p=[0.9, 0.9, 1.0, 0.95, 1.0, 0.9, 1.0, 0.9],
             min_p=[0.0, 0.0, 0.0, 0.01, 0.001, 0.0, 0.0, 0.0])


def _flat_rows(vocab: int) -> np.ndarray:
  """``2 * randn`` rows (large kept sets); row 5's sample (every
  ``SAMPLE_STRIDE``-th logit) far below the rest, so its window misses."""
  x = np.random.default_rng(7).standard_normal((8, vocab)) * 2
  x[5, ::threshold.base.SAMPLE_STRIDE] = -30
  return x.astype(np.float32)


@functools.partial(jax.jit, static_argnames="config")
def _fused_and_floored(x, params, streams, config):
  """``sample_large``'s outputs for the rows ``sample_truncated`` leaves
  unfinished, the floored race of every such row on the same thresholds,
  and which rows the window searches measured."""
  trunc = threshold.sample_truncated(x, params, streams, config,
                                     finish_large=False)
  rows = trunc.unfinished(params)
  fused = threshold.sample_large(x, params, trunc, streams, config, rows)
  sets, _ = threshold.large_thresholds(x, params, trunc, config, rows)
  floored = threshold.floored_race(x, params, streams, config, rows,
                                   sets.threshold, trunc.row_max)
  return rows, sets.measured, fused, floored


@pytest.mark.kernels
@pytest.mark.parametrize("gen,vocab", [
    ("philox", 8000), slow_case("threefry", 8000), slow_case("philox", 4003),
    on_gpu("philox", 151936), on_gpu("threefry", 151936)])
def test_fused_race_matches_floored_race_and_reference(gen, vocab):
  """The large rows' tokens equal the floored race's bit for bit and their
  counts exactly; logprobs and ``log_kept`` (the window's measured mass
  against the Gumbel kernel's sum) within 1e-5.  Through
  ``jaxsample.sample`` the mixed batch's tokens equal the reference's
  (``_sample_matches_reference``), logprobs within 1e-5."""
  x = _flat_rows(vocab)
  params = SamplingParams.make(8, **_ROWS)
  canon = params.canonical(vocab)
  key = jax.random.key(3)
  streams, _ = rng.row_streams(key, None, 8, vocab)
  config = SamplerConfig(rng=gen, max_candidates=_CAPACITY)
  rows, measured, fused, (result, count, log_kept) = jax.tree.map(
      np.asarray, _fused_and_floored(jnp.asarray(x), canon, streams, config))
  token, logprob, complete, _, fused_count, fused_log_kept = fused
  np.testing.assert_array_equal(rows, [True] * 6 + [False] * 2)
  # The window searches held rows 0-3 (raced there); 4 and 5 took the floor.
  np.testing.assert_array_equal(measured[:6], [True] * 4 + [False] * 2)
  assert complete[rows].all()
  np.testing.assert_array_equal(token[rows], result.tokens[rows])
  np.testing.assert_array_equal(fused_count[rows], count[rows])
  np.testing.assert_allclose(logprob[rows], result.logprobs[rows], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(fused_log_kept[rows], log_kept[rows], rtol=1e-5,
                             atol=1e-5)
  assert (count[rows] > _CAPACITY).all(), count  # sets no buffer holds
  a = _sample_matches_reference(x, params, key, gen, fp64=False)
  np.testing.assert_array_equal(a.tokens[rows], token[rows])


@pytest.mark.slow
def test_fp64_noise_races_large_sets_with_the_floor():
  """FP64 noise (its own route: each kept set's threshold, then the Gumbel
  kernel's FP64 race with the floor): the mixed batch's tokens equal the
  reference's (``_sample_matches_reference``), logprobs within 1e-5."""
  _sample_matches_reference(_flat_rows(8000), SamplingParams.make(8, **_ROWS),
                            jax.random.key(3), "philox", fp64=True)


def _sample_matches_reference(x, params, key, gen: str, *, fp64: bool):
  """``jaxsample.sample``'s kernels on ``x`` against the reference (tokens
  equal but on at most one row on a top-p rounding boundary, where fp32
  masses may settle on an adjacent admissible set); returns the kernels'
  result."""
  a = run_sample(x, params, key, impl="pallas", rng=gen, fp64=fp64,
                 max_candidates=_CAPACITY)
  b = run_sample(x, params, key, impl="xla", rng=gen, fp64=fp64)
  assert_tokens_off_boundary(a, b, x, params)
  same = a.tokens == b.tokens
  np.testing.assert_allclose(a.logprobs[same], b.logprobs[same], rtol=1e-5,
                             atol=1e-5)
  return a
