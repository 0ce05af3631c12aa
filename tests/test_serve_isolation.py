"""No request harms another in ``ServeLoop``: malformed requests are refused
at ``submit`` by field name, requests that fail later (a raising callback,
a failing admission) end alone with finish reason ``"error"``, aborted ones
with ``"abort"``, and every other request's tokens equal a run without them;
request ids, fresh seeds and multi-token stop sequences.  One tiny model,
V = 32, four slots."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxsample.generation import serving
from jaxsample._src.params import SamplerConfig
from jaxsample.serve_loop import ProcessorLimits, Request, ServeLoop

from helpers.toy_lm import tiny_transformer

# Batch-shape independent logits on a GPU (``conftest.full_precision``).
pytestmark = pytest.mark.usefixtures("full_precision")

CACHE, SLOTS, VOCAB = 32, 4, 32
CONFIG = SamplerConfig(implementation="xla")
NAN = float("nan")
# (change to a good request's fields, the ValueError's message): every kind
# of malformed request, refused at submit.
MALFORMED = [
    (dict(prompt=[1, VOCAB]), "prompt has token id 32 outside"),
    (dict(prompt=[]), "prompt must be a non-empty"),
    (dict(prompt="hello"), "prompt: must be a token id or a list"),
    (dict(prompt=[1] * CACHE), "at most 31 fit the cache"),
    (dict(temperature=NAN), "temperature"),
    (dict(temperature="0.5"), "temperature must be a number"),
    (dict(top_k="5"), "top_k must be a number"),
    (dict(top_p=NAN), "top_p"),
    (dict(max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(max_tokens=2.0), "max_tokens must be an int >= 1"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\^32\)"),
    (dict(seed="7"), r"seed must be an int in \[0, 2\^32\)"),
    (dict(stop="\n"), "stop must be a token id or a list"),
    (dict(stop=[[]]), "empty stop sequence"),
    (dict(stop=[[1, "a"]]), "each stop must be a token id or a list"),
    (dict(stop=[1, 2, 3, 4, 5]), "max_stop_tokens"),
    (dict(banned_token_ids="5"), "banned_token_ids: must be a token id"),
    (dict(banned_token_ids=[5, 1.5]), "banned_token_ids: must be a token id"),
    (dict(logprobs="yes"), "logprobs must be True or False"),
    (dict(top_logprobs=1), "top_logprobs must be an int in"),
    (dict(min_tokens=9), "min_tokens must be an int in"),
    (dict(logit_bias={1: NAN}), r"logit_bias\[1\] = nan"),
    (dict(request_id=[1]), "request_id must be hashable"),
    (dict(tempreature=1.0), r"unknown request field\(s\) \['tempreature'\]"),
]


@pytest.fixture(scope="module")
def model():
  return tiny_transformer(seed=0, vocab=VOCAB, max_len=CACHE, layers=1)


def make_loop(model):
  return ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=CONFIG,
                   processors=ProcessorLimits())


def good_request(rs, rid) -> dict:
  """A valid request's fields, with a seed: its stop as a bare int, a list
  of ids or a list with a two-token sequence; sometimes a bare banned id."""
  fields = dict(prompt=rs.integers(0, VOCAB, rs.integers(1, 9)).tolist(),
                max_tokens=int(rs.integers(1, 6)),
                seed=int(rs.integers(0, 2**32)), request_id=rid,
                temperature=float(rs.choice([0.0, 0.8, 1.0])),
                top_k=int(rs.choice([0, 5])))
  form = rs.integers(4)
  if form == 1:
    fields["stop"] = int(rs.integers(VOCAB))
  elif form == 2:
    fields["stop"] = rs.integers(0, VOCAB, 2).tolist()
  elif form == 3:
    fields["stop"] = [int(rs.integers(VOCAB)),
                      rs.integers(0, VOCAB, 2).tolist()]
  if rs.random() < 0.3:
    fields["banned_token_ids"] = int(rs.integers(VOCAB))
  return fields


def raising_callback(after: int):
  """A callback that raises on the request's event number ``after``."""
  seen = []

  def callback(event):
    seen.append(event)
    if len(seen) > after:
      raise RuntimeError("consumer broke")
  return callback


