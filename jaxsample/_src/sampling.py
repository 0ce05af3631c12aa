"""``jaxsample.sample``: validates and canonicalizes, then calls one
backend's ``sample_rows`` (``jaxsample._src.backends``: the XLA reference,
the XLA search or the Pallas kernels), over the batch's shards; logits
split along the vocabulary on a mesh of Explicit axes take
``parallel.vocab.sample_sharded``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, overload

import jax
import jax.numpy as jnp

from jaxsample._src import backends, dispatch, mask, rng, sampling_mask
from jaxsample._src.parallel.batch import (explicit_axes, manual_rows,
                                           over_batch_shards)
from jaxsample._src.parallel.vocab import sample_sharded, vocab_mesh_call
from jaxsample._src.params import SamplerConfig, SamplingParams, as_config
from jaxsample._src.processors import LogitsProcessors
from jaxsample._src.reference import SampleResult
from jaxsample._src.sampling_mask import SamplingMask

__all__ = ["sample"]


@overload
def sample(logits: jax.Array, params: SamplingParams, key: jax.Array, *,
           positions: jax.Array | None = None,
           config: SamplerConfig | str | None = None,
           return_mask: Literal[False] = False,
           processors: LogitsProcessors | None = None
           ) -> SampleResult:
  ...


@overload
def sample(logits: jax.Array, params: SamplingParams, key: jax.Array, *,
           positions: jax.Array | None = None,
           config: SamplerConfig | str | None = None,
           return_mask: Literal[True],
           processors: LogitsProcessors | None = None
           ) -> tuple[SampleResult, SamplingMask]:
  ...


def sample(logits: jax.Array,
           params: SamplingParams,
           key: jax.Array,
           *,
           positions: jax.Array | None = None,
           config: SamplerConfig | str | None = None,
           return_mask: bool = False,
           processors: LogitsProcessors | None = None
           ) -> SampleResult | tuple[SampleResult, SamplingMask]:
  """Samples one token per row of ``logits`` ``[B, V]``.

  Equivalent to the reference in ``jaxsample._src.reference``: temperature, then
  min-p, top-k and top-p (upward-closed kept sets, ties kept), then Gumbel-max
  over the kept set; greedy rows (T = 0) take the argmax.

  Args:
    logits: ``[B, V]`` fp32, bf16 or fp16 logits (read in their own dtype).
    params: per-request ``SamplingParams`` (scalar fields apply to every
      row: ``SamplingParams.rows``); out-of-range traced values follow
      ``SamplingParams.canonical``.
    key: one key for the batch (noise counter = flat index ``b * V + v``;
      pass a fresh key every step), or ``[B]`` keys, one per request (noise
      depends on the request's key, position and ``v`` only).  Typed keys
      (any ``jax.random`` implementation: keys that are not 2 words are
      hashed to 2, ``rng.key_words``) or raw uint32 key data.
    positions: ``[B]`` integer positions, required with per-request keys
      and only then: the request's token position (e.g. its sequence
      length so far), which a decode loop advances every step so every step
      draws fresh noise.  Concrete negative positions raise; traced ones
      count modulo 2^32.
    config: static ``SamplerConfig``, or an implementation name (``"xla"``,
      ``"pallas"``, ``"auto"``) for the default config with it.  Hashable:
      ``jax.jit(sample, static_argnames=("config", "return_mask"))``.  With
      ``use_fp64_gumbel`` inside your
      own ``jax.jit``, call the jitted function under
      ``with jax.enable_x64(True):`` (a clear error says so otherwise).
    return_mask: static; also return the ``SamplingMask`` of the kept sets the
      tokens were drawn from (``jaxsample._src.mask``; ``config.max_mask_ids``
      wide; a valid row's token is always listed,
      ``sampling_mask.with_token``), built from the same kept set as the
      tokens: the XLA path's
      ``reference.process``, or on the kernel path the truncation kernels'
      candidate buffer and threshold (the XLA path's kept set except where
      a top-p crossing lies within fp32 rounding of ``p``; ``logz``/``lse``
      within a few fp32 ulps: another summation order, and on a GPU
      ``exp`` by ``ex2.approx`` of ``x * (1 / T)``).

  Returns:
    ``SampleResult`` with ``tokens`` ``[B]`` int32 (always in ``[0, V)``),
    ``logprobs`` ``[B]`` fp32 under the processed distribution (None with
    ``SamplerConfig(logprobs=False)``: the same tokens) and ``valid``
    ``[B]`` (False for rows with NaN, +inf or no finite logit); with
    ``return_mask``, the pair ``(SampleResult, SamplingMask)``.
  """
  config = as_config(config)
  out = _sample(logits, params, key, positions, config, return_mask,
                processors)
  if config.logprobs:
    return out
  if not return_mask:
    return _without_logprobs(out)
  return _without_logprobs(out[0]), out[1]


def _without_logprobs(result: SampleResult) -> SampleResult:
  """``result`` with ``logprobs`` None (``SamplerConfig(logprobs=False)``;
  routes that computed them anyway drop them)."""
  return dataclasses.replace(result, logprobs=None)


def _sample(logits, params, key, positions, config: SamplerConfig,
            return_mask: bool, processors):
  """``sample`` for a checked ``config``."""
  logits = jnp.asarray(logits)
  params = dispatch.check_logits(logits, params)
  if explicit_axes(logits, 1):  # vocab-sharded under jax.jit
    return vocab_mesh_call(
        functools.partial(sample_sharded, config=config,
                          return_mask=return_mask),
        split=dict(logits=logits), rows=dict(params=params),
        keys=dict(key=key, positions=positions), processors=processors)
  batch, vocab = logits.shape
  # Inside shard_map a batch shard counts one key's rows globally.
  _, first_row = manual_rows(logits, batch)
  logits = backends.process_logits(logits, processors, config)
  streams, _ = rng.row_streams(key, positions, batch, vocab,
                               first_row=first_row)
  with jax.ensure_compile_time_eval():  # concrete params stay concrete
    params = params.canonical(vocab)
  if batch == 0:
    result = SampleResult(jnp.zeros((0,), jnp.int32),
                          jnp.zeros((0,), jnp.float32), jnp.zeros((0,), bool))
    if not return_mask:
      return result
    return result, mask.extract_sampling_mask(logits, params, config=config)
  with dispatch.x64_scope(config.use_fp64_gumbel, *jax.tree.leaves(logits),
                          key, positions,
                          *jax.tree.leaves(params)):
    result, result_mask = over_batch_shards(
        backends.backend(config).sample_rows, (logits, params, streams),
        config=config, static=(return_mask,))
  if not return_mask:
    return result
  # Valid rows' tokens are in their kept sets: listed even on overflow.
  return result, sampling_mask.with_token(result_mask, result.tokens,
                                          result.valid)
