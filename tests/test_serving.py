"""ServeLoop: continuous batching equals ``generate``; load, memory,
compilations, streaming, masks and bad requests (tiny models on every
backend; the embedded model on the kernels in GPU-marked cases)."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import serve_demo
from jaxsample._src.params import SamplerConfig, SamplingParams
from jaxsample.serve_loop import Request, ServeLoop, generate

from helpers.parametrize import on_gpu
from helpers.programs import CompileCounter
from helpers.toy_lm import tiny_transformer

# Batch-shape independent logits on a GPU (``conftest.full_precision``).
pytestmark = pytest.mark.usefixtures("full_precision")

CACHE = 32
SLOTS = 4  # every loop has 4 slots and admits 4: the tests share compilations
CONFIG = SamplerConfig(implementation="xla")
SETTINGS = [dict(temperature=0.0), dict(temperature=1.0),
            dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=5),
            dict(temperature=1.2, min_p=0.05)]


@pytest.fixture(scope="module")
def model():
  return tiny_transformer(seed=0, vocab=32, max_len=CACHE, layers=1)


def random_requests(rs, count, *, max_prompt=12, max_tokens=8):
  """``count`` requests with ids ``0 ..``, prompts of 1 to ``max_prompt``
  tokens (one bucket), random settings, budgets, stops and seeds."""
  requests = []
  for i in range(count):
    prompt = rs.integers(0, 32, rs.integers(1, max_prompt + 1)).tolist()
    stop = rs.integers(0, 32, rs.integers(0, 3)).tolist()
    requests.append(Request(
        prompt=prompt, max_tokens=int(rs.integers(1, max_tokens + 1)),
        seed=int(rs.integers(0, 2**32)), stop=stop, request_id=i,
        **SETTINGS[rs.integers(len(SETTINGS))]))
  return requests


def generate_all(model, requests, **kw):
  """``generate`` of ``requests`` in one batch, as ``to_openai`` choices."""
  params = SamplingParams.make(
      len(requests), **{f: [getattr(r, f) for r in requests]
                        for f in ("temperature", "top_k", "top_p", "min_p")})
  keys = jnp.stack([jax.random.key_data(jax.random.PRNGKey(r.seed))
                    for r in requests])
  result = generate(model, [r.prompt for r in requests], params=params,
                    keys=keys, max_new_tokens=[r.max_tokens for r in requests],
                    stop_tokens=[list(r.stop) for r in requests],
                    config=CONFIG, cache_len=CACHE, **kw)
  return result.to_openai()


def assert_same(completion, choice):
  assert completion.token_ids == choice["token_ids"], completion.request_id
  assert completion.finish_reason == choice["finish_reason"]
  np.testing.assert_allclose(completion.logprobs, choice["logprobs"],
                             rtol=1e-5, atol=1e-5)


def run_with_arrivals(loop, requests, arrivals):
  """Submits request ``i`` before step ``arrivals[i]``; returns completions
  by id and the concatenated streamed tokens by id."""
  done, streamed = {}, {}
  order = np.argsort(arrivals, kind="stable")
  nxt, step = 0, 0
  while nxt < len(order) or loop.pending:
    while nxt < len(order) and arrivals[order[nxt]] <= step:
      loop.submit(requests[order[nxt]])
      nxt += 1
    for event in loop.step():
      streamed.setdefault(event.request_id, []).extend(event.token_ids)
      if event.completion is not None:
        assert event.request_id not in done, "completed twice"
        done[event.request_id] = event.completion
    step += 1
  return done, streamed


def test_matches_generate_in_any_arrival_order(model):
  rs = np.random.default_rng(1)
  requests = random_requests(rs, 8)
  expected = generate_all(model, requests)
  for trial in range(2):
    loop = ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=CONFIG)
    shuffled = [requests[i] for i in rs.permutation(len(requests))]
    arrivals = rs.integers(0, 10, len(requests)) if trial else np.zeros(8)
    done, streamed = run_with_arrivals(loop, shuffled, arrivals)
    assert sorted(done) == list(range(8))
    for r in requests:
      assert_same(done[r.request_id], expected[r.request_id])
      assert streamed.get(r.request_id, []) == done[r.request_id].token_ids


def test_steps_per_call_and_callbacks(model):
  rs = np.random.default_rng(2)
  requests = random_requests(rs, 6)
  expected = generate_all(model, requests)
  loop = ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=CONFIG,
                   steps_per_call=4)
  seen = {}
  for r in requests:
    loop.submit(r, callback=lambda e: seen.setdefault(e.request_id, []).append(
        e))
  list(loop.events())
  for r in requests:
    events = seen[r.request_id]
    assert events[-1].completion is not None
    assert sum(e.completion is not None for e in events) == 1
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == expected[r.request_id]["token_ids"]
    assert_same(events[-1].completion, expected[r.request_id])


def test_overlap_reads_one_call_behind_and_changes_no_output(model):
  """With ``overlap`` a ``step`` returns the previous call's events (none
  on the first); the completions equal those without it bit for bit; the
  loop's wait is part of its busy time; ``warmup`` refuses a busy loop."""
  requests = [dataclasses.replace(r, max_tokens=6)
              for r in random_requests(np.random.default_rng(6), 6)]
  done = {}
  for overlap in (False, True):
    loop = ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=CONFIG,
                     overlap=overlap)
    for r in requests:
      loop.submit(r)
    events = loop.step()
    assert bool(events) != overlap
    events += list(loop.events())
    done[overlap] = {e.request_id: e.completion for e in events
                     if e.completion is not None}
    assert 0 < loop.stats["wait_s"] < loop.stats["busy_s"]
  for r in requests:
    plain, overlapped = done[False][r.request_id], done[True][r.request_id]
    assert overlapped.token_ids == plain.token_ids
    assert overlapped.logprobs == plain.logprobs
    assert overlapped.finish_reason == plain.finish_reason
  loop.submit(requests[0])
  with pytest.raises(ValueError, match="before submitting requests"):
    loop.warmup()


