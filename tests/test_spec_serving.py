"""Speculative decoding in the ServeLoop: greedy output equals plain greedy
output token for token; sampled output is distributed exactly as plain
sampling (chi-square against the exact joint distribution of three tokens);
the synthetic mode's acceptance follows its rates.  Tiny models on every
backend; greedy speculation on the embedded model and the kernels in
GPU-marked cases."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsample._src import reference
from jaxsample import serve_demo
from jaxsample._src.params import SamplerConfig, SamplingParams
from jaxsample.serve_loop import (ModelDrafter, NgramDrafter, Request,
                                  ServeLoop, Speculation, layer_prefix)

from helpers.parametrize import on_gpu, slow_case
from helpers.programs import CompileCounter
from helpers.stats import assert_chi2_fits
from helpers.toy_lm import bigram_lm, next_logits, tiny_transformer

# Batch-shape independent logits on a GPU (``conftest.full_precision``).
pytestmark = pytest.mark.usefixtures("full_precision")

CONFIG = SamplerConfig(implementation="xla")
CACHE = 32
K = 3


@pytest.fixture(scope="module")
def plain_runs():
  """Completions of the plain (non-speculative) loop by workload, shared by
  the drafters' cases."""
  return {}


def greedy_workload(request, which: str):
  """``(target, target module, requests, config, cache_len, num_draft)``:
  ten random greedy requests on a tiny 2-layer model (XLA), or eight of the
  serving demo's, made greedy and asking for masks, on the embedded model
  and the kernels."""
  if which == "tiny":
    target = tiny_transformer(seed=0, vocab=32, max_len=CACHE, layers=2)
    rs = np.random.default_rng(0)
    requests = [Request(prompt=rs.integers(0, 32, rs.integers(1, 10)).tolist(),
                        max_tokens=int(rs.integers(1, 20)), temperature=0.0,
                        stop=rs.integers(0, 32, 1).tolist(), seed=i)
                for i in range(10)]
    return (target, nnx.merge(target[0].graphdef, target[1]), requests, CONFIG,
            CACHE, K)
  model, tokenizer = request.getfixturevalue("embedded")
  requests = [Request(prompt=tokenizer.encode(text).ids, max_tokens=32,
                      seed=i, request_id=i, stop=[0], return_masks=True,
                      **dict(setting, temperature=0.0))
              for i, (text, (_, setting)) in enumerate(
                  zip(serve_demo.PROMPTS * 2, serve_demo.SETTINGS * 2))]
  return (model, model, requests,
          SamplerConfig(implementation="pallas", max_mask_ids=64), None, 4)


@pytest.mark.kernels
@pytest.mark.parametrize("which,drafter", [
    ("tiny", "ngram"), slow_case("tiny", "layers"), ("tiny", "other"),
    on_gpu("embedded", "ngram"), on_gpu("embedded", "layers")])
def test_greedy_speculative_equals_plain(request, plain_runs, which, drafter):
  target, module, requests, config, cache_len, k = greedy_workload(request,
                                                                    which)
  if drafter == "ngram":
    spec = Speculation(NgramDrafter(k))
  else:
    draft = (layer_prefix(module, 1) if drafter == "layers" else
             tiny_transformer(seed=7, vocab=32, max_len=CACHE, layers=1))
    spec = Speculation(ModelDrafter(draft[0], k, config), draft[1])
  masks = any(r.return_masks for r in requests)
  if which not in plain_runs:
    plain_runs[which] = ServeLoop(target, slots=4, cache_len=cache_len,
                                  config=config, return_masks=masks
                                  ).run(requests)
  fast = ServeLoop(target, slots=4, cache_len=cache_len, config=config,
                   return_masks=masks, speculation=spec)
  drafted = accepted = 0
  for a, b in zip(plain_runs[which], fast.run(requests)):
    assert a.token_ids == b.token_ids
    assert a.finish_reason == b.finish_reason
    assert a.sampling_mask == b.sampling_mask
    np.testing.assert_array_equal(b.logprobs, 0.0)
    drafted += b.drafted
    accepted += b.accepted
  assert drafted > accepted, (drafted, accepted)  # rejections happened
  if drafter != "other":  # a random other model may never agree
    assert accepted > 0, (drafted, accepted)


def exact_joint(weights, prompt, params: SamplingParams, vocab: int,
                length: int) -> np.ndarray:
  """Probabilities of every ``length``-token continuation (row-major ids)."""
  prefixes = [p for n in range(length)
              for p in itertools.product(range(vocab), repeat=n)]
  logits = jnp.asarray(np.stack([next_logits(weights, list(prompt) + list(p))
                                 for p in prefixes]))
  rows = SamplingParams(*(jnp.broadcast_to(f, (len(prefixes),))
                          for f in (params.temperature, params.top_k,
                                    params.top_p, params.min_p)))
  rows = rows.canonical(vocab)
  log_q = dict(zip(prefixes, np.asarray(reference.log_probs(
      reference.process(logits, rows), rows), np.float64)))
  probs = np.zeros(vocab ** length)
  for index, tokens in enumerate(itertools.product(range(vocab),
                                                   repeat=length)):
    probs[index] = np.exp(sum(log_q[tokens[:i]][t]
                              for i, t in enumerate(tokens)))
  return probs


