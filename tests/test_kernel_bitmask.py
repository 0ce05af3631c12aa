"""A grammar bitmask read inside the kernels' passes
(``jaxsample/pallas/bitmask.py``, ``SamplerConfig.kernel_bitmask``): the
kernels with the in-kernel bitmask against the same kernels after the XLA
pre-pass (bit-identical) and against the XLA path."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample as js
from jaxsample._src import processors as procs
from jaxsample._src import backends
from jaxsample._src.pallas import bitmask, threshold

from helpers.processing_oracle import process_oracle

# V below a word edge (7 words and 7 ids of an 8th); C = 16 and K_cap = 32
# send top-k 40 and top-p rows to the window searches and a wide mask to
# its listing.
B, V = 8, 231
IN_KERNELS = js.SamplerConfig(implementation="pallas", kernel_bitmask=True,
                              max_candidates=16, max_mask_ids=32)
PRE_PASS = js.SamplerConfig(implementation="pallas", max_candidates=16,
                            max_mask_ids=32)
XLA = js.SamplerConfig(implementation="xla", max_mask_ids=32)


def bitmask_oracle(logits, words):
  """``process_oracle`` with the bitmask the only processor."""
  batch = logits.shape[0]
  none = [None] * batch
  return process_oracle(logits, dict(
      logit_bias=none, output_token_ids=none, prompt_token_ids=none,
      repetition_penalty=[1.0] * batch, frequency_penalty=[0.0] * batch,
      presence_penalty=[0.0] * batch, allowed_token_ids=none,
      banned_token_ids=none, bitmask=np.asarray(words),
      min_tokens=[0] * batch, stop_token_ids=[[]] * batch))


def bitmask_case():
  """Rows on a 1/8 grid (ties), ~60% allowed: 0 greedy with its argmax
  banned; 1 all banned but the last id (the edge word); 2 top-k 5; 3 top-p
  0.9; 4 min-p 0.05 with a NaN at a banned id; 5 no bitmask (all words -1,
  bits past V set), top-k 40; 6 all banned (invalid); 7 top-k 12 and top-p
  0.95.  Bits past V are set in every row's last word."""
  rng = np.random.default_rng(40)
  logits = (np.round(rng.normal(size=(B, V)) * 16) / 8).astype(np.float32)
  allowed = rng.random((B, V)) < 0.6
  allowed[0, np.argmax(logits[0])] = False
  allowed[1] = np.arange(V) == V - 1
  allowed[4, 17] = False
  logits[4, 17] = np.nan
  allowed[6] = False
  words = np.array(procs.pack_bitmask(allowed))
  words[:, -1] |= np.int32(-1 << (V % 32))
  words[5] = -1
  params = js.SamplingParams.make(
      B, temperature=[0.0, 1.0, 0.8, 0.8, 1.0, 1.0, 1.0, 1.3],
      top_k=[0, 0, 5, 0, 0, 40, 0, 12], top_p=[1, 1, 1, 0.9, 1, 1, 1, 0.95],
      min_p=[0, 0, 0, 0, 0.05, 0, 0, 0])
  return logits, jnp.asarray(words), params


@functools.cache
def sampler(config: js.SamplerConfig):
  """``sample`` with a bitmask (and its mask), jitted once per config."""
  return jax.jit(lambda logits, words, params, key: js.sample(
      logits, params, key, config=config, return_mask=True,
      processors=js.LogitsProcessors(bitmask=words)))