def test_overlap_hands_on_the_slots_of_requests_ending_by_budget(model):
  """A request whose dispatched steps reach its budget frees its slot
  before its last outputs are read: with requests that end by their budget
  (no stop ids) the overlapped loop makes as many step calls as the loop
  without overlap, with the same completions (the default steps per
  call)."""
  requests = [dataclasses.replace(r, stop=(), max_tokens=3 + i)
              for i, r in enumerate(random_requests(np.random.default_rng(7),
                                                    10))]
  calls, done = {}, {}
  for overlap in (False, True):
    loop = ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=CONFIG,
                     overlap=overlap)
    done[overlap] = [(c.token_ids, c.logprobs, c.finish_reason)
                     for c in loop.run(requests)]
    calls[overlap] = loop.stats["step_calls"]
  assert done[True] == done[False]
  assert calls[True] == calls[False], calls


def mask_workload(request, which: str):
  """``(model, requests, config, cache_len, atol)``: six random requests on
  the tiny model (every other one asking for masks, ``max_mask_ids`` 8: some
  overflow), or eight of the serving demo's on the embedded model and the
  kernels (``atol`` for logprobs and logZ)."""
  if which == "tiny":
    rs = np.random.default_rng(3)
    requests = [dataclasses.replace(r, return_masks=bool(i % 2))
                for i, r in enumerate(random_requests(rs, 6))]
    return (request.getfixturevalue("model"), requests,
            dataclasses.replace(CONFIG, max_mask_ids=8), CACHE, 1e-5)
  model, tokenizer = request.getfixturevalue("embedded")
  demo = [(serve_demo.PROMPTS[i % len(serve_demo.PROMPTS)],
           serve_demo.SETTINGS[i % len(serve_demo.SETTINGS)][1])
          for i in range(8)]
  requests = [Request(prompt=tokenizer.encode(text).ids, max_tokens=32,
                      seed=i, request_id=i, stop=[0], return_masks=True,
                      **setting) for i, (text, setting) in enumerate(demo)]
  return (model, requests,
          SamplerConfig(implementation="pallas", max_mask_ids=64), None, 1e-4)


