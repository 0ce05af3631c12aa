"""Backend ``"xla_search"`` (the default off GPU): the sorting-free XLA
sampler (``jaxsample._src.xla_search``: ``lax.top_k`` candidates,
exactness checks, exact count and mass searches); the steps after the
kept sets are the reference backend's."""

from __future__ import annotations

from jaxsample._src import rng, sampling_mask, xla_search
from jaxsample._src.backends import xla_reference
from jaxsample._src.params import SamplerConfig, SamplingParams

__all__ = ["extract_rows", "process_logits", "sample_rows", "verify_rows"]

process_logits = xla_reference.process_logits


def sample_rows(logits, params: SamplingParams, streams: rng.RowStreams,
                config: SamplerConfig, return_mask: bool):
  """``sample``'s ``(SampleResult, mask or None)`` without a sort."""
  # 1. processors: applied by ``process_logits``.
  # 2. parameters: canonical ``params``; the mask's width.
  # 3. + 4. kept sets (searched, no sort) and the race over them.
  result, proc = xla_search.sample(
      logits, params, streams, generator=config.rng,
      fp64=config.use_fp64_gumbel,
      order_width=config.max_mask_ids * return_mask)
  # 5. outputs
  return result, xla_reference.processed_mask(proc, params, config,
                                              return_mask)


def extract_rows(logits, params: SamplingParams,
                 config: SamplerConfig) -> sampling_mask.SamplingMask:
  """``extract_sampling_mask`` without a sort (``xla_search.process``)."""
  return xla_reference.extract_with(xla_search.process, logits, params,
                                    config)


def verify_rows(target_logits, draft_tokens, n, params: SamplingParams, key,
                positions, draft_logits, synthetic_rates,
                config: SamplerConfig, return_mask: bool):
  """``rejection_sample``: the reference's verification on the kept sets
  ``xla_search.process`` finds."""
  return xla_reference.verify_with(
      xla_search.process, target_logits, draft_tokens, n, params, key,
      positions, draft_logits, synthetic_rates, config, return_mask)
