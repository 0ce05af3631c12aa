"""Logprob outputs (``jaxsample/logprobs.py``) against a numpy float64 oracle:
the four modes, top-n with ranks and the sampled token's rank."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample as js
from jaxsample._src import logprobs

from helpers.processing_oracle import (mode_oracle, process_oracle, random_case,
                                       rank_oracle, top_oracle)

BATCH, VOCAB = 8, 80
SETTINGS = dict(  # per row: greedy, plain, each filter, a fully masked row
    temperature=[0.0, 1.0, 0.7, 1.3, 1.0, 0.0, 1.0, 2.0],
    top_k=[0, 0, 5, 0, 0, 0, 0, 3],
    top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 1.0, 1.0, 0.9],
    min_p=[0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0])
TOPS = (0, 1, 20)


@jax.jit
def all_outputs(logits, params, tokens, processors=None):
  """Per mode (one compile for all): the ``[B, V]`` values and the outputs
  for every ``num_top`` of ``TOPS``."""
  outputs = {}
  for mode in logprobs.MODES:
    values = logprobs.mode_values(logits, params, mode, processors=processors)
    outputs[mode] = values, [logprobs.top_logprobs(values, tokens, n)
                             for n in TOPS]
  return outputs


@functools.cache
def case():
  """Logits on a 1/4 grid (exact ties), -inf entries, every processor; row 5
  fully masked by its processors (invalid after processing, valid raw),
  row 6 holds a NaN (invalid raw and processed); tokens drawn by ``sample``
  and ``all_outputs`` of them."""
  rng = np.random.default_rng(40)
  logits, kw = random_case(rng, BATCH, VOCAB, grid=True)
  kw["allowed_token_ids"][5], kw["banned_token_ids"][5] = [3], [3]
  logits[6, 9] = np.nan
  kw["allowed_token_ids"][6] = None
  kw["bitmask"][6] = -1
  processors = js.LogitsProcessors.make(BATCH, **kw)
  params = js.SamplingParams.make(BATCH, **SETTINGS)
  result = jax.jit(js.sample, static_argnames="config")(
      logits, params, jax.random.key(4), config="xla", processors=processors)
  outputs = all_outputs(logits, params, result.tokens, processors)
  return (logits, process_oracle(logits, kw), processors, params, result,
          outputs)


def assert_values_match(got, want):
  got = np.asarray(got, np.float64)
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  finite = np.isfinite(want)
  np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", logprobs.MODES)
def test_modes_top_n_and_ranks_match_the_oracle(mode):
  """Every mode's values, top-n and token rank; raw modes are the oracle's
  values of the model's logits (so processors and temperature do not
  reach them), processed modes of the processed, tempered, truncated row."""
  logits, processed, _, _, result, outputs = case()
  tokens = np.asarray(result.tokens)
  want = mode_oracle(mode, logits, processed, **SETTINGS)
  values, outputs = outputs[mode]
  assert_values_match(values, want)
  finite_rows = ~np.any(np.isnan(want), axis=-1)  # top-n of NaN: unordered
  for n, got in zip(TOPS, outputs):
    want_ids, want_top = top_oracle(want, n)
    assert got.top_ids.shape == got.top_values.shape == (BATCH, n)
    np.testing.assert_array_equal(np.asarray(got.top_ids)[finite_rows],
                                  want_ids[finite_rows])
    assert_values_match(np.asarray(got.top_values)[finite_rows],
                        want_top[finite_rows])
    assert_values_match(got.token_values,
                        want[np.arange(BATCH), tokens])
    np.testing.assert_array_equal(np.asarray(got.token_ranks)[finite_rows],
                                  rank_oracle(want, tokens)[finite_rows])


@pytest.mark.parametrize("mode", logprobs.MODES)
def test_top_ids_are_distinct_and_in_range_on_every_row(mode):
  """No row's top-n repeats an id (the sampled token included), on rows with
  ties, all ``-inf`` rows and a NaN row too; the sampled token, where it is
  listed, sits within its rank (tied tokens share the largest rank)."""
  *_, result, outputs = case()
  tokens = np.asarray(result.tokens)
  for n, got in zip(TOPS, outputs[mode][1]):
    ids, ranks = np.asarray(got.top_ids), np.asarray(got.token_ranks)
    assert ((0 <= ids) & (ids < VOCAB)).all()
    for b in range(BATCH):
      assert len(set(ids[b].tolist())) == n, (b, ids[b])
      listed = np.flatnonzero(ids[b] == tokens[b])
      if listed.size and not np.isnan(np.asarray(got.top_values)[b]).any():
        assert listed[0] + 1 <= ranks[b], (b, listed, ranks[b])


def test_case_covers_ties_greedy_and_invalid_rows():
  """The shared case exercises what the modes must get right."""
  logits, processed, *_ = case()
  tokens = np.asarray(case()[4].tokens)
  raw = mode_oracle("raw_logprobs", logits, processed, **SETTINGS)
  lq = mode_oracle("processed_logprobs", logits, processed, **SETTINGS)
  ranks = rank_oracle(lq, tokens)
  assert np.all(np.isneginf(lq[5])) and np.isfinite(raw[5]).any()
  assert np.all(np.isneginf(raw[6])) and np.all(np.isneginf(lq[6]))
  assert lq[0].max() == 0 and np.sum(lq[0] == 0) == 1  # a greedy point mass
  assert ranks[1] > 1  # a sampled token below the top
  top = top_oracle(raw, 20)[1]
  assert np.any(top[:, 1:] == top[:, :-1])  # tied values inside the top 20


def test_processed_logprobs_hold_sample_s_logprob():
  """``processed_logprobs`` at the sampled token is ``sample``'s logprob."""
  *_, result, outputs = case()
  np.testing.assert_allclose(outputs["processed_logprobs"][1][0].token_values, result.logprobs, rtol=1e-5,
                             atol=1e-5)