def test_200_mixed_requests_leave_the_good_ones_untouched(model):
  """200 requests arriving over the steps: 120 good ones (the issue's
  ``stop: 7`` and ``banned_token_ids: 5`` forms and fresh seeds among
  them; the run alone replays the recorded seeds), 40 malformed
  (every ``MALFORMED`` kind and duplicate live ids: refused at submit
  naming the field), 20 whose callback raises (end with ``"error"``) and
  20 aborted while queued or running (``"abort"``).  The good ones' tokens
  equal a run of them alone, token for token; the stream never breaks."""
  rs = np.random.default_rng(0)
  loop = make_loop(model)
  good, done, streamed, aborts, failing = [], {}, {}, {}, set()
  refused, malformed, step, kinds = 0, 0, 0, []
  for i in range(200):
    kinds.append(("good", "bad", "good", "callback", "good", "bad", "good",
                  "abort", "good", "good")[i % 10])
  nxt = 0
  while nxt < len(kinds) or loop.pending:
    for _ in range(min(3, len(kinds) - nxt)):
      kind, rid = kinds[nxt], f"r{nxt}"
      fields = good_request(rs, rid)
      if kind == "good":
        if rs.random() < 0.2:  # a fresh seed, replayed below
          del fields["seed"]
        good.append(fields)
        loop.submit(fields)
      elif kind == "bad":
        live = [g["request_id"] for g in good if g["request_id"] not in done]
        if refused % 4 or not live:
          change, message = MALFORMED[malformed % len(MALFORMED)]
          malformed += 1
        else:
          change, message = (dict(request_id=live[-1]),
                             "still queued or running")
        refused += 1
        with pytest.raises(ValueError, match=message):
          loop.submit({**fields, **change})
      elif kind == "callback":
        fields.update(max_tokens=6, stop=())
        failing.add(rid)
        loop.submit(fields, callback=raising_callback(rs.integers(2)))
      else:
        fields.update(max_tokens=CACHE - 9, stop=(), temperature=1.0)
        loop.submit(fields)
        aborts[rid] = step + int(rs.integers(4))
      nxt += 1
    for rid, when in aborts.items():
      if when == step:
        assert loop.abort(rid), rid
    for event in loop.step():
      streamed.setdefault(event.request_id, []).extend(event.token_ids)
      if event.completion is not None:
        assert event.request_id not in done, "finished twice"
        done[event.request_id] = event.completion
    step += 1
  assert refused == 40 and malformed >= len(MALFORMED) and len(good) == 120
  assert sorted(done) == sorted([g["request_id"] for g in good] +
                                list(failing) + list(aborts))
  for rid in failing:
    assert done[rid].finish_reason == "error", rid
    assert done[rid].error.startswith("callback failed: RuntimeError: "
                                      "consumer broke")
  for rid in aborts:
    assert done[rid].finish_reason == "abort"
    assert len(done[rid].token_ids) < CACHE - 9
  alone = make_loop(model).run([
      Request(**dict(g, seed=done[g["request_id"]].seed)) for g in good])
  for fields, expected in zip(good, alone):
    got = done[fields["request_id"]]
    assert got.error is None and expected.error is None
    assert got.token_ids == expected.token_ids, fields
    assert got.finish_reason == expected.finish_reason
    assert streamed[fields["request_id"]] == got.token_ids
  assert not loop.abort("r0") and not loop.abort("unknown")


def test_a_failing_admission_ends_its_request_alone(model, monkeypatch):
  """A request whose admission inputs cannot be built ends with
  ``"error"`` and the message; its admission batch's others are served
  as without it."""
  rs = np.random.default_rng(1)
  requests = [good_request(rs, i) for i in range(4)]
  expected = make_loop(model).run([Request(**r) for r in requests])
  real = serving.admission_inputs

  def admission_inputs(batch, *args):
    if any(r.request_id == "broken" for r, *_ in batch):
      raise OverflowError("no room")
    return real(batch, *args)

  monkeypatch.setattr(serving, "admission_inputs", admission_inputs)
  loop = make_loop(model)
  got = loop.run([Request(**r) for r in requests[:2]] +
                 [Request(prompt=[1, 2], request_id="broken")] +
                 [Request(**r) for r in requests[2:]])
  broken = got.pop(2)
  assert broken.finish_reason == "error" and broken.token_ids == []
  assert broken.error == "admission failed: OverflowError: no room"
  assert [c.token_ids for c in got] == [c.token_ids for c in expected]
  assert not loop.pending


def test_request_ids_are_unique_among_live_requests(model):
  loop = make_loop(model)
  assert loop.submit(Request(prompt=[1], request_id=1, max_tokens=2)) == 1
  with pytest.raises(ValueError, match="request_id 1 belongs to a request"):
    loop.submit(Request(prompt=[2], request_id=1))
  fresh = [loop.submit(Request(prompt=[3], max_tokens=2)) for _ in range(2)]
  assert fresh == [0, 2]  # fresh ids skip the live 1
  list(loop.events())
  assert loop.submit(Request(prompt=[2], request_id=1)) == 1  # finished: free


