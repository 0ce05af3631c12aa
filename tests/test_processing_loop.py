"""Logits processing and top-n logprobs in the decode step (``emit`` with
``DecodeState.processors``) and in ``ServeLoop`` (``Request.top_logprobs``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample as js
from jaxsample import logprobs
from jaxsample.serve_loop import DecodeState, Request, ServeLoop, emit
from conftest import assert_chi2_fits, chi2_critical, chi2_statistic
from processing_oracle import process_oracle, rank_oracle, top_oracle
from toy_lm import tiny_transformer

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
