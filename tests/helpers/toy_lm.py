"""Small models for the serving-loop tests.

``bigram_lm``: a ``FunctionLM`` whose next-token logits after a sequence are
``scale * (cur[last] + prev[second last])`` (``prev`` row 0 before the second
token), from random tables; its cache is the token history.  It meets the
model contract (rows independent, cached positions past the query ignored)
and its exact distributions are easy to enumerate (``next_logits``).
``tiny_transformer``: a random-weight ``jaxsample.models.Transformer``.
``Bigram``: a user's own NNX module (docs/generation.md's example).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsample.models import Transformer, TransformerConfig
from jaxsample.serve_loop import FunctionLM, NnxLM


def _bigram_apply(weights, tokens, positions, cache):
  rows = jnp.arange(tokens.shape[0])[:, None]
  cache = cache.at[rows, positions].set(tokens, mode="drop")
  before = jnp.where(positions > 0,
                     cache[rows, jnp.maximum(positions - 1, 0)], 0)
  logits = weights["cur"][tokens] + weights["prev"][before]
  return weights["scale"] * logits, cache


def _bigram_cache(weights, batch_size, length):
  del weights
  return jnp.zeros((batch_size, length), jnp.int32)


BIGRAM = FunctionLM(_bigram_apply, _bigram_cache, max_len=None)


def bigram_lm(seed: int, vocab: int, scale: float = 1.5):
  """``(BIGRAM, weights)`` with random ``[V, V]`` tables."""
  rs = np.random.default_rng(seed)
  weights = {"cur": jnp.asarray(rs.normal(size=(vocab, vocab)), jnp.float32),
             "prev": jnp.asarray(rs.normal(size=(vocab, vocab)), jnp.float32),
             "scale": jnp.float32(scale)}
  return BIGRAM, weights


def next_logits(weights, sequence) -> np.ndarray:
  """The bigram model's ``[V]`` logits after ``sequence``."""
  before = sequence[-2] if len(sequence) > 1 else 0
  return np.asarray(weights["scale"] * (weights["cur"][sequence[-1]] +
                                        weights["prev"][before]))


def tiny_transformer(seed: int = 0, vocab: int = 32, max_len: int = 64,
                     layers: int = 2):
  """``(NnxLM, weights)`` of a random-weight Transformer (an untied head:
  with tied embeddings a random model mostly repeats its last token)."""
  config = TransformerConfig(vocab_size=vocab, d_model=32, num_layers=layers,
                             num_heads=4, num_kv_heads=2, mlp_dim=64,
                             max_len=max_len, tie_embeddings=False)
  return NnxLM.split(Transformer(config, rngs=nnx.Rngs(seed)))


class Bigram(nnx.Module):
  """A custom NNX model (the docs' example): logits from the last token only."""

  def __init__(self, vocab, rngs):
    self.table = nnx.Embed(vocab, vocab, rngs=rngs)

  def __call__(self, tokens, positions, cache):
    return self.table(tokens).astype(jnp.float32), cache

  def init_cache(self, batch_size, length):
    return jnp.zeros((batch_size, length), jnp.int32)
