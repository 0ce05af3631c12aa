"""Draft proposers for speculative decoding in the serving loop.

A drafter is a static, hashable object (an argument of the jitted step) with
``num_draft`` (``k``, the drafts per step), and three pure functions over the
slots of a ``jaxsample.generation.spec_step.SpecState``:

* ``init(weights, slots, length)``: its own per-slot state (a pytree with the
  slot axis first, or None);
* ``prefill(weights, own, tokens, lengths)``: that state after the prompts
  ``tokens`` ``[B, W]`` (left-aligned, ``lengths`` ``[B]``) were read;
* ``propose(weights, own, history, positions, params, keys)``: ``(drafts
  [B, k] int32, num_draft [B] int32, draft_logits [B, k, V] or None, own)``
  for slots whose last token sits at ``positions`` ``[B]`` with the tokens of
  positions ``0 .. positions`` in ``history`` ``[B, H]``.

``NgramDrafter`` (prompt lookup) keeps no state and gives one-hot drafts;
``ModelDrafter`` runs a smaller language model and samples its drafts from
the draft model's processed distribution (the request's own parameters), so
``jaxsample._src.spec.rejection_sample`` gets its logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsample.generation.lm import LanguageModel, NnxLM
from jaxsample.models.transformer import Transformer
from jaxsample._src.params import SamplerConfig, SamplingParams
from jaxsample._src.sampling import sample

__all__ = ["DRAFT_KEY_PURPOSE", "ModelDrafter", "NgramDrafter",
           "draft_keys", "layer_prefix"]

# Draft-model noise uses fold_in(request key, 2); rejection_sample uses 0 and
# 1 (jaxsample._src.spec.stream_keys), so the three streams are independent.
DRAFT_KEY_PURPOSE = 2


def draft_keys(keys: jax.Array) -> jax.Array:
  """Raw ``[B, 2]`` draft-noise keys: ``fold_in(key_b, DRAFT_KEY_PURPOSE)``."""
  typed = jax.random.wrap_key_data(keys, impl="threefry2x32")
  folded = jax.vmap(jax.random.fold_in, (0, None))(typed, DRAFT_KEY_PURPOSE)
  return jax.random.key_data(folded)


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
  """Prompt lookup: the ``k`` tokens that followed the latest earlier
  occurrence of the sequence's last ``n`` tokens, for the largest ``n`` in
  ``[min_ngram, max_ngram]`` that occurs (prompt and generated tokens alike).

  ``num_draft`` is how many of those ``k`` tokens exist (0 without a match).
  Drafts are one-hot (no logits): exact for any distribution
  (``jaxsample._src.spec``).
  """

  num_draft: int
  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram or self.num_draft < 1:
      raise ValueError(f"NgramDrafter needs num_draft >= 1 and 1 <= min_ngram "
                       f"<= max_ngram; got {self}")

  def init(self, weights, slots: int, length: int):
    del weights, slots, length
    return None

  def prefill(self, weights, own, tokens, lengths):
    del weights, tokens, lengths
    return own

  def propose(self, weights, own, history, positions, params, keys):
    del weights, params, keys
    k = self.num_draft
    width = history.shape[1]
    end = positions + 1  # tokens 0 .. positions are known
    starts = jnp.arange(width)  # candidate match starts i
    best = jnp.full(positions.shape, -1, jnp.int32)  # first draft position
    for n in range(self.min_ngram, self.max_ngram + 1):  # larger n wins
      suffix = jax.vmap(lambda h, e, n=n: jax.lax.dynamic_slice(
          h, (jnp.maximum(e - n, 0),), (n,)))(history, end)  # [B, n]
      match = jnp.ones(history.shape, bool)
      for m in range(n):
        shifted = jnp.roll(history, -m, axis=1)  # shifted[:, i] = h[i + m]
        match &= shifted == suffix[:, m:m + 1]
      # The continuation must start before the sequence's end.
      match &= (starts[None] + n < end[:, None]) & (end[:, None] >= n)
      latest = jnp.max(jnp.where(match, starts[None] + n, -1), axis=1)
      best = jnp.where(latest >= 0, latest, best)
    found = best >= 0
    first = jnp.maximum(best, 0)
    drafts = jax.vmap(lambda h, s: jax.lax.dynamic_slice(h, (s,), (k,)))(
        jnp.pad(history, ((0, 0), (0, k))), first)
    num = jnp.where(found, jnp.minimum(end - first, k), 0)
    return drafts.astype(jnp.int32), num.astype(jnp.int32), None, own


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A smaller language model proposing ``num_draft`` tokens autoregressively.

  Its cache mirrors the target's positions.  Each step first feeds the two
  tokens at positions ``max(p - 1, 0)`` and after (re-writing the previous
  step's last accepted token, which the draft had not read when all drafts
  were accepted), then its own drafts.  Draft ``i`` is sampled at noise
  position ``p + 1 + i`` from the draft's processed distribution with the
  request's parameters and ``draft_keys`` (greedy requests: argmax).
  ``weights`` are the draft model's (a traced argument of the step).
  """

  lm: LanguageModel
  num_draft: int
  config: SamplerConfig = SamplerConfig(implementation="xla")

  def __post_init__(self):
    if self.num_draft < 1:
      raise ValueError(f"ModelDrafter needs num_draft >= 1; got "
                       f"{self.num_draft}")

  def init(self, weights, slots: int, length: int):
    return self.lm.init_cache(weights, slots, length)

  def prefill(self, weights, own, tokens, lengths):
    del lengths
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                 tokens.shape)
    _, own = self.lm.apply(weights, tokens, positions, own)
    return own

  def propose(self, weights, own, history, positions, params: SamplingParams,
              keys):
    noise = draft_keys(keys)
    start = jnp.maximum(positions - 1, 0)
    pair = jax.vmap(lambda h, s: jax.lax.dynamic_slice(h, (s,), (2,)))(
        history, start)
    logits, own = self.lm.apply(weights, pair, start[:, None] + jnp.arange(2),
                                own)
    row = jnp.take_along_axis(logits, (positions - start)[:, None, None],
                              axis=1)[:, 0]
    drafts, rows = [], []
    for i in range(self.num_draft):
      token = sample(row, params, noise, positions=positions + 1 + i,
                     config=self.config).tokens
      drafts.append(token)
      rows.append(row)
      if i + 1 < self.num_draft:
        logits, own = self.lm.apply(weights, token[:, None],
                                    (positions + 1 + i)[:, None], own)
        row = logits[:, 0]
    num = jnp.full(positions.shape, self.num_draft, jnp.int32)
    return (jnp.stack(drafts, 1), num, jnp.stack(rows, 1), own)


def layer_prefix(model: Transformer, num_layers: int) -> tuple[NnxLM, Any]:
  """A draft model from ``model``'s first ``num_layers`` blocks, its
  embedding, final norm and head (shared weights, no training): ``(NnxLM,
  weights)`` for ``ModelDrafter`` and ``Speculation.draft_weights``."""
  if not 1 <= num_layers <= model.config.num_layers:
    raise ValueError(f"num_layers must be in [1, {model.config.num_layers}]; "
                     f"got {num_layers}")
  draft = nnx.clone(model)
  draft.config = dataclasses.replace(model.config, num_layers=num_layers)
  draft.blocks = nnx.List(list(draft.blocks)[:num_layers])
  return NnxLM.split(draft)