def test_kernel_logits_routes_only_a_lone_bitmask():
  """``MaskedLogits`` only for the kernels with ``kernel_bitmask`` and no
  processor but the bitmask (histories alone change nothing); otherwise
  the XLA pre-pass."""
  logits, words, _ = bitmask_case()
  lone = js.LogitsProcessors(bitmask=words)
  routed = backends.process_logits(logits, lone, IN_KERNELS)
  assert isinstance(routed, bitmask.MaskedLogits)
  assert routed.shape == (B, V) and routed.dtype == jnp.float32
  counted = js.LogitsProcessors.make(B, bitmask=words, history_width=4)
  assert isinstance(backends.process_logits(logits, counted, IN_KERNELS),
                    bitmask.MaskedLogits)
  want = bitmask_oracle(logits, words)
  for processors, config in [
      (lone, PRE_PASS), (lone, js.SamplerConfig(implementation="xla",
                                                kernel_bitmask=True)),
      (js.LogitsProcessors.make(B, bitmask=words, banned_token_ids=[[]] * B),
       IN_KERNELS)]:
    got = backends.process_logits(logits, processors, config)
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="ceil"):
    backends.process_logits(logits, js.LogitsProcessors(bitmask=words[:, 1:]),
                            IN_KERNELS)
  with pytest.raises(ValueError, match="kernel_bitmask must be a bool"):
    js.SamplerConfig(kernel_bitmask=1)


def test_xla_reads_of_masked_logits_match_the_oracle():
  """``unmasked`` (whole rows) and ``logits_at`` (a gather) read a
  disallowed id as -inf, ids past the last word's edge included."""
  logits, words, _ = bitmask_case()
  masked = bitmask.MaskedLogits(jnp.asarray(logits), words)
  want = bitmask_oracle(logits, words)
  np.testing.assert_array_equal(bitmask.unmasked(masked), want)
  ids = np.stack([np.arange(V)[::-1]] * B)
  np.testing.assert_array_equal(bitmask.logits_at(masked, jnp.asarray(ids)),
                                np.take_along_axis(want, ids, axis=-1))


