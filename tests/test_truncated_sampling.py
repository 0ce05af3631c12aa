"""Truncated sampling on the kernels (``jaxsample.sample``,
``implementation="pallas"``, interpret mode) against the XLA reference.

Batches mixing kernel rows, rows the candidate buffer overflows, plain,
greedy and invalid rows; per-request keys; low-precision logits.  The kept
sets themselves are ``test_threshold.py``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import oracle_keep, run_sample
from jaxsample import SamplingParams, reference


@pytest.mark.parametrize("gen,max_candidates,fp64", [
    ("philox", 16, False), ("threefry", 4096, False), ("philox", 16, True)])
def test_sample_matches_reference_with_fallback_rows(gen, max_candidates,
                                                     fp64):
  """Kernel rows, fallback rows (overflow), plain, greedy and invalid rows in
  one batch: tokens and validity equal the reference's (FP64 noise: the kept
  sets' thresholds, then an FP64 race of each)."""
  batch, vocab = 10, 2000 + 3
  r = np.random.default_rng(5)
  x = r.standard_normal((batch, vocab)).astype(np.float32) * 3
  x[3, 17] = np.nan
  x[4, :] = -np.inf
  x[5, 100:] = -np.inf
  params = SamplingParams.make(
      batch, temperature=[1, 0.7, 0, 1, 1, 1.3, 1, 0.9, 1, 2],
      top_k=[50, 0, 5, 3, 0, 20, 0, 1, 500, 0],
      top_p=[1, 0.9, 1, 1, 0.5, 0.8, 1, 1, 0.95, 0.999999],
      min_p=[0, 0, 0, 0, 0, 0, 0, 0, 0, 0.01])
  key = jax.random.key(8)
  a = run_sample(x, params, key, impl="pallas", rng=gen, fp64=fp64,
                 max_candidates=max_candidates)
  b = run_sample(x, params, key, impl="xla", rng=gen, fp64=fp64)
  np.testing.assert_array_equal(a.valid, b.valid)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
  y = np.asarray(reference.temper(reference.sanitize(jnp.asarray(x)),
                                  params.temperature))
  for row in np.flatnonzero(b.valid & (np.asarray(params.temperature) > 0)):
    o = oracle_keep(y[row], int(params.top_k[row]), float(params.top_p[row]),
                    float(params.min_p[row]))
    assert o.kept[a.tokens[row]], row


def test_per_request_keys_are_batch_invariant():
  batch, vocab = 6, 3000
  x = np.random.default_rng(6).standard_normal((batch, vocab)).astype(np.float32)
  params = SamplingParams.make(batch, top_k=[40, 0, 3, 10, 0, 50],
                               top_p=[0.9, 0.8, 1, 0.5, 0.95, 1])
  keys = jax.random.split(jax.random.key(6), batch)
  positions = jnp.arange(batch, dtype=jnp.int32) * 7
  a = run_sample(x, params, keys, positions=positions, impl="pallas")
  b = run_sample(x, params, keys, positions=positions, impl="xla")
  np.testing.assert_array_equal(a.tokens, b.tokens)
  for row in (0, 3):
    alone = run_sample(x[row:row + 1], jax.tree.map(lambda v: v[row:row + 1],
                                                    params),
                       keys[row:row + 1], positions=positions[row:row + 1],
                       impl="pallas")
    assert alone.tokens[0] == a.tokens[row]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
def test_low_precision_logits(dtype):
  batch, vocab = 4, 1500
  x = jnp.asarray(np.random.default_rng(7).standard_normal((batch, vocab)) * 2,
                  dtype)
  params = SamplingParams.make(batch, top_k=[5, 0, 50, 2],
                               top_p=[1, 0.9, 0.9, 1], min_p=[0, 0, 0, 0.3])
  key = jax.random.key(9)
  a = run_sample(x, params, key, impl="pallas")
  b = run_sample(x.astype(jnp.float32), params, key, impl="xla")
  np.testing.assert_array_equal(a.tokens, b.tokens)
