"""The FP64 Gumbel noise path (``SamplerConfig(use_fp64_gumbel=True)``) of
``jaxsample.sample`` on both backends: kernel vs reference, jax.random
compatibility, jit under ``jax.enable_x64``, extreme 64-bit draws and the
error without x64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams

from helpers.cases import (assert_result_types, assert_same_result, race,
                           random_logits)
from helpers.parametrize import (GENERATORS, GENERATORS_SLOW_THREEFRY,
                                 IMPLEMENTATIONS, IMPLEMENTATIONS_BY_GENERATOR)
from helpers.sampling import run_sample


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
    streams, _ = jaxsample._src.rng.row_streams(keys, positions, 1, vocab)
    g = np.asarray(jaxsample._src.rng.gumbel_noise(gen, streams, vocab, fp64=True))[0]
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
