"""Bad input gets a clear error naming the argument and the fix, or is
accepted and works (issue 36, item 5); continuous-batching helpers of
``SamplingParams``.  XLA path only: these checks run before any backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import rng, spec

B, V = 3, 50


def logits(seed=0, batch=B, vocab=V):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(
      (batch, vocab)), jnp.float32)


def assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_same_across_programs(a, b):
  """Tokens and validity equal; logprobs within 1e-5 (XLA:CPU may round a
  reduction differently in another compiled program)."""
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.valid), np.asarray(b.valid))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs),
                             rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# SamplingParams: direct construction, make, from_arrays.
# ---------------------------------------------------------------------------


def test_python_scalars_in_direct_construction_apply_to_every_row():
  key = jax.random.key(1)
  got = jaxsample.sample(logits(), SamplingParams(0.7, 5, 0.9, 0.0), key,
                         config="xla")
  want = jaxsample.sample(logits(), SamplingParams.make(
      B, temperature=0.7, top_k=5, top_p=0.9), key, config="xla")
  assert_same(got, want)


@pytest.mark.parametrize("fields,match", [
    (([1.0, 1.0], [0, 1, 2], 1.0, 0.0), "temperature has batch size 2"),
    ((1.0, [0, 1], 1.0, 0.0), "top_k has batch size 2"),
    (([1.0, 1.0, 1.0, 1.0], 0, 1.0, 0.0), "temperature has batch size 4"),
    ((None, 0, 1.0, 0.0), "temperature is None"),
    ((1.0, 0, "0.9", 0.0), "top_p"),
    ((1.0, 2.5, 1.0, 0.0), "top_k must hold integers"),
    ((1.0, 0, 1.0, [[0.0] * 3]), r"min_p has shape \(1, 3\)"),
])
def test_direct_construction_errors_name_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    jaxsample.sample(logits(), SamplingParams(*fields), jax.random.key(0),
                     config="xla")


def test_mismatched_field_lengths_batch_size_names_the_fix():
  with pytest.raises(ValueError, match="give every field"):
    _ = SamplingParams([1.0, 1.0], [0, 1, 2], 1.0, 0.0).batch_size


@pytest.mark.parametrize("params", [None, {"temperature": 1.0}, 0.7])
def test_params_not_sampling_params(params):
  with pytest.raises(ValueError, match=r"params must be SamplingParams.*make"):
    jaxsample.sample(logits(), params, jax.random.key(0))


def test_make_none_field_names_it():
  with pytest.raises(ValueError, match="temperature.*None.*default"):
    SamplingParams.make(2, temperature=None)


def test_make_under_jit_points_to_from_arrays():
  with pytest.raises(ValueError, match="from_arrays"):
    jax.jit(lambda t: SamplingParams.make(3, temperature=t))(jnp.ones(3))


def test_from_arrays_under_jit_equals_make():
  built = jax.jit(SamplingParams.from_arrays)(
      jnp.float32([0.5, 0.0, 2.0]), jnp.int32([3, 0, 7]), 0.9, 0.05)
  want = SamplingParams.make(3, temperature=[0.5, 0.0, 2.0], top_k=[3, 0, 7],
                             top_p=0.9, min_p=0.05)
  assert_same(built, want)
  assert all(a.dtype == b.dtype for a, b in zip(jax.tree.leaves(built),
                                                 jax.tree.leaves(want)))
  assert SamplingParams.from_arrays(0.5).batch_size == 1


def test_index_slice_replace_concatenate():
  p = SamplingParams.make(4, temperature=[0.1, 0.2, 0.3, 0.4],
                          top_k=[1, 2, 3, 4], top_p=[0.5, 0.6, 0.7, 0.8])
  one = p[2]
  assert float(one.temperature) == np.float32(0.3) and int(one.top_k) == 3
  assert p[1:3].batch_size == 2 and p[np.array([0, 3])].batch_size == 2
  assert [int(r.top_k) for r in p] == [1, 2, 3, 4]
  # A finished request's slot takes a new one's params.
  new = SamplingParams.make(1, temperature=2.0, top_k=9)
  swapped = p.replace_rows(1, new[0])
  np.testing.assert_array_equal(np.asarray(swapped.top_k), [1, 9, 3, 4])
  np.testing.assert_allclose(np.asarray(swapped.temperature),
                             [0.1, 2.0, 0.3, 0.4])
  np.testing.assert_allclose(np.asarray(swapped.top_p), [0.5, 1.0, 0.7, 0.8])
  masked = p.replace_rows(np.array([True, False, False, True]),
                          SamplingParams.make(2, top_k=[7, 8]))
  np.testing.assert_array_equal(np.asarray(masked.top_k), [7, 2, 3, 8])
  joined = SamplingParams.concatenate([p[0], p[2:], new])
  assert_same(joined, SamplingParams.make(
      4, temperature=[0.1, 0.3, 0.4, 2.0], top_k=[1, 3, 4, 9],
      top_p=[0.5, 0.7, 0.8, 1.0]))
  # Rows picked from the batch sample as the batch does (batch key rows
  # differ; per-request keys make rows independent of the batch).
  x, keys = logits(batch=4), jax.random.split(jax.random.key(3), 4)
  pos = jnp.arange(4)
  full = jaxsample.sample(x, p, keys, positions=pos, config="xla")
  part = jaxsample.sample(x[1:3], p[1:3], keys[1:3], positions=pos[1:3],
                          config="xla")
  np.testing.assert_array_equal(np.asarray(part.tokens),
                                np.asarray(full.tokens)[1:3])
  with pytest.raises(ValueError, match="at least one"):
    SamplingParams.concatenate([])


# ---------------------------------------------------------------------------
# config, jit, keys, positions.
# ---------------------------------------------------------------------------


def test_config_may_name_an_implementation():
  key = jax.random.key(2)
  assert_same(jaxsample.sample(logits(), SamplingParams.make(B), key,
                               config="xla"),
              jaxsample.sample(logits(), SamplingParams.make(B), key,
                               config=SamplerConfig(implementation="xla")))
  with pytest.raises(ValueError, match="config must be a SamplerConfig"):
    jaxsample.sample(logits(), SamplingParams.make(B), key, config="cuda")
  with pytest.raises(ValueError, match="config must be a SamplerConfig"):
    jaxsample.extract_sampling_mask(logits(), SamplingParams.make(B),
                                    config=3)


def test_jit_with_static_config_as_a_user_writes_it():
  sample = jax.jit(jaxsample.sample, static_argnames=("config", "return_mask"))
  config = SamplerConfig(implementation="xla", max_mask_ids=8)
  params = SamplingParams.make(B, top_k=4)
  key = jax.random.key(4)
  got, got_mask = sample(logits(), params, key, config=config,
                         return_mask=True)
  want, want_mask = jaxsample.sample(logits(), params, key, config=config,
                                     return_mask=True)
  assert_same((got, got_mask), (want, want_mask))
  assert_same(sample(logits(), params, key, config="xla"),
              jaxsample.sample(logits(), params, key, config="xla"))


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_rbg_keys_are_hashed_into_the_key_words(impl):
  key = jax.random.key(5, impl=impl)
  data = jax.random.key_data(key)
  assert data.shape == (4,)
  words = np.asarray(rng.key_words(key))
  want = np.asarray(jnp.stack(rng.threefry2x32(*data)))
  np.testing.assert_array_equal(words, want)
  np.testing.assert_array_equal(np.asarray(rng.key_words(data)), want)
  params = SamplingParams.make(B)
  a = jaxsample.sample(logits(), params, key, config="xla")
  b = jaxsample.sample(logits(), params, data, config="xla")
  assert_same(a, b)
  other = jaxsample.sample(logits(), params, jax.random.key(6, impl=impl),
                           config="xla")
  assert not np.array_equal(np.asarray(a.tokens), np.asarray(other.tokens))
  keys = jax.random.split(key, B)
  per_request = jaxsample.sample(logits(), params, keys,
                                 positions=jnp.zeros(B, jnp.int32),
                                 config="xla")
  assert np.asarray(per_request.valid).all()
  out = spec.rejection_sample(jnp.zeros((B, 2, V)), jnp.zeros((B, 1), jnp.int32),
                              jnp.ones(B, jnp.int32), params, keys,
                              positions=jnp.zeros(B, jnp.int32), config="xla")
  assert np.asarray(out.tokens)[:, 0].min() >= 0  # slot 0 is always emitted


def test_per_request_keys_need_positions():
  keys = jax.random.split(jax.random.key(7), B)
  with pytest.raises(ValueError, match="per-request keys need positions"):
    jaxsample.sample(logits(), SamplingParams.make(B), keys)
  with pytest.raises(ValueError, match="per-request keys need positions"):
    spec.rejection_sample(jnp.zeros((B, 2, V)), jnp.zeros((B, 1), jnp.int32),
                          jnp.ones(B, jnp.int32), SamplingParams.make(B), keys,
                          config="xla")


def test_negative_positions_rejected_when_concrete():
  keys = jax.random.split(jax.random.key(8), B)
  bad = jnp.int32([0, -1, 4])
  with pytest.raises(ValueError, match="positions must be >= 0"):
    jaxsample.sample(logits(), SamplingParams.make(B), keys, positions=bad)
  with pytest.raises(ValueError, match="positions must be >= 0"):
    spec.rejection_sample(jnp.zeros((B, 2, V)), jnp.zeros((B, 1), jnp.int32),
                          jnp.ones(B, jnp.int32), SamplingParams.make(B), keys,
                          positions=bad, config="xla")
  # Traced: modulo 2^32 (documented), so -1 is position 2^32 - 1.
  traced = jax.jit(lambda p: jaxsample.sample(
      logits(), SamplingParams.make(B), keys, positions=p, config="xla"))
  wrapped = jnp.asarray(np.uint32([0, 2**32 - 1, 4]))
  assert_same_across_programs(traced(bad), jaxsample.sample(
      logits(), SamplingParams.make(B), keys, positions=wrapped, config="xla"))


def test_concrete_out_of_range_draft_tokens_raise():
  args = (jnp.zeros((2, 3, V)), jnp.int32([[1, 2], [3, V]]),
          jnp.int32([2, 2]), SamplingParams.make(2), jax.random.key(0))
  with pytest.raises(ValueError, match=r"draft_tokens must be in \[0, V=50\)"):
    spec.rejection_sample(*args, config="xla")
  negative = (args[0], jnp.int32([[1, -1], [3, 4]])) + args[2:]
  with pytest.raises(ValueError, match="draft_tokens"):
    spec.rejection_sample(*negative, config="xla")
