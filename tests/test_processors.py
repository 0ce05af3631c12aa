"""Logits processors against a numpy oracle, across backends and in a decode
loop (``jaxsample/processors.py``, ``docs/processing.md``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample as js
from jaxsample import processors as procs, reference, spec
from conftest import assert_chi2_fits, chi2_critical, chi2_statistic

BACKENDS = ("xla", "xla_search", "pallas")


def random_case(rng, batch, vocab):
  """Logits with ties, zeros and -inf entries, and per-request Python specs
  of every processor (lists with duplicates, empty rows, edge bitmask words)."""
  logits = (rng.integers(-6, 7, (batch, vocab)) / 2).astype(np.float32)
  logits[rng.random((batch, vocab)) < 0.1] = -np.inf
  ids = lambda n: [int(i) for i in rng.integers(0, vocab, n)]
  maybe = lambda make: [make() if rng.random() < 0.7 else None
                        for _ in range(batch)]
  words = rng.integers(-2**31, 2**31, (batch, procs.bitmask_width(vocab)))
  words[rng.random(words.shape) < 0.3] = -1  # all 32 ids allowed, past V too
  kw = dict(
      repetition_penalty=list(rng.uniform(0.5, 2.0, batch)),
      presence_penalty=list(rng.uniform(-1, 1, batch)),
      frequency_penalty=list(rng.uniform(-1, 1, batch)),
      logit_bias=maybe(lambda: {i: float(rng.uniform(-5, 5)) for i in ids(3)}),
      allowed_token_ids=maybe(lambda: ids(rng.integers(1, 8))),
      banned_token_ids=maybe(lambda: ids(2)),
      min_tokens=[int(v) for v in rng.integers(0, 4, batch)],
      stop_token_ids=[ids(2) for _ in range(batch)],
      prompt_token_ids=maybe(lambda: ids(6)),
      output_token_ids=maybe(lambda: ids(rng.integers(0, 6))),
      history_width=8,
      bitmask=words.astype(np.int32))
  return logits, kw


def oracle(logits, kw):
  """The module doc's math, row by row in numpy float32."""
  z = np.array(logits, np.float32)
  batch, vocab = z.shape
  for b in range(batch):
    for i, v in (kw["logit_bias"][b] or {}).items():
      z[b, i] += np.float32(v)
    out = kw["output_token_ids"][b] or []
    counts = np.bincount(np.asarray(out, int), minlength=vocab)[:vocab]
    seen = counts > 0
    seen[kw["prompt_token_ids"][b] or []] = True
    rep = np.float32(kw["repetition_penalty"][b])
    z[b] = np.where(seen, np.where(z[b] > 0, z[b] / rep, z[b] * rep), z[b])
    z[b] -= np.float32(kw["frequency_penalty"][b]) * counts.astype(np.float32)
    z[b] -= np.float32(kw["presence_penalty"][b]) * (counts > 0)
    keep = np.ones(vocab, bool)
    if kw["allowed_token_ids"][b]:
      keep[:] = False
      keep[kw["allowed_token_ids"][b]] = True
    keep[kw["banned_token_ids"][b] or []] = False
    words = kw["bitmask"][b].astype(np.int64) & 0xFFFFFFFF
    keep &= [(words[v // 32] >> (v % 32)) & 1 == 1 for v in range(vocab)]
    if len(out) < kw["min_tokens"][b]:
      keep[kw["stop_token_ids"][b]] = False
    z[b] = np.where(keep, z[b], -np.inf)
  return z


def assert_logits_match(got, want):
  got = np.asarray(got)
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  finite = np.isfinite(want)
  np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab", [33, 64, 100])
def test_apply_matches_the_oracle(vocab):
  rng = np.random.default_rng(vocab)
  logits, kw = random_case(rng, 12, vocab)
  processors = js.LogitsProcessors.make(12, **kw)
  assert_logits_match(jax.jit(procs.apply_processors)(logits, processors),
                      oracle(logits, kw))


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
  z = procs.apply_processors(np.zeros((3, vocab), np.float32),
                             js.LogitsProcessors(bitmask=jnp.asarray(words)))
  np.testing.assert_array_equal(np.isfinite(z), allowed)


def test_neutral_processors_change_nothing():
  logits = np.random.default_rng(0).normal(size=(4, 40)).astype(np.float32)
  z = procs.apply_processors(logits, js.LogitsProcessors.make(
      4, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
      prompt_token_ids=[[1, 2]] * 4, output_token_ids=[[3, 3]] * 4))
  np.testing.assert_array_equal(z, logits)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backends_draw_identical_tokens(dtype):
  batch, vocab = 8, 100
  rng = np.random.default_rng(7)
  logits, kw = random_case(rng, batch, vocab)
  logits = jnp.asarray(logits + rng.normal(size=logits.shape), dtype)
  processors = js.LogitsProcessors.make(batch, **kw)
  params = js.SamplingParams.make(
      batch, temperature=[0.0, 0.7, 1.0, 1.3, 1.0, 0.9, 1.0, 2.0],
      top_k=[0, 0, 5, 0, 3, 0, 0, 50], top_p=[1, 1, 1, 0.8, 0.9, 1, 1, 0.95],
      min_p=[0, 0, 0, 0, 0, 0.1, 0, 0])
  key = jax.random.key(3)
  z = procs.apply_processors(logits, processors)
  results = []
  for impl in BACKENDS:
    got, got_mask = js.sample(logits, params, key, config=impl,
                              processors=processors, return_mask=True)
    want, want_mask = js.sample(z, params, key, config=impl, return_mask=True)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    np.testing.assert_array_equal(got_mask.count, want_mask.count)
    extracted = js.extract_sampling_mask(logits, params, config=impl,
                                         processors=processors)
    np.testing.assert_array_equal(extracted.count, want_mask.count)
    results.append(got)
  for other in results[1:]:
    np.testing.assert_array_equal(other.tokens, results[0].tokens)
    np.testing.assert_array_equal(other.valid, results[0].valid)
    np.testing.assert_allclose(other.logprobs, results[0].logprobs, rtol=1e-5,
                               atol=1e-5)
  assert np.all(np.isfinite(z[np.arange(batch), results[0].tokens])
                | ~np.asarray(results[0].valid))


def test_fully_masked_row_is_invalid_with_an_in_range_token():
  processors = js.LogitsProcessors.make(2, allowed_token_ids=[[3], [3]],
                                        banned_token_ids=[[3], None])
  logits = jnp.zeros((2, 10))
  for impl in BACKENDS:
    result = js.sample(logits, js.SamplingParams.make(2), jax.random.key(0),
                       config=impl, processors=processors)
    assert result.valid.tolist() == [False, True]
    assert result.tokens.tolist() == [0, 3]
    assert result.logprobs[1] == 0.0


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
  z = procs.apply_processors(jnp.zeros((2, 6)), step)
  np.testing.assert_array_equal(z, [[0, 0, 0, 0, -1, 0],
                                    [-np.inf, 0, 0, 0, 0, 0]])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_rejection_sample_processes_each_slot_with_its_drafts(impl):
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
  got_target, got_draft = procs.apply_to_slots(processors, target, drafts,
                                               draft_logits)
  assert_logits_match(got_target, want_target)
  assert_logits_match(got_draft, want_draft)
  params = js.SamplingParams.make(batch, temperature=[0.0, 1.0, 0.8])
  args = (jnp.array([2, 1, 2]), params, jax.random.key(5))
  got = spec.rejection_sample(target, drafts, *args, draft_logits=draft_logits,
                              config=impl, processors=processors)
  want = spec.rejection_sample(got_target, drafts, *args,
                               draft_logits=got_draft, config=impl)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)


def test_penalties_shape_a_two_step_decode_as_the_oracle_says():
  """Joint law of two decode steps from fixed logits: step 2's penalties
  come from step 1's token (``append_output``), so ``P(t1, t2) = p(t1)
  p(t2 | t1)`` with the oracle's penalized ``p(. | t1)``; a chi-square test
  at alpha 1e-3 on ``n`` draws, which also must reject the unpenalized law."""
  n, vocab = 40000, 5
  logits = np.array([1.0, 0.6, 0.3, -0.2, -1.0], np.float32)
  kw = dict(repetition_penalty=1.8, presence_penalty=0.4,
            frequency_penalty=0.3, prompt_token_ids=[[1]] * n, history_width=2)
  processors = js.LogitsProcessors.make(n, **kw)
  params = js.SamplingParams.make(n, temperature=1.0)
  x = jnp.broadcast_to(logits, (n, vocab))
  first = js.sample(x, params, jax.random.key(1), processors=processors)
  processors = processors.append_output(first.tokens, first.valid)
  second = js.sample(x, params, jax.random.key(2), processors=processors)

  def law(history):
    spec_kw = {name: [value] * 1 for name, value in kw.items()
               if name != "history_width"}
    spec_kw.update(prompt_token_ids=[[1]], output_token_ids=[history],
                   logit_bias=[None], allowed_token_ids=[None],
                   banned_token_ids=[None], min_tokens=[0],
                   stop_token_ids=[[]], bitmask=-np.ones((1, 1), np.int64))
    z = oracle(logits[None], spec_kw)[0].astype(np.float64)
    return np.exp(z - z.max()) / np.exp(z - z.max()).sum()

  p1 = law([])
  joint = np.concatenate([p1[t] * law([t]) for t in range(vocab)])
  cells = np.asarray(first.tokens) * vocab + np.asarray(second.tokens)
  assert_chi2_fits(cells, joint)
  plain = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
  stat, df = chi2_statistic(np.bincount(cells, minlength=vocab**2),
                            np.outer(plain, plain).ravel())
  assert stat > chi2_critical(df, 1e-3)


def test_processed_logits_reach_the_reference_processing():
  """``sample(processors=...)`` equals the reference on processed logits."""
  rng = np.random.default_rng(2)
  logits, kw = random_case(rng, 5, 50)
  processors = js.LogitsProcessors.make(5, **kw)
  params = js.SamplingParams.make(5, top_k=4).canonical(50)
  z = oracle(logits, kw)
  proc = reference.process(jnp.asarray(z), params)
  got = js.extract_sampling_mask(logits, params, config="xla",
                                 processors=processors)
  np.testing.assert_array_equal(got.count, np.sum(proc.keep, axis=-1))
