"""GPU-only tests of the race-first route (``SamplerConfig(logprobs=False)``)
at production shapes: the race kernel's candidate lists (the 1-warp and the
4-warp plans) and the route's tokens against the reference's, every filter
setting the benchmark times and mixed rows, fp32 and bf16, both generators.

Run on the GPU machine with ``python -m pytest -m gpu tests/test_gpu_race_first.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import assert_tokens_off_boundary
from conftest import GENERATORS
import jaxsample
from jaxsample import SamplerConfig, SamplingParams, race_first, reference, rng
from jaxsample.bench import cases as bench_cases
from jaxsample.pallas import gumbel

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_gpu")]

VOCAB = 151936


@pytest.mark.parametrize("gen", GENERATORS)
@pytest.mark.parametrize("batch", [8, 128])  # 4-warp and 1-warp programs
def test_kernel_candidates_on_gpu(batch, gen):
  logits = bench_cases.make_logits(jax.random.key(batch), batch, VOCAB, "llm")
  temperature = jnp.full((batch,), 0.8, jnp.float32)
  streams, _ = rng.row_streams(jax.random.key(3), None, batch, VOCAB)
  config = SamplerConfig(implementation="pallas", rng=gen)
  values, ids, x_max = jax.jit(lambda x: gumbel.race_candidates(
      x, temperature, streams, config, 4))(logits)
  y = reference.temper(reference.sanitize(logits), temperature)
  ref_values, ref_ids = race_first.race_candidates(
      y + rng.gumbel_noise(gen, streams, VOCAB), 4)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_array_equal(np.asarray(values), np.asarray(ref_values))
  np.testing.assert_array_equal(np.asarray(x_max),
                                np.asarray(jnp.max(logits, axis=-1)))


@functools.partial(jax.jit, static_argnames=("config",))
def _sample(logits, params, key, config):
  return jaxsample.sample(logits, params, key, config=config)


def _mixed(batch: int) -> SamplingParams:
  cases = [dict(top_p=0.95), dict(top_k=50, top_p=0.9), dict(min_p=0.05),
           dict(top_k=1), dict(), dict(temperature=0.0, top_p=0.9),
           dict(top_p=0.5, min_p=0.1), dict(top_k=20000, top_p=0.99)]
  rows = [cases[b % len(cases)] for b in range(batch)]
  field = lambda name, off: [row.get(name, off) for row in rows]
  return SamplingParams.make(batch, temperature=field("temperature", 0.9),
                             top_k=field("top_k", 0), top_p=field("top_p", 1.0),
                             min_p=field("min_p", 0.0))


# Each filter setting the benchmark times (fp32, philox, M = 4), and mixed
# rows in bf16 with threefry (M = 4) and fp32 with one candidate (most rows
# with a filter then take the threshold kernels).
@pytest.mark.parametrize("setting,dtype,gen,candidates", [
    ("top_p0.95", jnp.float32, "philox", 4),
    ("top_k50+top_p0.9", jnp.float32, "philox", 4),
    ("min_p0.05", jnp.float32, "philox", 4),
    ("mixed", jnp.bfloat16, "threefry", 4),
    ("mixed", jnp.float32, "philox", 1)])
def test_race_first_matches_reference_on_gpu(setting, dtype, gen, candidates):
  batch = 64
  logits = bench_cases.make_logits(jax.random.key(7), batch, VOCAB,
                                   "llm").astype(dtype)
  logits = logits.at[3, 5].set(jnp.nan).at[4].set(-jnp.inf)  # invalid rows
  logits = logits.at[32:].set(bench_cases.make_logits(  # randn rows
      jax.random.key(8), batch - 32, VOCAB, "randn").astype(dtype))
  params = (_mixed(batch) if setting == "mixed" else SamplingParams.make(
      batch, temperature=0.9, **bench_cases.SETTINGS[setting]))
  key = jax.random.key(11)
  ref = _sample(logits, params, key, SamplerConfig(implementation="xla",
                                                   rng=gen))
  out = _sample(logits, params, key, SamplerConfig(
      implementation="pallas", rng=gen, logprobs=False,
      race_candidates=candidates))
  assert out.logprobs is None
  assert_tokens_off_boundary(out, ref, logits, params, most_differ=2)