@pytest.mark.kernels
@pytest.mark.parametrize("which", ["tiny", on_gpu("embedded")])
def test_masks_match_generate(request, which):
  model, requests, config, cache_len, atol = mask_workload(request, which)
  expected = generate(
      model, [r.prompt for r in requests],
      params=SamplingParams.make(len(requests), **{
          f: [getattr(r, f) for r in requests]
          for f in ("temperature", "top_k", "top_p", "min_p")}),
      keys=jnp.stack([jax.random.key_data(jax.random.PRNGKey(r.seed))
                      for r in requests]),
      max_new_tokens=[r.max_tokens for r in requests],
      stop_tokens=[list(r.stop) for r in requests], config=config,
      return_masks=True, cache_len=cache_len).to_openai()
  loop = ServeLoop(model, slots=SLOTS, cache_len=cache_len, config=config,
                   return_masks=True)
  cap = config.max_mask_ids
  for r, done, choice in zip(requests, loop.run(requests), expected):
    assert done.token_ids == choice["token_ids"]
    np.testing.assert_allclose(done.logprobs, choice["logprobs"], atol=atol)
    if not r.return_masks:
      assert done.sampling_mask is None and done.logz is None
      continue
    assert done.sampling_mask == choice["sampling_mask"]
    np.testing.assert_allclose(done.logz, choice["logz"], rtol=1e-5,
                               atol=atol)
    for token, ids in zip(done.token_ids, done.sampling_mask):
      if isinstance(ids, dict):  # more than max_mask_ids kept: flagged
        assert ids["overflow"] and ids["count"] > cap and len(ids["ids"]) == cap
      else:
        assert ids is None or token in ids
    assert done.to_openai()["sampling_mask"] == done.sampling_mask


def test_demo_prints_acceptance_only_over_drafts():
  """serve_demo's acceptance: ``-`` without drafts (``--spec none``, or an
  n-gram drafter that matched nothing: no ``nan``), else the ratio and how
  many drafts it is over."""
  assert serve_demo.acceptance(0, 0) == "-"
  assert serve_demo.acceptance(2, 2) == "1.00 of 2 drafts"
  assert serve_demo.acceptance(3, 8) == "0.38 of 8 drafts"


def test_bad_requests_rejected_without_disturbing_others(model):
  rs = np.random.default_rng(4)
  requests = random_requests(rs, 5)
  expected = generate_all(model, requests)
  loop = ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=CONFIG)
  for r in requests:
    loop.submit(r)
  loop.step()
  good = requests[0]
  bad = [(dict(prompt=[]), "prompt must be a non-empty"),
         (dict(prompt=[1] * CACHE), "at most 31 fit the cache"),
         (dict(prompt=[1, 32]), "prompt has token id 32 outside"),
         (dict(stop=[-1]), "stop has token id -1 outside"),
         (dict(stop=[1, 2, 3, 4, 5]), "max_stop_tokens"),
         (dict(max_tokens=-1), "max_tokens must be"),
         (dict(seed=2**32), "seed must be"),
         (dict(temperature=-1.0), "temperature"),
         (dict(top_p=0.0), "top_p"),
         (dict(return_masks=True), "return_masks=True")]
  for change, message in bad:
    with pytest.raises(ValueError, match=message):
      loop.submit(dataclasses.replace(good, **change))
  done = {e.request_id: e.completion for e in loop.events() if e.completion}
  for r in requests:
    assert_same(done[r.request_id], expected[r.request_id])


def test_load_1000_requests(model):
  """1,000 requests with random settings, lengths and arrival times in 4
  waves: none lost or duplicated, streams equal completions, 50 random ones
  equal their solo ``generate`` runs; no compilation after warm-up; host
  memory and live device arrays do not grow from wave to wave."""
  rs = np.random.default_rng(5)
  requests = random_requests(rs, 1000, max_tokens=5)
  checked = set(rs.choice(1000, 50, replace=False).tolist())
  loop = ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=CONFIG)
  loop.warmup(max_prompt_len=12)
  completions = np.zeros(1000, np.int64)  # preallocated: no growth
  kept, live, heap = {}, [], []
  tracemalloc.start()
  try:
    with CompileCounter() as compiles:
      for wave in range(4):
        part = requests[wave * 250:(wave + 1) * 250]
        finished, streamed = run_with_arrivals(
            loop, part, rs.integers(0, 200, len(part)))
        for rid, completion in finished.items():
          completions[rid] += 1
          assert streamed.get(rid, []) == completion.token_ids
          assert len(completion.token_ids) <= requests[rid].max_tokens
          if rid in checked:
            kept[rid] = completion
        del finished, streamed
        gc.collect()
        live.append(len(jax.live_arrays()))
        heap.append(tracemalloc.get_traced_memory()[0])
  finally:
    tracemalloc.stop()
  assert compiles.count == 0
  assert np.all(completions == 1), "lost or duplicated requests"
  assert loop.stats["completed"] == 1000
  assert live[1:] == live[:-1], live
  # The loop keeps nothing of finished requests: once the caches (jit
  # dispatch, numpy) are warm the heap stays flat (50 kept completions
  # included).
  assert max(heap[1:]) - heap[1] < 256 * 1024, heap
  for i in sorted(checked):
    assert_same(kept[i], generate_all(model, [requests[i]])[0])
