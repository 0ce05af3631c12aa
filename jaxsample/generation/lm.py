"""The model contract of ``jaxsample.serve_loop`` and its adapters.

A language model is a static (hashable) ``LanguageModel`` plus a pytree of
weights.  ``LanguageModel.apply(weights, tokens, positions, cache)`` maps

* ``tokens`` ``[B, S]`` int32 and ``positions`` ``[B, S]`` int32 (row ``b``
  holds the ``S`` consecutive positions ``positions[b, 0] + i``),
* ``cache``: a pytree whose leaves have the slot axis first (``[B, ...]``),
  as made by ``init_cache(weights, B, T)`` for ``T`` cached positions,

to ``(logits, cache)``: ``logits`` ``[B, S, V]`` (float) where row ``b``,
column ``i`` is the next-token logits after ``tokens[b, :i + 1]`` given the
cached positions ``< positions[b, 0]``, and the cache with the ``S`` new
positions written.  Slots are independent: row ``b``'s outputs depend only on
row ``b``'s inputs and cache.  Positions at or past a row's own sequence may
hold anything; the model must ignore cached positions ``> positions[b, i]``.

``NnxLM`` adapts a Flax NNX module with ``__call__(tokens, positions, cache)``
and ``init_cache(batch_size, length)`` (``jaxsample.models.Transformer``);
``FunctionLM`` wraps two plain functions.  ``as_language_model`` accepts
either an NNX module or a ``(LanguageModel, weights)`` pair.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

__all__ = ["FunctionLM", "LanguageModel", "NnxLM", "as_language_model"]


class LanguageModel:
  """Interface: ``apply``, ``init_cache``, ``max_len`` (the default cache
  length) and ``vocab_size`` (for checking prompt ids); None if unknown.

  Subclasses must be hashable and compare equal when they compute the same
  function: they are static arguments of the jitted generation loop.
  """

  max_len: int | None = None
  vocab_size: int | None = None

  def apply(self, weights, tokens: jax.Array, positions: jax.Array, cache
            ) -> tuple[jax.Array, Any]:
    raise NotImplementedError

  def init_cache(self, weights, batch_size: int, length: int):
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class NnxLM(LanguageModel):
  """A Flax NNX module split into its (static) graph and (traced) state.

  ``weights`` is the module's ``nnx.State``; each call merges them under
  ``jit`` (``nnx.merge``) and calls the module.
  """

  graphdef: Any
  max_len: int | None = None
  vocab_size: int | None = None

  @classmethod
  def split(cls, module: nnx.Module) -> tuple["NnxLM", Any]:
    """``(NnxLM, state)`` of ``module``; ``max_len`` and ``vocab_size`` from
    ``module.config`` where it has them."""
    graphdef, state = nnx.split(module)
    config = getattr(module, "config", None)
    return cls(graphdef, getattr(config, "max_len", None),
               getattr(config, "vocab_size", None)), state

  def apply(self, weights, tokens, positions, cache):
    return nnx.merge(self.graphdef, weights)(tokens, positions, cache)

  def init_cache(self, weights, batch_size, length):
    return nnx.merge(self.graphdef, weights).init_cache(batch_size, length)


@dataclasses.dataclass(frozen=True)
class FunctionLM(LanguageModel):
  """Two plain functions with the contract's signatures (compared by identity:
  build one ``FunctionLM`` and reuse it, or every call recompiles)."""

  apply_fn: Callable[..., tuple[jax.Array, Any]]
  init_cache_fn: Callable[..., Any]
  max_len: int | None = None
  vocab_size: int | None = None

  def apply(self, weights, tokens, positions, cache):
    return self.apply_fn(weights, tokens, positions, cache)

  def init_cache(self, weights, batch_size, length):
    return self.init_cache_fn(weights, batch_size, length)


def as_language_model(model) -> tuple[LanguageModel, Any]:
  """``(LanguageModel, weights)`` from an NNX module or such a pair.

  Raises:
    TypeError: for anything else, naming the two accepted forms.
  """
  if isinstance(model, nnx.Module):
    return NnxLM.split(model)
  if (isinstance(model, tuple) and len(model) == 2 and
      isinstance(model[0], LanguageModel)):
    return model
  raise TypeError(
      "model must be a Flax NNX module with __call__(tokens, positions, cache) "
      "and init_cache(batch_size, length), or a (LanguageModel, weights) pair "
      f"(see jaxsample.generation.lm); got {type(model).__name__}")
