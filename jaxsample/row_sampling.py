"""``sample_rows``: the backends of ``jaxsample.sample`` on checked inputs.

Shared by ``sampling.sample`` (one device, or a batch shard) and
``sharded.sample_sharded`` (a truncating batch on ``implementation="xla"``
samples the gathered vocabulary): canonical params and the rows' noise
streams in, ``(SampleResult, mask or None)`` out.  Calls that ask for no
logprobs and set ``race_candidates`` (no mask, fp32 noise) race first
(``jaxsample.race_first``).
"""

from __future__ import annotations

import dataclasses

from jaxsample import (dispatch, race_first, reference, rng, sampling_mask,
                       xla_search)
from jaxsample.pallas import bitmask, sampler
from jaxsample.params import SamplerConfig, SamplingParams

__all__ = ["races_first", "sample_rows"]


def sample_rows(logits, params: SamplingParams, streams: rng.RowStreams,
                config: SamplerConfig, return_mask: bool):
  """``sample``'s ``(SampleResult, mask or None)`` for canonical ``params``
  and the rows' noise streams, on the backend ``config`` picks (the mask
  before ``sampling_mask.with_token``)."""
  if races_first(config, return_mask):
    return _race_first(logits, params, streams, config), None
  if dispatch.use_pallas(config):
    out = sampler.sample_pallas(logits, params, streams, config, return_mask)
    return out if return_mask else (out, None)
  return _sample_xla(logits, params, streams, config, return_mask)


def races_first(config: SamplerConfig, return_mask: bool) -> bool:
  """Whether ``sample`` takes the race-first route (``jaxsample.race_first``):
  no logprobs asked for, ``race_candidates >= 1``, no mask, fp32 noise, on
  the kernels or the sort reference.  ``"xla_search"`` keeps its route
  (its candidates race without drawing the row's noise: on CPU, B = 8, V =
  32000, race-first took 1.9x to 3.5x its CPU time on LLM-like rows and
  top-k 50 + top-p 0.9, and 0.4x on top-p 0.95 over flat rows,
  ``docs/truncation.md``)."""
  return not (config.logprobs or not config.race_candidates or return_mask
              or config.use_fp64_gumbel or
              dispatch.backend(config) == "xla_search")


def _race_first(logits, params: SamplingParams, streams: rng.RowStreams,
                config: SamplerConfig):
  """Race-first ``SampleResult`` (logprobs None) on ``config``'s backend;
  unresolved rows take its threshold route."""
  with_logprobs = dataclasses.replace(config, logprobs=True)
  if dispatch.use_pallas(config):
    if isinstance(logits, bitmask.MaskedLogits):  # the kernels' bitmask
      return sampler.sample_pallas(logits, params, streams, with_logprobs,
                                   False)
    return sampler.sample_race_first(logits, params, streams, config)
  return race_first.sample(
      logits, params, streams, generator=config.rng,
      candidates=config.race_candidates,
      fallback=lambda _: _sample_xla(logits, params, streams, with_logprobs,
                                   False)[0].tokens)


def _sample_xla(logits, params: SamplingParams, streams: rng.RowStreams,
                config: SamplerConfig, return_mask: bool):
  """The XLA paths, sort-based (``"xla"``) or not (``"xla_search"``):
  ``(SampleResult, mask or None)``."""
  order_width = config.max_mask_ids * return_mask
  if dispatch.backend(config) == "xla_search":
    result, proc = xla_search.sample(
        logits, params, streams, generator=config.rng,
        fp64=config.use_fp64_gumbel, order_width=order_width)
  else:
    proc = reference.process(logits, params, order_width=order_width)
    result = reference.sample_reference(
        logits, params, streams, generator=config.rng,
        fp64=config.use_fp64_gumbel, proc=proc)
  if not return_mask:
    return result, None
  return result, sampling_mask.from_processed(proc, params,
                                              config.max_mask_ids)