def test_raw_equals_processed_only_at_t1_without_filters_or_processors():
  """docs/processing.md, Raw or processed: the token's raw logprob is its
  processed one on a plain T = 1 row, and not under a temperature, a
  filter, greedy sampling or a processor (all read from ``sample``)."""
  logits = jax.random.normal(jax.random.key(3), (5, VOCAB)) * 2
  params = js.SamplingParams.make(5, temperature=[1.0, 0.7, 1.0, 0.0, 1.0],
                                  top_k=[0, 0, 5, 0, 0])
  processors = js.LogitsProcessors.make(5, logit_bias=[None] * 4 + [{1: 3.0}])
  result = jax.jit(js.sample, static_argnames="config")(
      logits, params, jax.random.key(5), config="xla", processors=processors)
  raw = logprobs.token_logprobs(logits, params, result.tokens,
                                mode="raw_logprobs", processors=processors)
  processed = logprobs.token_logprobs(logits, params, result.tokens,
                                      mode="processed_logprobs",
                                      processors=processors)
  np.testing.assert_allclose(processed.token_values, result.logprobs,
                             rtol=0, atol=1e-5)
  gap = np.abs(np.asarray(raw.token_values) - np.asarray(result.logprobs))
  assert gap[0] <= 1e-5 and (gap[1:] > 1e-3).all(), gap


def test_token_logprobs_is_top_logprobs_and_checks_arguments():
  logits = jnp.zeros((2, 8))
  params = js.SamplingParams.make(2)
  tokens = jnp.zeros((2,), jnp.int32)
  for bad in (-1, 21, 9, True, 1.0):
    with pytest.raises(ValueError, match="num_top"):
      logprobs.token_logprobs(logits, params, tokens, num_top=bad)
  with pytest.raises(ValueError, match="mode must be one of"):
    logprobs.token_logprobs(logits, params, tokens, mode="logprobs")
  with pytest.raises(ValueError, match="tokens must be"):
    logprobs.token_logprobs(logits, params, jnp.zeros((3,), jnp.int32))
  want = logprobs.top_logprobs(
      logprobs.mode_values(logits, params, "raw_logits"), tokens, 2)
  got = logprobs.token_logprobs(logits, params, tokens, num_top=2,
                                mode="raw_logits")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