def test_abort_ends_queued_and_running_requests_and_frees_slots(model):
  loop = make_loop(model)
  seen = []
  ids = [loop.submit(Request(prompt=[i + 1], max_tokens=20, seed=i),
                     callback=seen.append) for i in range(SLOTS + 1)]
  loop.step()
  loop.step()
  assert loop.abort(ids[0]) and loop.abort(ids[-1])  # running, queued
  assert not loop.abort(ids[0])
  assert loop.pending == SLOTS + 1  # the final events are still to come
  events = loop.step()
  finals = [e for e in events if e.finish_reason == "abort"]
  assert [e.request_id for e in finals] == [ids[0], ids[-1]]
  assert all(e.token_ids == [] and e.completion.error is None
             for e in finals)
  assert finals[1].completion.token_ids == []
  assert [e for e in seen if e.finish_reason == "abort"] == finals
  assert loop.pending == SLOTS - 1
  calls = loop.stats["admit_calls"]
  loop.submit(Request(prompt=[9], max_tokens=2, request_id="next"))
  loop.step()
  assert loop.stats["admit_calls"] == calls + 1  # into the freed slot
  done = {e.request_id: e.completion for e in loop.events() if e.completion}
  assert len(done["next"].token_ids) == 2


def test_a_fresh_seed_is_recorded_and_replays(model):
  """Identical sampled requests without a seed get different seeds (equal
  with probability 2^-32); passing a recorded seed back gives its tokens."""
  loop = make_loop(model)
  request = Request(prompt=[3, 1, 4], max_tokens=12, temperature=1.0)
  first, second = loop.run([request, request])
  assert first.seed != second.seed
  assert first.token_ids != second.token_ids
  replay = loop.run([dataclasses.replace(request, seed=s)
                     for s in (first.seed, second.seed)])
  assert [c.token_ids for c in replay] == [first.token_ids, second.token_ids]
  assert [c.seed for c in replay] == [first.seed, second.seed]


def test_stop_forms_and_multi_token_sequences(model):
  """``stop=7`` equals ``[7]`` and ``[[7]]``; a two-token sequence cuts the
  output after its first match (its tokens kept, streamed the same), also
  across step calls, and counts only past ``min_tokens``."""
  loop = make_loop(model)
  base = Request(prompt=[5, 9, 2], max_tokens=24, temperature=0.0)
  tokens = loop.run([base])[0].token_ids
  single = [loop.run([dataclasses.replace(base, stop=s)])[0]
            for s in (tokens[3], [tokens[3]], [[tokens[3]]])]
  assert len({tuple(c.token_ids) for c in single}) == 1
  assert single[0].finish_reason == "stop" and single[0].token_ids[-1] == (
      tokens[3])

  def first_match(sequence, min_tokens):
    return next((end for end in range(max(len(sequence), min_tokens + 1),
                                      len(tokens) + 1)
                 if tuple(tokens[end - len(sequence):end]) == sequence), None)

  for start, min_tokens in ((4, 0), (5, 0), (1, 2), (1, 4)):
    sequence = tuple(tokens[start:start + 2])
    request = dataclasses.replace(base, stop=[list(sequence)],
                                  min_tokens=min_tokens)
    streamed = []
    loop.submit(request, callback=lambda e: streamed.extend(e.token_ids))
    got = [e.completion for e in loop.events() if e.completion][0]
    end = first_match(sequence, min_tokens)
    assert got.token_ids == tokens[:end] == streamed
    assert got.finish_reason == ("length" if end is None else "stop")
    assert len(got.logprobs) == len(got.token_ids)


def test_n_samples_share_one_prefill(model):
  """``n = 3`` samples admitted together run their prompt through the model
  once; sample 0 is the ``n = 1`` request of the same seed, the others
  differ from it, the same seed and ``n`` replay all three, and ``abort``
  ends every sample."""
  loop = make_loop(model)
  request = Request(prompt=[7, 3, 3], max_tokens=10, temperature=1.0, seed=9)
  samples = loop.run([dataclasses.replace(request, n=3),
                      dataclasses.replace(request, prompt=[4])])
  assert loop.stats["prefills"] == 2 and loop.stats["admit_calls"] == 1
  assert [(c.request_id, c.index) for c in samples] == [(0, 0), (0, 1),
                                                        (0, 2), (1, 0)]
  assert samples[0].token_ids == loop.run([request])[0].token_ids
  assert len({tuple(c.token_ids) for c in samples[:3]}) == 3
  again = loop.run([dataclasses.replace(request, n=3)])
  assert [c.token_ids for c in again] == [c.token_ids for c in samples[:3]]
  assert samples[2].to_openai()["index"] == 2
  rid = loop.submit(dataclasses.replace(request, n=2, max_tokens=20))
  loop.step()
  assert loop.abort(rid)
  finals = [e for e in loop.events() if e.completion]
  assert [(e.index, e.finish_reason) for e in finals] == [(0, "abort"),
                                                          (1, "abort")]
  with pytest.raises(ValueError, match="n must be an int >= 1"):
    loop.submit(dataclasses.replace(request, n=0))
