"""Logits processing and top-n logprobs in the decode step (``emit`` with
``DecodeState.processors``) and in ``ServeLoop`` (``Request.top_logprobs``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample as js
from jaxsample._src import logprobs
from jaxsample.generation.spec_step import write_history
from jaxsample.serve_loop import (DecodeState, FunctionLM, NgramDrafter,
                                  Request, ServeLoop, SpecState, decode_step,
                                  emit, prefill, spec_step)

from helpers.processing_oracle import process_oracle, rank_oracle, top_oracle
from helpers.stats import assert_chi2_fits, chi2_critical, chi2_statistic
from helpers.toy_lm import tiny_transformer

CONFIG = js.SamplerConfig(implementation="xla")


def decode_state(params, processors, *, budget=8):
  """A ``DecodeState`` of ``B`` fresh slots (no model: ``emit`` only)."""
  batch = params.batch_size
  keys = jax.random.key_data(jax.random.split(jax.random.key(9), batch))
  return DecodeState(
      tokens=jnp.zeros((batch,), jnp.int32),
      positions=jnp.zeros((batch,), jnp.int32), keys=keys, params=params,
      finished=jnp.zeros((batch,), bool),
      stop_tokens=jnp.full((batch, 1), -1, jnp.int32),
      remaining=jnp.full((batch,), budget, jnp.int32), cache=(),
      processors=processors)


def softmax(z):
  z = np.asarray(z, np.float64)
  e = np.exp(z - z.max())
  return e / e.sum()


def test_decode_step_penalties_shape_two_steps_as_the_oracle_says():
  """Joint law of two ``emit`` steps from fixed logits: step 2's penalties
  come from step 1's token (the state's history), so ``P(t1, t2) = p(t1)
  p(t2 | t1)`` with the oracle's penalized ``p(. | t1)``; a chi-square test
  at alpha 1e-3 on ``n`` slots, which also must reject the unpenalized law
  (the test's power)."""
  n, vocab = 10000, 5
  logits = np.array([1.0, 0.6, 0.3, -0.2, -1.0], np.float32)
  penalties = dict(repetition_penalty=1.8, presence_penalty=0.4,
                   frequency_penalty=0.3)
  processors = js.LogitsProcessors.make(n, **penalties,
                                        prompt_token_ids=[[1]] * n,
                                        history_width=2)
  state = decode_state(js.SamplingParams.make(n), processors)
  x = jnp.broadcast_to(logits, (n, vocab))
  step = jax.jit(lambda s: emit(s, x, config=CONFIG))
  state, first = step(state)
  state, second = step(state)
  assert np.all(first.valid) and np.all(second.valid)
  np.testing.assert_array_equal(
      state.processors.output_ids, np.stack([first.tokens, second.tokens], 1))

  def law(history):
    kw = {name: [value] for name, value in penalties.items()}
    kw.update(prompt_token_ids=[[1]], output_token_ids=[history],
              logit_bias=[None], allowed_token_ids=[None],
              banned_token_ids=[None], min_tokens=[0], stop_token_ids=[[]],
              bitmask=-np.ones((1, 1), np.int64))
    return softmax(process_oracle(logits[None], kw)[0])

  joint = np.concatenate([law([])[t] * law([t]) for t in range(vocab)])
  cells = np.asarray(first.tokens) * vocab + np.asarray(second.tokens)
  assert_chi2_fits(cells, joint)
  stat, df = chi2_statistic(np.bincount(cells, minlength=vocab**2),
                            np.outer(softmax(logits), softmax(logits)).ravel())
  assert stat > chi2_critical(df, 1e-3)


def test_decode_loop_holds_stop_ids_until_min_tokens():
  """In a ``lax.scan`` of ``emit`` (the carry keeps its structure): greedy
  slots whose argmax is a stop id emit the runner-up until ``min_tokens``
  tokens are out, then stop on the stop id."""
  logits = jnp.array([[0.0, 3.0, 2.0, 1.0]] * 2)
  processors = js.LogitsProcessors.make(
      2, min_tokens=[2, 0], stop_token_ids=[[1], [1]], history_width=4)
  state = decode_state(js.SamplingParams.make(2, temperature=0.0), processors)
  state = dataclasses.replace(state, stop_tokens=jnp.array([[1], [1]]))
  state, out = jax.lax.scan(lambda s, _: emit(s, logits, config=CONFIG),
                            state, None, length=4)
  np.testing.assert_array_equal(out.valid, [[1, 1], [1, 0], [1, 0], [0, 0]])
  np.testing.assert_array_equal(out.tokens[:3, 0], [2, 2, 1])
  assert out.tokens[0, 1] == 1
  np.testing.assert_array_equal(state.processors.num_output, [3, 1])
  np.testing.assert_array_equal(state.processors.output_ids,
                                [[2, 2, 1, -1], [1, -1, -1, -1]])
  assert bool(np.all(state.finished))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_emit_top_logprobs_are_token_logprobs(mode):
  rng = np.random.default_rng(5)
  logits = jnp.asarray(rng.normal(size=(4, 40)), jnp.float32)
  processors = js.LogitsProcessors.make(
      4, repetition_penalty=1.5, logit_bias=[{3: 5.0}] * 4, history_width=4)
  params = js.SamplingParams.make(4, temperature=[0.0, 1.0, 0.8, 1.0],
                                  top_k=[0, 0, 4, 0])
  state = decode_state(params, processors)
  _, out = jax.jit(lambda s: emit(s, logits, config=CONFIG, num_top=5,
                                  logprob_mode=mode))(state)
  want = logprobs.token_logprobs(logits, params, out.tokens, num_top=5,
                                 mode=mode, processors=processors)
  for name in ("token_ranks", "top_ids"):
    np.testing.assert_array_equal(getattr(out.top, name), getattr(want, name))
  for name in ("token_values", "top_values"):  # jit vs eager: an ulp apart
    np.testing.assert_allclose(getattr(out.top, name), getattr(want, name),
                               rtol=1e-6)
  if mode == "processed_logprobs":
    np.testing.assert_allclose(out.top.token_values, out.logprobs, atol=1e-5)


def test_serve_loop_streams_top_logprobs_of_the_model():
  """Raw top-3 logprobs of each streamed token against a full forward of
  the prompt and the tokens (numpy log-softmax, stable top-3, ranks)."""
  cache = 32
  lm, weights = tiny_transformer(seed=0, vocab=32, max_len=cache, layers=1)
  loop = ServeLoop((lm, weights), slots=2, cache_len=cache, config=CONFIG,
                   top_logprobs=3)
  requests = [Request(prompt=[3, 1, 4], max_tokens=5, seed=1,
                      top_logprobs=3, temperature=1.0),
              Request(prompt=[2, 7], max_tokens=4, seed=2, temperature=0.0),
              Request(prompt=[5], max_tokens=4, seed=3, top_logprobs=1,
                      temperature=0.0)]
  done = loop.run(requests)
  assert done[1].top_logprobs is None
  assert "top_logprobs" not in done[1].to_openai()
  for request, completion in zip(requests, done):
    if not request.top_logprobs:
      continue
    sequence = list(request.prompt) + completion.token_ids
    logits, _ = lm.apply(weights, jnp.asarray([sequence]),
                         jnp.arange(len(sequence))[None],
                         lm.init_cache(weights, 1, cache))
    rows = np.asarray(logits[0, len(request.prompt) - 1:-1], np.float64)
    want = rows - rows.max(-1, keepdims=True)
    want -= np.log(np.exp(want).sum(-1, keepdims=True))
    ids, values = top_oracle(want, request.top_logprobs)
    tokens = np.asarray(completion.token_ids)
    entries = completion.top_logprobs
    assert len(entries) == len(tokens) > 0
    assert [[i for i, _ in e["top"]] for e in entries] == ids.tolist()
    np.testing.assert_allclose([[v for _, v in e["top"]] for e in entries],
                               values, atol=1e-4)
    np.testing.assert_allclose([e["logprob"] for e in entries],
                               want[np.arange(len(tokens)), tokens], atol=1e-4)
    assert [e["rank"] for e in entries] == rank_oracle(want, tokens).tolist()
  assert all(e["rank"] == 1 for e in done[2].top_logprobs)  # greedy


def test_serve_loop_rejects_bad_top_logprobs():
  lm_weights = tiny_transformer(seed=0, vocab=32, max_len=16, layers=1)
  loop = ServeLoop(lm_weights, slots=1, cache_len=16, top_logprobs=2)
  for bad in (3, -1, True):
    with pytest.raises(ValueError, match="top_logprobs"):
      loop.submit(Request(prompt=[1], top_logprobs=bad))
  with pytest.raises(ValueError, match="logprobs_mode"):
    ServeLoop(lm_weights, slots=1, cache_len=16, logprobs_mode="logits")
  with pytest.raises(ValueError, match="num_top"):
    ServeLoop(lm_weights, slots=1, cache_len=16, top_logprobs=21)


def test_spec_step_with_processors_emits_the_plain_greedy_tokens():
  """Greedy slots with penalties, bias, banned ids and min tokens: the
  speculative step (n-gram drafts, processed slot by slot, each emitted
  token appended to the history) emits exactly the plain decode step's
  tokens."""
  batch, vocab, k, budget, cache = 3, 16, 2, 10, 32
  table = np.random.default_rng(8).normal(size=(vocab, vocab))
  table[np.arange(vocab), (np.arange(vocab) + 1) % 5] += 6  # a 5-cycle: drafts hit
  table = jnp.asarray(table, jnp.float32)
  lm = FunctionLM(lambda w, tokens, positions, c: (w[tokens], c),
                  lambda w, b, length: jnp.zeros((b, length)), max_len=cache,
                  vocab_size=vocab)
  prompts = jnp.array([[1, 2, 3], [4, 4, 0], [5, 0, 0]], jnp.int32)
  lengths = jnp.array([3, 2, 1], jnp.int32)
  processors = js.LogitsProcessors.make(
      batch, repetition_penalty=[1.5, 1.2, 2.0], frequency_penalty=0.2,
      presence_penalty=[0.0, 0.5, 0.2], logit_bias=[{7: 2.0}, None, {1: 1.0}],
      banned_token_ids=[[9], None, [3]], min_tokens=[3, 0, 2],
      stop_token_ids=[[0], [0], [0]], prompt_token_ids=[[1, 2, 3], [4, 4], [5]],
      history_width=budget + 1)
  start = DecodeState(
      tokens=prompts, positions=lengths - 1,
      keys=jnp.zeros((batch, 2), jnp.uint32),
      params=js.SamplingParams.make(batch, temperature=0.0),
      finished=jnp.zeros((batch,), bool),
      stop_tokens=jnp.full((batch, 1), -1, jnp.int32),
      remaining=jnp.full((batch,), budget, jnp.int32),
      cache=lm.init_cache(table, batch, cache + k), processors=processors)
  state, first = jax.jit(lambda s: prefill(lm, table, s, config=CONFIG))(start)
  plain = [[t] for t in first.tokens.tolist()]
  step = jax.jit(lambda s: decode_step(lm, table, s, config=CONFIG))
  decoding = state
  while not bool(np.all(decoding.finished)):
    decoding, out = step(decoding)
    for b in np.flatnonzero(out.valid):
      plain[b].append(int(out.tokens[b]))
  drafter = NgramDrafter(k)
  history = write_history(jnp.zeros((batch, cache + k), jnp.int32), prompts,
                          jnp.zeros_like(lengths), lengths)
  history = write_history(history, first.tokens[:, None], lengths,
                          jnp.ones_like(lengths))
  own = drafter.prefill(None, drafter.init(None, batch, cache + k), prompts,
                        lengths)
  spec_state = SpecState(state, history, own)
  spec = jax.jit(lambda s: spec_step(lm, table, drafter, None, s,
                                     config=CONFIG))
  emitted = [[t] for t in first.tokens.tolist()]
  accepted = 0
  while not bool(np.all(spec_state.decode.finished)):
    spec_state, out = spec(spec_state)
    accepted += int(out.accepted.sum())
    for b in range(batch):
      emitted[b] += out.tokens[b, :int(out.count[b])].tolist()
  assert emitted == plain
  assert accepted > 0  # the drafts were used
  assert all(len(p) > 1 for p in plain)
  np.testing.assert_array_equal(spec_state.decode.processors.output_ids,
                                decoding.processors.output_ids)
