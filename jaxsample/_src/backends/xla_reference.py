"""``sample_rows``: the backends of ``jaxsample.sample`` on checked inputs.

Shared by ``sampling.sample`` (one device, or a batch shard) and
``sharded.sample_sharded`` (a truncating batch on ``implementation="xla"``
samples the gathered vocabulary): canonical params and the rows' noise
streams in, ``(SampleResult, mask or None)`` out.
"""

from __future__ import annotations

from jaxsample._src import backends as dispatch
from jaxsample._src import reference, rng, sampling_mask, xla_search
from jaxsample._src.backends import pallas as sampler
from jaxsample._src.params import SamplerConfig, SamplingParams

__all__ = ["sample_rows"]


def sample_rows(logits, params: SamplingParams, streams: rng.RowStreams,
                config: SamplerConfig, return_mask: bool):
  """``sample``'s ``(SampleResult, mask or None)`` for canonical ``params``
  and the rows' noise streams, on the backend ``config`` picks (the mask
  before ``sampling_mask.with_token``)."""
  if dispatch.use_pallas(config):
    out = sampler.sample_pallas(logits, params, streams, config, return_mask)
    return out if return_mask else (out, None)
  return _sample_xla(logits, params, streams, config, return_mask)


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
