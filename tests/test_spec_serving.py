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

from conftest import assert_chi2_fits, on_gpu, slow_case
from jaxsample import reference, serve_demo
from jaxsample.params import SamplerConfig, SamplingParams
from jaxsample.serve_loop import (ModelDrafter, NgramDrafter, Request,
                                  ServeLoop, Speculation, layer_prefix)

from toy_lm import bigram_lm, next_logits, tiny_transformer

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


def test_synthetic_acceptance_rates():
  """With rates (1, 0.5, 0), slot 0 is always accepted, slot 1 half the time
  and slot 2 never: one step with 3 drafts accepts 1 or 2 with equal odds."""
  target = bigram_lm(0, 8)
  spec = Speculation(NgramDrafter(K), synthetic_rates=(1.0, 0.5, 0.0))
  loop = ServeLoop(target, slots=256, cache_len=CACHE, config=CONFIG,
                   admit_batch=256, speculation=spec)
  # The prefill emits token 1, one speculative step the second.
  done = loop.run([Request(prompt=list(range(8)) * 2, max_tokens=2, seed=s)
                   for s in range(1024)])
  drafted = np.array([c.drafted for c in done])
  accepted = np.array([c.accepted for c in done])[drafted == K]
  n = accepted.size
  assert n > 100, n
  assert set(accepted.tolist()) <= {1, 2}
  assert abs(np.sum(accepted == 1) - n / 2) < 5 * np.sqrt(n / 4)
