"""Logits processors against a numpy oracle and across backends
(``jaxsample/processors.py``, ``docs/processing.md``; in the decode loop:
``test_processing_loop.py``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample as js
from jaxsample._src import processors as procs, reference, spec

from helpers.processing_oracle import process_oracle as oracle, random_case

# Sort-based and sort-free XLA; the kernels (one Pallas interpret-mode
# compile costs ~45 CPU-s) in the gpu-marked twin at the end.
BACKENDS = ("xla", "xla_search")


@functools.cache
def jitted(fn, **static):
  """One compiled ``fn`` per static setting, shared by every case."""
  return jax.jit(functools.partial(fn, **static))


def assert_logits_match(got, want):
  got = np.asarray(got)
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  finite = np.isfinite(want)
  np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab,dtype", [(33, jnp.float32),
                                         (64, jnp.bfloat16),
                                         (100, jnp.float32)])
def test_apply_matches_the_oracle(vocab, dtype):
  """Every processor at once on random rows (V below, at and above word
  edges; bf16 logits are read exactly: half-integers)."""
  rng = np.random.default_rng(vocab)
  logits, kw = random_case(rng, 12, vocab)
  processors = js.LogitsProcessors.make(12, **kw)
  got = jitted(procs.apply_processors)(jnp.asarray(logits, dtype), processors)
  assert got.dtype == jnp.float32
  assert_logits_match(got, oracle(logits, kw))


def test_bitmask_layout_edge_words():
  vocab = 65  # words 0 and 1 full, word 2 holds id 64 alone
  allowed = np.zeros((3, vocab), bool)
  allowed[0, [0, 31]] = True
  allowed[1, [32, 63]] = True
  allowed[2, [64]] = True
  words = np.array(procs.pack_bitmask(allowed))
  assert words.shape == (3, 3)
  assert words[0, 0] == np.int32(-2**31 + 1) and words[1, 1] == np.int32(
      -2**31 + 1) and words[2, 2] == 1
  words[:, 2] |= ~1  # bits past V are ignored
  z = jitted(procs.apply_processors)(
      np.zeros((3, vocab), np.float32),
      js.LogitsProcessors(bitmask=jnp.asarray(words)))
  np.testing.assert_array_equal(np.isfinite(z), allowed)


def test_neutral_processors_change_nothing():
  logits = np.random.default_rng(0).normal(size=(4, 40)).astype(np.float32)
  z = jitted(procs.apply_processors)(logits, js.LogitsProcessors.make(
      4, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
      prompt_token_ids=[[1, 2]] * 4, output_token_ids=[[3, 3]] * 4))
  np.testing.assert_array_equal(z, logits)


def draws(logits, params, key, processors, z, *, impl):
  """``sample`` with processors and on the processed logits ``z``, with
  their masks' counts, and ``extract_sampling_mask``'s counts."""
  got, got_mask = js.sample(logits, params, key, config=impl,
                            processors=processors, return_mask=True)
  want, want_mask = js.sample(z, params, key, config=impl, return_mask=True)
  extracted = js.extract_sampling_mask(logits, params, config=impl,
                                       processors=processors)
  return got, got_mask.count, want, want_mask.count, extracted.count


def backends_case():
  """Random rows of every processor; row 6 fully masked, row 7 allowing
  one id."""
  batch, vocab = 8, 100
  rng = np.random.default_rng(7)
  logits, kw = random_case(rng, batch, vocab)
  logits = (logits + rng.normal(size=logits.shape)).astype(np.float32)
  kw["allowed_token_ids"][6:] = [[3], [3]]
  kw["banned_token_ids"][6:] = [[3], None]
  kw["bitmask"][6:] = -1
  kw["min_tokens"][6:] = [0, 0]
  logits[7, 3] = 0.0
  processors = js.LogitsProcessors.make(batch, **kw)
  params = js.SamplingParams.make(
      batch, temperature=[0.0, 0.7, 1.0, 1.3, 1.0, 0.9, 1.0, 2.0],
      top_k=[0, 0, 5, 0, 3, 0, 0, 50], top_p=[1, 1, 1, 0.8, 0.9, 1, 1, 0.95],
      min_p=[0, 0, 0, 0, 0, 0.1, 0, 0])
  return logits, processors, params, jax.random.key(3)


def test_backends_draw_identical_tokens():
  """Each backend with ``processors=`` equals itself on the processed logits
  (tokens, logprobs, masks), and all backends draw the same tokens.  The
  processed logits are fp32 whatever the input dtype (bf16 input:
  ``test_apply_matches_the_oracle``), so fp32 covers every kernel path.
  Row 6 is fully masked (invalid: token 0, logprob -inf), row 7 allows one
  id (its point mass: logprob 0)."""
  logits, processors, params, key = backends_case()
  batch = logits.shape[0]
  z = jitted(procs.apply_processors)(logits, processors)
  results = []
  for impl in BACKENDS:
    got, got_count, want, want_count, extracted = jitted(draws, impl=impl)(
        logits, params, key, processors, z)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    np.testing.assert_array_equal(got_count, want_count)
    np.testing.assert_array_equal(extracted, want_count)
    np.testing.assert_array_equal(got.valid, np.isfinite(z).any(axis=-1))
    assert got.valid[7] and not got.valid[6], impl
    assert got.tokens[6] == 0 and got.tokens[7] == 3 and got.logprobs[7] == 0
    results.append(got)
  for other in results[1:]:
    np.testing.assert_array_equal(other.tokens, results[0].tokens)
    np.testing.assert_array_equal(other.valid, results[0].valid)
    np.testing.assert_allclose(other.logprobs, results[0].logprobs, rtol=1e-5,
                               atol=1e-5)
  assert np.all(np.isfinite(z[np.arange(batch), results[0].tokens])
                | ~np.asarray(results[0].valid))


def test_traced_out_of_range_values_are_defined():
  processors = js.LogitsProcessors(
      repetition_penalty=jnp.array([0.0, jnp.nan]),
      presence_penalty=jnp.array([jnp.inf, 0.0]),
      frequency_penalty=jnp.array([jnp.nan, 0.0]),
      bias_ids=jnp.array([[1], [1]]), bias_values=jnp.array([[jnp.nan], [1e9]]),
      output_ids=jnp.array([[1, -1], [1, 1]]))
  z = jax.jit(procs.apply_processors)(jnp.ones((2, 4)), processors)
  np.testing.assert_array_equal(z, [[1, 1, 1, 1], [1, 101, 1, 1]])


def test_bad_inputs_raise_naming_the_field():
  with pytest.raises(ValueError, match="repetition_penalty"):
    js.LogitsProcessors.make(2, repetition_penalty=0.0)
  with pytest.raises(ValueError, match="logit_bias"):
    js.LogitsProcessors.make(1, logit_bias=[{3: 101.0}])
  with pytest.raises(ValueError, match="min_tokens needs stop"):
    js.LogitsProcessors.make(1, min_tokens=3)
  with pytest.raises(ValueError, match="allowed_token_ids"):
    js.LogitsProcessors.make(1, allowed_token_ids=[[-2]])
  with pytest.raises(ValueError, match="ceil"):
    js.sample(jnp.zeros((1, 33)), js.SamplingParams.make(1), jax.random.key(0),
              processors=js.LogitsProcessors(bitmask=jnp.zeros((1, 1),
                                                               jnp.int32)))
  with pytest.raises(ValueError, match="presence_penalty"):
    procs.apply_processors(jnp.zeros((2, 8)), js.LogitsProcessors(
        presence_penalty=jnp.zeros(3)))
  with pytest.raises(ValueError, match="processors must be"):
    js.sample(jnp.zeros((1, 8)), js.SamplingParams.make(1), jax.random.key(0),
              processors={"repetition_penalty": 1.1})


def test_append_output_feeds_penalties_and_min_tokens():
  processors = js.LogitsProcessors.make(
      2, frequency_penalty=1.0, min_tokens=1, stop_token_ids=[[0], [0]],
      history_width=2)
  step = processors.append_output(jnp.array([4, 5]), jnp.array([True, False]))
  np.testing.assert_array_equal(step.output_ids, [[4, -1], [-1, -1]])
  z = jitted(procs.apply_processors)(jnp.zeros((2, 6)), step)
  np.testing.assert_array_equal(z, [[0, 0, 0, 0, -1, 0],
                                    [-np.inf, 0, 0, 0, 0, 0]])


def test_rejection_sample_processes_each_slot_with_its_drafts(impl="xla"):
  """Each target and draft slot against the oracle with the request's
  history plus the drafts before it; ``rejection_sample`` with processors
  equals itself on the processed logits (kernels: the gpu twin)."""
  batch, k, vocab = 3, 2, 40
  rng = np.random.default_rng(11)
  logits, kw = random_case(rng, batch, vocab)
  target = rng.normal(size=(batch, k + 1, vocab)).astype(np.float32)
  draft_logits = rng.normal(size=(batch, k, vocab)).astype(np.float32)
  drafts = rng.integers(0, vocab, (batch, k))
  kw["bitmask"][:] = -1  # every draft allowed: the slots stay comparable
  processors = js.LogitsProcessors.make(batch, **kw)
  slot_kw = lambda i: dict(kw, output_token_ids=[
      (kw["output_token_ids"][b] or []) + drafts[b, :i].tolist()
      for b in range(batch)], bitmask=kw["bitmask"])
  want_target = np.stack([oracle(target[:, i], slot_kw(i))
                          for i in range(k + 1)], axis=1)
  want_draft = np.stack([oracle(draft_logits[:, i], slot_kw(i))
                         for i in range(k)], axis=1)
  got_target, got_draft = jitted(procs.apply_to_slots)(
      processors, target, drafts, draft_logits)
  assert_logits_match(got_target, want_target)
  assert_logits_match(got_draft, want_draft)
  params = js.SamplingParams.make(batch, temperature=[0.0, 1.0, 0.8])
  args = (jnp.array([2, 1, 2]), params, jax.random.key(5))
  reject = jitted(spec.rejection_sample, config=impl)
  got = reject(target, drafts, *args, draft_logits=draft_logits,
               processors=processors)
  want = reject(got_target, drafts, *args, draft_logits=got_draft)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)


def test_processed_logits_reach_the_reference_processing():
  """``sample(processors=...)`` equals the reference on processed logits."""
  rng = np.random.default_rng(2)
  logits, kw = random_case(rng, 5, 50)
  processors = js.LogitsProcessors.make(5, **kw)
  params = js.SamplingParams.make(5, top_k=4).canonical(50)
  z = oracle(logits, kw)
  proc = jitted(reference.process)(jnp.asarray(z), params)
  got = jitted(js.extract_sampling_mask, config="xla")(
      logits, params, processors=processors)
  np.testing.assert_array_equal(got.count, np.sum(proc.keep, axis=-1))


@pytest.mark.gpu
def test_kernels_with_processors_match_xla(require_gpu):
  """The Pallas kernels with ``processors=``: ``sample`` (tokens, logprobs,
  masks), ``extract_sampling_mask`` and ``rejection_sample`` against the
  XLA path on the same processors."""
  logits, processors, params, key = backends_case()
  z = jitted(procs.apply_processors)(logits, processors)
  got, got_count, want, want_count, extracted = jitted(
      draws, impl="pallas")(logits, params, key, processors, z)
  ref = jitted(draws, impl="xla")(logits, params, key, processors, z)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.tokens, ref[0].tokens)
  np.testing.assert_array_equal(got.valid, ref[0].valid)
  np.testing.assert_allclose(got.logprobs, ref[0].logprobs, rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(got_count, want_count)
  np.testing.assert_array_equal(extracted, want_count)
  batch, k, vocab = 8, 2, 100
  rng = np.random.default_rng(11)
  target = rng.normal(size=(batch, k + 1, vocab)).astype(np.float32)
  draft_logits = rng.normal(size=(batch, k, vocab)).astype(np.float32)
  drafts = rng.integers(0, vocab, (batch, k))
  args = (drafts, jnp.full((batch,), k), params, key)
  results = [jitted(spec.rejection_sample, config=impl)(
      target, *args, draft_logits=draft_logits, processors=processors)
             for impl in ("pallas", "xla")]
  np.testing.assert_array_equal(results[0].tokens, results[1].tokens)
  np.testing.assert_array_equal(results[0].num_accepted,
                                results[1].num_accepted)
