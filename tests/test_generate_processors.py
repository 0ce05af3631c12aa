"""``generate(..., processors=)``: the tokens (and logprobs to rounding) of
a ``prefill`` + ``decode_step`` loop with the same processors and keys; a
request without processors is bit-identical to the batch without processors;
banned ids and a static bitmask hold; ``min_tokens`` holds the stop ids back;
one compile whichever requests use which processors; bad processors raise
naming the field.  One tiny model, V = 32, four requests (eight slots)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample as js
from jaxsample._src.processors import pack_bitmask
from jaxsample.serve_loop import DecodeState, decode_step, generate, prefill

from helpers.parametrize import on_gpu
from helpers.programs import CompileCounter
from helpers.toy_lm import bigram_lm, tiny_transformer

# Batch-shape independent logits on a GPU (``conftest.full_precision``).
pytestmark = pytest.mark.usefixtures("full_precision")

VOCAB, CACHE, SLOTS, WIDTH, STEPS = 32, 32, 8, 16, 16  # generate's buckets
XLA = js.SamplerConfig(implementation="xla")
PROMPTS = [[3, 1, 4, 1, 5], [2, 7], [9, 9, 2, 6], [6]]
BUDGETS = [10, 12, 9, 12]
STOP = 7  # request 3's stop id, biased by +100 and held back by min_tokens
MIN_TOKENS = 5
LOW = 24  # request 2's static bitmask allows ids below LOW
PARAMS = js.SamplingParams.make(4, temperature=[1.0, 1.2, 0.8, 0.0],
                                top_k=[0, 0, 8, 0])
KEYS = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 4)))
STOPS = [[], [30], [], [STOP]]


def make_processors(banned, rows=4, **extra):
  """Request 0 without processors, 1 penalties and a bias, 2 ``banned``
  ids and the static bitmask, 3 min tokens; ``rows - 4`` neutral padding
  rows; ``extra``: more ``make`` arguments (the decode-step loop's
  history)."""
  fill = lambda values, neutral: values + [neutral] * (rows - 4)
  allowed = np.ones((rows, VOCAB), bool)
  allowed[2, LOW:] = False
  return js.LogitsProcessors.make(
      rows, repetition_penalty=fill([1.0, 1.4, 1.0, 1.0], 1.0),
      presence_penalty=fill([0.0, 0.5, 0.0, 0.0], 0.0),
      frequency_penalty=fill([0.0, 0.3, 0.0, 0.0], 0.0),
      logit_bias=fill([None, {4: 3.0, 0: -100.0}, None, {STOP: 100.0}], None),
      banned_token_ids=fill([None, None, banned, None], None),
      min_tokens=fill([0, 0, 0, MIN_TOKENS], 0),
      stop_token_ids=fill(STOPS, None), bitmask=pack_bitmask(allowed),
      **extra)


def run(model, processors, config=XLA):
  return generate(model, PROMPTS, params=PARAMS, keys=KEYS,
                  max_new_tokens=BUDGETS, stop_tokens=STOPS,
                  processors=processors, config=config)


def choices(out):
  return [(c["token_ids"], np.asarray(c["logprobs"], np.float32).tobytes(),
           c["finish_reason"]) for c in out.to_openai()]


@pytest.fixture(scope="module")
def model():
  return tiny_transformer(seed=0, vocab=VOCAB, max_len=CACHE, layers=1)


@pytest.fixture(scope="module")
def runs(model):
  """``(base, banned, processed)``: the batch without processors, request
  2's ban list (the first four ids it sampled there, so the ban binds) and
  the batch with ``make_processors(banned)``."""
  with jax.default_matmul_precision("highest"):  # as the tests (GPU)
    base = run(model, None)
    banned = sorted(set(base.to_openai()[2]["token_ids"]))[:4]
    return base, banned, run(model, make_processors(banned))


def step_loop(model, processors, config):
  """Each request's ``(tokens, logprobs)`` from ``prefill`` and jitted
  ``decode_step``s on generate's shapes (``SLOTS`` rows, the padding
  finished) with ``processors`` as given."""
  lm, weights = model
  tokens = np.zeros((SLOTS, WIDTH), np.int32)
  stop_ids = np.full((SLOTS, 4), -1, np.int32)
  for b, (prompt, stop) in enumerate(zip(PROMPTS, STOPS)):
    tokens[b, :len(prompt)] = prompt
    stop_ids[b, :len(stop)] = stop
  pad = lambda a, fill: np.concatenate(
      [np.asarray(a), np.full((SLOTS - 4,) + np.shape(a)[1:], fill,
                              np.asarray(a).dtype)])
  state = DecodeState(
      tokens=jnp.asarray(tokens),
      positions=jnp.asarray(pad([len(p) - 1 for p in PROMPTS], 0)),
      keys=jnp.asarray(pad(KEYS, 0)),
      params=jax.tree.map(lambda a: pad(a, 0), PARAMS),
      finished=jnp.asarray(pad([False] * 4, True)),
      stop_tokens=jnp.asarray(stop_ids),
      remaining=jnp.asarray(pad(BUDGETS, 0), jnp.int32),
      cache=lm.init_cache(weights, SLOTS, CACHE), processors=processors)
  first = jax.jit(lambda s: prefill(lm, weights, s, config=config))
  step = jax.jit(lambda s: decode_step(lm, weights, s, config=config))
  outputs = [([], []) for _ in PROMPTS]
  state, out = first(state)
  while True:
    for b, (ids, logprobs) in enumerate(outputs):
      if out.valid[b]:
        ids.append(int(out.tokens[b]))
        logprobs.append(np.float32(out.logprobs[b]))
    if np.all(state.finished):
      return outputs
    state, out = step(state)


@pytest.mark.kernels
@pytest.mark.parametrize("config", [XLA, on_gpu(None, id="default")],
                         ids=["xla", "default"])
def test_generate_equals_a_prefill_and_decode_step_loop(model, runs, config):
  """The decode-step loop's processors come from ``make`` on its eight
  rows with the prompts as ``prompt_token_ids`` and a history ``STEPS``
  wide: exactly generate's tokens (generate feeds those histories itself)
  and its logprobs to float32 rounding (a separately compiled program)."""
  banned = runs[1]
  out = runs[2] if config is XLA else run(model, make_processors(banned),
                                          config)
  processors = make_processors(banned, rows=SLOTS,
                               prompt_token_ids=PROMPTS + [None] * 4,
                               history_width=STEPS)
  expected = step_loop(model, processors, config)
  got = out.to_openai()
  for b, (ids, logprobs) in enumerate(expected):
    assert got[b]["token_ids"] == ids, b
    np.testing.assert_allclose(  # another program: XLA fuses differently
        got[b]["logprobs"], logprobs, rtol=1e-6, atol=1e-7, err_msg=str(b))


def test_a_request_without_processors_is_bit_identical(runs):
  """Request 0 has neutral processors beside processed neighbours: its
  tokens and logprobs equal the batch without processors bit for bit,
  while every processed request's differ."""
  base, _, processed = runs
  base, processed = choices(base), choices(processed)
  assert processed[0] == base[0]
  for b in (1, 2, 3):
    assert processed[b] != base[b], b