@pytest.mark.kernels
@pytest.mark.slow  # the feature is off by default until a GPU run
def test_in_kernel_bitmask_equals_the_pre_pass_and_xla():
  """Tokens, logprobs and masks bit-identical between the kernels reading
  the bitmask and the kernels after the XLA pre-pass; tokens, validity and
  masks' ids equal to the XLA path's (logprobs within fp32 rounding: another
  summation order)."""
  logits, words, params = bitmask_case()
  key = jax.random.key(9)
  got = sampler(IN_KERNELS)(logits, words, params, key)
  want = sampler(PRE_PASS)(logits, words, params, key)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  (result, mask), (xla, xla_mask) = got, sampler(XLA)(logits, words, params,
                                                     key)
  z = bitmask_oracle(logits, words)
  assert not result.valid[6] and result.tokens[6] == 0
  assert result.tokens[1] == V - 1
  assert result.tokens[0] == np.argmax(z[0]) != np.argmax(logits[0])
  np.testing.assert_array_equal(result.valid, np.arange(B) != 6)
  assert np.all(np.isfinite(z[np.arange(B), result.tokens])[result.valid])
  np.testing.assert_array_equal(result.tokens, xla.tokens)
  np.testing.assert_array_equal(result.valid, xla.valid)
  np.testing.assert_allclose(result.logprobs, xla.logprobs, rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(mask.count, xla_mask.count)
  np.testing.assert_array_equal(mask.ids, xla_mask.ids)


@pytest.mark.kernels
def test_pivot_search_reads_the_bitmask():
  """The pivot search (which ``sample`` runs only where a window misses)
  finds on ``MaskedLogits`` the top-p threshold it finds on the pre-pass's
  rows."""
  logits, words, params = bitmask_case()
  params = dataclasses.replace(params.canonical(V),
                               top_p=jnp.full((B,), 0.7, jnp.float32))
  z = bitmask_oracle(logits, words)
  t = np.where(np.asarray(params.temperature) > 0, params.temperature, 1.0)
  row_max = jnp.asarray(np.max(z / t[:, None], axis=-1))
  active = jnp.isfinite(row_max) & (params.temperature > 0)
  floor = jnp.full((B,), -jnp.inf)
  search = jax.jit(functools.partial(threshold.pivot_threshold,
                                     config=IN_KERNELS, by_count=False))
  got = search(bitmask.MaskedLogits(jnp.asarray(logits), words), params,
               active, floor, row_max)
  want = search(jnp.asarray(z), params, active, floor, row_max)
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # the GPU run compiles these kernels (docs/testing.md, "Tiers")
def test_in_kernel_bitmask_lowers_to_triton(monkeypatch):
  """``sample`` with a mask and the in-kernel bitmask lowers to Triton IR
  for an abstract H100 (bf16, V not a multiple of 32): the same kernels as
  without a bitmask, each that reads the row also reading its words, and
  none reading an fp32 pre-processed row (the PTX compile and the run are
  the gpu test's)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                       num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  batch, vocab = 8, 151941
  width = procs.bitmask_width(vocab)

  def fn(x, words, temperature, top_k, top_p, min_p, key):
    return js.sample(x, js.SamplingParams(temperature, top_k, top_p, min_p),
                     key, return_mask=True,
                     config=js.SamplerConfig(implementation="pallas",
                                             kernel_bitmask=True),
                     processors=js.LogitsProcessors(bitmask=words))

  S = jax.ShapeDtypeStruct
  args = (S((batch, vocab), jnp.bfloat16), S((batch, width), jnp.int32),
          S((batch,), jnp.float32), S((batch,), jnp.int32),
          S((batch,), jnp.float32), S((batch,), jnp.float32),
          S((2,), jnp.uint32))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(fn).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines()
           if "__gpu$xla.gpu.triton" in line]
  assert len(calls) == 21  # test_threshold.test_kernels_lower_to_triton's
  reads_row = [f"tensor<{batch}x{vocab}xbf16>" in line for line in calls]
  reads_words = [f"tensor<{batch}x{width}xi32>" in line for line in calls]
  assert sum(reads_row) >= 5 and reads_words == reads_row
  assert not any(f"tensor<{batch}x{vocab}xf32>" in line for line in calls)


@pytest.mark.gpu
def test_in_kernel_bitmask_lowers_and_matches_on_gpu(require_gpu):
  """On a GPU at serving size (V = 151936 + 5: a partial last word), fp32
  and bf16: ``sample`` (with and without a mask) and
  ``extract_sampling_mask`` with the in-kernel bitmask equal the kernels
  after the XLA pre-pass bit for bit."""
  batch, vocab = 128, 151941
  rng = np.random.default_rng(41)
  logits = rng.normal(size=(batch, vocab)).astype(np.float32) * 3
  allowed = rng.random((batch, vocab)) < 0.5
  allowed[:4] = True  # rows without a bitmask
  allowed[4] = np.arange(vocab) == vocab - 1  # one id: the last (greedy)
  allowed[5] = False  # invalid
  words = procs.pack_bitmask(allowed)
  params = js.SamplingParams.make(
      batch, temperature=rng.choice([0.0, 0.7, 1.0], batch).tolist(),
      top_k=rng.choice([0, 20, 50, 2000], batch).tolist(),
      top_p=rng.choice([1.0, 0.9, 0.95], batch).tolist(),
      min_p=rng.choice([0.0, 0.05], batch).tolist())
  key = jax.random.key(2)
  on = js.SamplerConfig(implementation="pallas", kernel_bitmask=True)
  off = js.SamplerConfig(implementation="pallas")
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(logits, dtype)
    runs = {}
    for name, config in (("on", on), ("off", off)):
      processors = js.LogitsProcessors(bitmask=words)
      runs[name] = jax.jit(lambda x, p=processors, c=config: (
          js.sample(x, params, key, config=c, return_mask=True, processors=p),
          js.sample(x, params, key, config=c, processors=p),
          js.extract_sampling_mask(x, params, config=c, processors=p)))(x)
    jax.tree.map(np.testing.assert_array_equal, runs["on"], runs["off"])
    (result, _), _, _ = runs["on"]
    assert not result.valid[5]
    assert result.valid[4] and result.tokens[4] == vocab - 1