@pytest.mark.parametrize("drafter,settings", [
    ("ngram", dict(temperature=1.0)),
    ("model", dict(temperature=0.8, top_k=5)),
    slow_case("model", dict(temperature=1.0, top_p=0.8)),
])
def test_speculative_sampling_distribution(drafter, settings):
  vocab, draws, length = 6, 4096, 3
  target = bigram_lm(0, vocab)
  draft = bigram_lm(1, vocab, scale=1.0)
  prompt = [1, 2, 3, 1, 2, 3, 1, 2]
  spec = (Speculation(NgramDrafter(K)) if drafter == "ngram" else
          Speculation(ModelDrafter(draft[0], K, CONFIG), draft[1]))
  loop = ServeLoop(target, slots=512, cache_len=CACHE, config=CONFIG,
                   admit_batch=512, speculation=spec)
  done = loop.run([Request(prompt=prompt, max_tokens=length, seed=s,
                           **settings) for s in range(draws)])
  assert all(len(c.token_ids) == length for c in done)
  index = np.array([np.ravel_multi_index(c.token_ids, (vocab,) * length)
                    for c in done])
  params = SamplingParams.make(1, **settings)
  assert_chi2_fits(index, exact_joint(target[1], prompt, params, vocab,
                                      length))
  drafted = sum(c.drafted for c in done)
  accepted = sum(c.accepted for c in done)
  # Both branches of the verification ran many times.
  assert 0.05 * drafted < accepted < 0.95 * drafted, (drafted, accepted)


RATES = (0.9, 0.6, 0.5)


def accepted_length_probs(rates) -> np.ndarray:
  """``P(j = i) = r_0 .. r_{i-1} (1 - r_i)`` for ``i = 0 .. k`` (``r_k =
  0``): the accepted lengths of synthetic-mode steps."""
  survive = np.cumprod((1.0,) + tuple(rates))
  return survive * (1.0 - np.append(rates, 0.0))


def test_synthetic_mode_verifies_k_drafts_at_its_rates():
  """Synthetic mode on random prompts (the n-gram drafter rarely matches
  them: its guesses are padded to ``K``): every step of a request verifies
  ``K`` drafts; the accepted lengths of its first 5 steps (``len(event) -
  1``; 1 + 5 (K + 1) tokens stay under the budget: no cut, no stopping
  bias) fit ``accepted_length_probs`` (chi-square); nothing compiles after warm-up; tokens are in the
  vocabulary, logprobs are <= 0 and not NaN (-inf only for an accepted
  draft outside the kept set, then not in the token's mask), masks list the
  others' tokens."""
  vocab = 64
  target = bigram_lm(2, vocab)
  spec = Speculation(NgramDrafter(K), synthetic_rates=RATES)
  loop = ServeLoop(target, slots=64, cache_len=CACHE, config=CONFIG,
                   admit_batch=64, speculation=spec, return_masks=True,
                   steps_per_call=1)  # an event per step
  loop.warmup(8)
  rs = np.random.default_rng(0)
  settings = [dict(temperature=0.0), dict(temperature=1.0),
              dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.7)]
  requests = [Request(prompt=rs.integers(0, vocab, 8).tolist(),
                      max_tokens=CACHE, seed=i, return_masks=True,
                      **settings[i % 4]) for i in range(192)]
  sizes = {i: [] for i in range(len(requests))}
  with CompileCounter() as compiles:
    for r in requests:
      loop.submit(r, callback=lambda e: sizes[e.request_id].append(
          len(e.token_ids)))
    done = {e.request_id: e.completion for e in loop.events()
            if e.completion is not None}
  assert compiles.count == 0
  lengths = []
  for i, completion in done.items():
    assert sizes[i][0] == 1 and sum(sizes[i]) == CACHE - 8
    assert completion.drafted == K * (len(sizes[i]) - 1)
    lengths += [n - 1 for n in sizes[i][1:6]]
    ids = np.array(completion.token_ids)
    assert np.all((ids >= 0) & (ids < vocab))
    for token, logprob, mask in zip(completion.token_ids, completion.logprobs,
                                    completion.sampling_mask):
      assert logprob <= 0.0, logprob
      assert (mask is None or token in mask) == (logprob > -np.inf)
  assert len(lengths) == 5 * len(requests)
  assert_chi2_fits(lengths, accepted_length_probs(RATES))