def test_banned_ids_and_the_static_bitmask_hold(runs):
  """Request 2 never emits its banned ids (the ids it sampled without
  processors) nor an id the bitmask clears (>= LOW)."""
  _, banned, processed = runs
  tokens = processed.to_openai()[2]["token_ids"]
  assert banned  # the ids it sampled without processors (``runs``)
  assert len(tokens) == BUDGETS[2]
  assert not set(tokens) & set(banned), (tokens, banned)
  assert max(tokens) < LOW, tokens


def test_min_tokens_holds_the_stop_id_back(model, runs):
  """Request 3 (greedy, its stop id biased by +100) emits exactly
  ``MIN_TOKENS`` other tokens, then the stop id, and finishes on it; with
  ``min_tokens`` 0 (same shapes: no compile) it emits the stop id first."""
  _, banned, processed = runs
  choice = processed.to_openai()[3]
  assert STOP not in choice["token_ids"][:MIN_TOKENS]
  assert choice["token_ids"][MIN_TOKENS:] == [STOP]
  assert choice["finish_reason"] == "stop"
  processors = make_processors(banned)
  processors = dataclasses.replace(
      processors, min_tokens=jnp.zeros_like(processors.min_tokens))
  with jax.default_matmul_precision("highest"):
    assert run(model, processors).to_openai()[3]["token_ids"] == [STOP]


def test_one_compile_whichever_requests_use_which_processors(model, runs):
  """The requests reordered with their processors (other rows, ban lists
  of another length within the bucket): no new compilation and each
  request's result unchanged."""
  _, banned, processed = runs
  order = [2, 0, 3, 1]
  one = make_processors(banned[:1])  # request 2 bans its first id only
  reordered = jax.tree.map(lambda a: np.asarray(a)[order], one)
  params = jax.tree.map(lambda a: a[np.asarray(order)], PARAMS)
  keys = KEYS[order]
  with jax.default_matmul_precision("highest"), CompileCounter() as compiles:
    out = generate(model, [PROMPTS[i] for i in order], params=params,
                   keys=keys, max_new_tokens=[BUDGETS[i] for i in order],
                   stop_tokens=[STOPS[i] for i in order],
                   processors=reordered, config=XLA)
  assert compiles.count == 0
  got, expected = choices(out), choices(processed)
  for position, b in enumerate(order):
    if b != 2:
      assert got[position] == expected[b], b
  assert not set(got[0][0]) & set(banned[:1])


@pytest.mark.parametrize("change, field", [
    (dict(presence_penalty=np.zeros(3, np.float32)), "presence_penalty"),
    (dict(banned_ids=np.zeros((4,), np.int32)), "banned_ids"),
    (dict(banned_ids=np.zeros((4, 2), np.float32)), "banned_ids"),
    (dict(bitmask=np.zeros((4, 2), np.int32)), "bitmask"),
    (dict(stop_ids=None), "min_tokens"),
    (dict(prompt_ids=np.zeros((4, 2), np.int32)), "prompt_ids"),
    (dict(output_ids=np.ones((4, 2), np.int32)), "output_ids"),
    (dict(num_output=np.ones(4, np.int32)), "num_output"),
])
def test_bad_processors_raise_naming_the_field(model, change, field):
  good = make_processors([1])
  with pytest.raises(ValueError, match=field):
    run(model, dataclasses.replace(good, **change))


def test_processors_of_another_type_raise(model):
  with pytest.raises(ValueError, match="processors must be LogitsProcessors"):
    run(model, {"presence_penalty": [0.5] * 4})


def test_a_bitmask_too_narrow_raises_for_a_model_of_unknown_vocabulary():
  """A ``FunctionLM`` does not know ``V``: the bitmask's width is checked
  when the loop is traced, with the same message."""
  model = bigram_lm(seed=0, vocab=VOCAB + 1)  # V = 33 needs 2 words
  with pytest.raises(ValueError, match="bitmask has 1 words"):
    generate(model, PROMPTS, params=PARAMS, keys=KEYS, max_new_tokens=2,
             processors=js.LogitsProcessors(bitmask=np.ones((4, 1), np.int32)),
             config=XLA, cache_len=CACHE)
