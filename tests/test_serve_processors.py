"""Per-request logits processors in ``ServeLoop``: a request with penalties,
a logit bias, allowed/banned ids, min tokens or a ``bitmask_fn`` gets the
tokens and logprobs of the decode step serving it alone (processors from
``LogitsProcessors.make``, the grammar packed by ``pack_bitmask``); a
neighbour without processors is bit-identical to itself served beside
requests without processors; the speculative loop emits the plain greedy
tokens; bad input is refused at ``submit`` without disturbing requests in
flight.  One tiny model, V = 32, two slots (requests queue and reuse
slots)."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample as js
from jaxsample.generation.generate import FINISH_REASONS
from jaxsample._src.processors import pack_bitmask
from jaxsample.serve_loop import (DecodeState, NgramDrafter, ProcessorLimits,
                                  Request, ServeLoop, Speculation,
                                  decode_step, prefill)

from helpers.programs import CompileCounter
from helpers.toy_lm import tiny_transformer

# Batch-shape independent logits on a GPU (``conftest.full_precision``).
pytestmark = pytest.mark.usefixtures("full_precision")

CACHE, SLOTS, VOCAB, WIDTH, STOPS = 32, 2, 32, 16, 4
CONFIG = js.SamplerConfig(implementation="xla")
LIMITS = ProcessorLimits(logit_bias=4, allowed_token_ids=8, banned_token_ids=4,
                         bitmask=True)


@pytest.fixture(scope="module")
def model():
  return tiny_transformer(seed=0, vocab=VOCAB, max_len=CACHE, layers=1)


@pytest.fixture(scope="module")
def loop(model):
  return ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=CONFIG,
                   processors=LIMITS)


class Recorder:
  """A ``bitmask_fn`` that records the ids it is called with; ``rule(n)``
  gives the allowed ids after ``n`` tokens as bool ``[V]`` or, with
  ``packed``, as the one word of V = 32 (bit ``i`` allows id ``i``)."""

  def __init__(self, rule, packed=False):
    self.rule, self.packed, self.calls = rule, packed, []

  def __call__(self, ids):
    self.calls.append(list(ids))
    allowed = self.rule(len(ids))
    if not self.packed:
      return allowed
    word = sum(1 << int(i) for i in np.flatnonzero(allowed))
    return np.array([word], np.uint32).view(np.int32)


def every_third_banned(n):  # depends on the position: checks the ids given
  return (np.arange(VOCAB) + n) % 3 != 0


def low_half(n):
  del n
  return np.arange(VOCAB) < VOCAB // 2


def failing_at(calls):
  def fn(ids):
    if len(ids) >= calls:
      raise RuntimeError("grammar broke")
    return np.ones(VOCAB, bool)
  return fn


class SoloDecoder:
  """A request alone: ``prefill`` and jitted ``decode_step``s on ``SLOTS``
  rows (the loop's shapes) whose other rows are finished, its processors
  from ``LogitsProcessors.make`` (id tables padded to fixed widths), its
  grammar mask from ``pack_bitmask`` before each token."""

  def __init__(self, model, config=CONFIG):
    lm, weights = model
    self.lm, self.weights = lm, weights
    self.prefill = jax.jit(lambda s: prefill(lm, weights, s, config=config))
    self.step = jax.jit(lambda s: decode_step(lm, weights, s, config=config))

  def __call__(self, r: Request):
    prompt, stop = list(r.prompt), list(r.stop)
    rows = lambda first, rest: [first] + [rest] * (SLOTS - 1)
    processors = js.LogitsProcessors.make(
        SLOTS, repetition_penalty=rows(r.repetition_penalty, 1.0),
        presence_penalty=rows(r.presence_penalty, 0.0),
        frequency_penalty=rows(r.frequency_penalty, 0.0),
        logit_bias=rows(r.logit_bias and {
            int(i): b for i, b in r.logit_bias.items()}, None),
        allowed_token_ids=rows(r.allowed_token_ids, None),
        banned_token_ids=rows(r.banned_token_ids, None),
        min_tokens=rows(r.min_tokens, 0), stop_token_ids=rows(stop, None),
        prompt_token_ids=rows(prompt, None), history_width=CACHE,
        bitmask=np.full((SLOTS, 1), -1, np.int32))
    widen = lambda name, width, fill=-1: np.pad(  # one shape: one compile
        getattr(processors, name), ((0, 0), (0, width - np.shape(getattr(
            processors, name))[1])), constant_values=fill)
    processors = dataclasses.replace(processors, **{
        name: widen(name, width) for name, width in (
            ("bias_ids", 4), ("allowed_ids", 8), ("banned_ids", 4),
            ("stop_ids", STOPS), ("prompt_ids", WIDTH))},
        bias_values=widen("bias_values", 4, 0.0))
    tokens = np.zeros((SLOTS, WIDTH), np.int32)
    tokens[0, :len(prompt)] = prompt
    budget = min(r.max_tokens, CACHE - len(prompt))
    stop_ids = np.full((SLOTS, STOPS), -1, np.int32)
    stop_ids[0, :len(stop)] = stop
    state = DecodeState(
        tokens=jnp.asarray(tokens),
        positions=jnp.asarray(rows(len(prompt) - 1, 0), jnp.int32),
        keys=jnp.asarray(rows(np.array([0, r.seed], np.uint32),
                              np.zeros(2, np.uint32))),
        params=js.SamplingParams.make(
            SLOTS, **{f: rows(getattr(r, f), 0.0 if f != "top_p" else 1.0)
                      for f in ("temperature", "top_k", "top_p", "min_p")}),
        finished=jnp.asarray(rows(budget <= 0, True)),
        stop_tokens=jnp.asarray(stop_ids),
        remaining=jnp.asarray(rows(budget, 0), jnp.int32),
        cache=self.lm.init_cache(self.weights, SLOTS, CACHE),
        processors=processors)
    out_tokens, out_logprobs, program = [], [], self.prefill
    while True:
      if r.bitmask_fn is not None:
        allowed = np.asarray(r.bitmask_fn(list(out_tokens)))
        bitmask = np.full((SLOTS, 1), -1, np.int32)
        bitmask[0] = (pack_bitmask(allowed[None]) if allowed.dtype == bool
                      else allowed)
        state = dataclasses.replace(state, processors=dataclasses.replace(
            state.processors, bitmask=jnp.asarray(bitmask)))
      state, out = program(state)
      program = self.step
      if out.valid[0]:
        out_tokens.append(int(out.tokens[0]))
        out_logprobs.append(float(out.logprobs[0]))
      if state.finished[0]:
        break
    reason = (0 if out_tokens and out_tokens[-1] in stop else
              1 if len(out_tokens) >= budget else 2)
    return out_tokens, out_logprobs, FINISH_REASONS[reason]


BASE = [Request(prompt=[3, 1, 4, 1, 5], max_tokens=10, seed=11, request_id="a"),
        Request(prompt=[2, 7], max_tokens=8, temperature=0.0, seed=0,
                request_id="b"),
        Request(prompt=[9, 9, 2], max_tokens=9, seed=12, temperature=0.8,
                top_k=5, request_id="c"),
        Request(prompt=[6], max_tokens=7, seed=13, temperature=1.2,
                request_id="d"),
        Request(prompt=[8, 1], max_tokens=8, seed=14, top_p=0.9,
                request_id="e")]


@pytest.fixture(scope="module")
def served(loop):
  """The requests without processors, then with them (built from what the
  first run emitted, so each processor binds; one neighbour without) and
  two failing grammars: ``base`` and ``done`` completions by id,
  ``requests``, ``calls`` (the ids each ``Recorder`` got, by id) and
  ``compiles`` (XLA compilations in the second run)."""
  with jax.default_matmul_precision("highest"):  # as the tests (GPU)
    return _served(loop)


def _served(loop):
  base = {c.request_id: c for c in loop.run(BASE)}
  a, b = base["a"].token_ids, base["b"].token_ids
  requests = [
      dataclasses.replace(  # bans the first two tokens it sampled
          BASE[0], banned_token_ids=sorted(set(a))[:2],
          repetition_penalty=1.3, presence_penalty=0.5,
          frequency_penalty=0.3, logit_bias={7: 3.0, 0: -100.0}),
      dataclasses.replace(  # stops on its greedy first token, after 3
          BASE[1], stop=[b[0], 30], min_tokens=3, repetition_penalty=1.5),
      dataclasses.replace(
          BASE[2], allowed_token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
          logit_bias={"4": 5.0}, bitmask_fn=Recorder(every_third_banned)),
      BASE[3],  # no processors: the neighbour
      dataclasses.replace(BASE[4], frequency_penalty=1.0,
                          bitmask_fn=Recorder(low_half, packed=True)),
      Request(prompt=[5, 5], seed=1, request_id="fails later",
              bitmask_fn=failing_at(2)),
      Request(prompt=[4], seed=2, request_id="fails first",
              bitmask_fn=lambda ids: np.ones(VOCAB + 1, bool))]
  with CompileCounter() as compiles:
    done = {c.request_id: c for c in loop.run(requests)}
  calls = {r.request_id: list(r.bitmask_fn.calls) for r in requests
           if isinstance(r.bitmask_fn, Recorder)}
  return types.SimpleNamespace(base=base, requests=requests, done=done,
                               calls=calls, compiles=compiles.count)


@pytest.fixture(scope="module")
def solo(model):
  return SoloDecoder(model)


def assert_solo(solo, served):
  requests, done = served.requests, served.done
  for r in requests[:5]:
    tokens, logprobs, reason = solo(r)
    assert done[r.request_id].token_ids == tokens, r.request_id
    assert done[r.request_id].finish_reason == reason, r.request_id
    # The same math; XLA fuses the loop's scan differently: an ulp or two.
    np.testing.assert_allclose(done[r.request_id].logprobs, logprobs,
                               rtol=1e-6, atol=1e-7, err_msg=r.request_id)


def test_processed_requests_match_the_decode_step_alone(solo, served):
  assert_solo(solo, served)


@pytest.mark.gpu
def test_kernels_serve_processed_requests_as_the_decode_step_alone(model):
  """The same on the Pallas kernels (the processed rows reach them)."""
  config = js.SamplerConfig(implementation="pallas")
  loop = ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=config,
                   processors=LIMITS)
  served = _served(loop)
  assert_solo(SoloDecoder(model, config), served)
  assert served.done["fails later"].finish_reason == "error"


def test_processors_bind_and_a_neighbour_without_them_is_unaffected(served):
  """Each processor changes its request's tokens and holds (banned ids,
  min tokens, the grammar, allowed ids); the neighbour's tokens and
  logprobs are those it had beside requests without processors; nothing
  compiled for the processors."""
  assert served.compiles == 0
  base, requests, done = served.base, served.requests, served.done
  neighbour = done["d"]
  assert neighbour.token_ids == base["d"].token_ids
  assert neighbour.logprobs == base["d"].logprobs  # bit for bit
  for r in requests[:3] + requests[4:5]:  # each processed request changed
    assert done[r.request_id].token_ids != base[r.request_id].token_ids
  assert not set(requests[0].banned_token_ids) & set(done["a"].token_ids)
  assert 0 not in done["a"].token_ids
  b = done["b"]  # min_tokens: the stop id is held back for 3 tokens
  assert base["b"].token_ids[0] == requests[1].stop[0]
  assert len(b.token_ids) >= 3
  assert not set(b.token_ids[:3]) & set(requests[1].stop)
  for r in (requests[2], requests[4]):
    tokens = done[r.request_id].token_ids
    assert served.calls[r.request_id] == [tokens[:i]
                                          for i in range(len(tokens))]
    assert all(r.bitmask_fn.rule(i)[t] for i, t in enumerate(tokens))
  assert set(done["c"].token_ids) <= set(requests[2].allowed_token_ids)


def test_a_failing_bitmask_fn_ends_its_request_alone(served):
  done = served.done
  later, first = done["fails later"], done["fails first"]
  assert later.finish_reason == first.finish_reason == "error"
  assert len(later.token_ids) == 2 and "grammar broke" in later.error
  assert first.token_ids == [] and "bool [32]" in first.error
  assert later.to_openai()["error"] == later.error


def test_speculative_loop_emits_the_plain_greedy_tokens(model, solo, served):
  """Greedy processed requests (every processor but the grammar) through
  the n-gram speculative loop: each request's plain greedy tokens alone,
  with drafts accepted."""
  requests = served.requests
  greedy = [dataclasses.replace(r, temperature=0.0, bitmask_fn=None)
            for r in requests[:5]]
  spec = ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=CONFIG,
                   processors=dataclasses.replace(LIMITS, bitmask=False),
                   speculation=Speculation(NgramDrafter(2)))
  got = spec.run(greedy)
  assert [c.token_ids for c in got] == [solo(r)[0] for r in greedy]
  assert sum(c.accepted for c in got) > 0


def test_bad_processor_input_is_refused_at_submit(model, loop, served):
  requests, done = served.requests, served.done
  good = requests[0]
  loop.submit(good)
  loop.step()
  bad = [(dict(logit_bias={1: 150.0}), r"logit_bias\[1\] = 150.0"),
         (dict(logit_bias={VOCAB: 1.0}), "logit_bias has token id 32 outside"),
         (dict(logit_bias={i: 1.0 for i in range(5)}),
          r"ProcessorLimits.logit_bias"),
         (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
         (dict(logit_bias=[1, 2]), "logit_bias must be a mapping"),
         (dict(banned_token_ids=[40]), "banned_token_ids has token id 40"),
         (dict(banned_token_ids=list(range(5))), "at most 4"),
         (dict(allowed_token_ids=[]), "allowed_token_ids must list"),
         (dict(repetition_penalty=0.0), "repetition_penalty must be"),
         (dict(presence_penalty=float("nan")), "presence_penalty must be"),
         (dict(frequency_penalty="1"), "frequency_penalty must be"),
         (dict(min_tokens=-1), "min_tokens must be"),
         (dict(min_tokens=good.max_tokens + 1), "min_tokens must be"),
         (dict(bitmask_fn=3), "bitmask_fn must be callable")]
  for change, message in bad:
    with pytest.raises(ValueError, match=message):
      loop.submit(dataclasses.replace(good, **change))
  with pytest.raises(ValueError, match=r"unknown request field\(s\) "
                     r"\['temprature'\]"):
    loop.submit({"prompt": [1], "temprature": 0.5})
  with pytest.raises(ValueError, match="presence_penalty needs a ServeLoop "
                     "built with processors="):
    ServeLoop(model, slots=SLOTS, cache_len=CACHE).submit(
        Request(prompt=[1], presence_penalty=0.5))
  with pytest.raises(ValueError, match="bitmask_fn needs .*bitmask=True"):
    ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=CONFIG,
              processors=ProcessorLimits()).submit(
                  Request(prompt=[1], bitmask_fn=low_half))
  for kw, message in ((dict(steps_per_call=2), "steps_per_call=1"),
                      (dict(speculation=Speculation(NgramDrafter(2))),
                       "plain decoding")):
    with pytest.raises(ValueError, match=message):
      ServeLoop(model, slots=SLOTS, cache_len=CACHE, processors=LIMITS, **kw)
  with pytest.raises(ValueError, match="ProcessorLimits.logit_bias"):
    ProcessorLimits(logit_bias=-1)
  as_json = dict(prompt=list(good.prompt), max_tokens=good.max_tokens,
                 seed=good.seed, request_id="json",
                 banned_token_ids=list(good.banned_token_ids),
                 repetition_penalty=1.3, presence_penalty=0.5,
                 frequency_penalty=0.3, logit_bias={"7": 3.0, "0": -100})
  loop.submit(as_json)
  finished = {e.request_id: e.completion for e in loop.events()
              if e.completion is not None}
  for rid in (good.request_id, "json"):
    assert finished[rid].token_ids == done[good.request_id].token_ids
    assert finished[rid].logprobs == done[good.request_id].logprobs
