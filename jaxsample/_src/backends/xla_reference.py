"""Backend ``"xla"``: the XLA reference, which sorts each truncating row
(``reference``, ``spec_reference``: the definitions of the semantics).

Also the vocab-parallel ``sample_sharded``'s route for a truncating batch
on ``implementation="xla"`` (it samples the gathered vocabulary); the
``"xla_search"`` backend shares the steps after its kept sets
(``processed_mask``, ``extract_with``, ``verify_with``)."""

from __future__ import annotations

from jaxsample._src import reference, rng, sampling_mask, spec_reference
from jaxsample._src.params import SamplerConfig, SamplingParams
from jaxsample._src.processors import LogitsProcessors, maybe_apply

__all__ = ["extract_rows", "extract_with", "process_logits",
           "processed_mask", "sample_rows", "verify_rows", "verify_with"]


def process_logits(logits, processors: LogitsProcessors | None,
                   config: SamplerConfig):
  """The rows the XLA backends read: ``processors.maybe_apply``'s pre-pass
  (or ``logits`` as they are; ``config`` changes nothing)."""
  del config
  return maybe_apply(logits, processors)


def sample_rows(logits, params: SamplingParams, streams: rng.RowStreams,
                config: SamplerConfig, return_mask: bool):
  """``sample``'s ``(SampleResult, mask or None)`` on the reference."""
  # 1. processors: applied by ``process_logits``.
  # 2. parameters: canonical ``params``; the mask's width.
  order_width = config.max_mask_ids * return_mask
  # 3. kept sets: a sort of each truncating row.
  proc = reference.process(logits, params, order_width=order_width)
  # 4. race: Gumbel-max over each kept set.
  result = reference.sample_reference(
      logits, params, streams, generator=config.rng,
      fp64=config.use_fp64_gumbel, proc=proc)
  # 5. outputs
  return result, processed_mask(proc, params, config, return_mask)


def extract_rows(logits, params: SamplingParams,
                 config: SamplerConfig) -> sampling_mask.SamplingMask:
  """``extract_sampling_mask`` on the reference."""
  return extract_with(reference.process, logits, params, config)


def verify_rows(target_logits, draft_tokens, n, params: SamplingParams, key,
                positions, draft_logits, synthetic_rates,
                config: SamplerConfig, return_mask: bool):
  """``rejection_sample`` on the reference (``spec_reference.reject_xla``)."""
  return verify_with(reference.process, target_logits, draft_tokens, n,
                     params, key, positions, draft_logits, synthetic_rates,
                     config, return_mask)


def processed_mask(proc: reference.Processed, params: SamplingParams,
                   config: SamplerConfig, return_mask: bool):
  """The masks of the kept sets ``proc`` (``config.max_mask_ids`` wide), or
  None without ``return_mask``."""
  if not return_mask:
    return None
  return sampling_mask.from_processed(proc, params, config.max_mask_ids)


def extract_with(process, logits, params: SamplingParams,
                 config: SamplerConfig) -> sampling_mask.SamplingMask:
  """``extract_rows`` with the kept sets of ``process`` (``reference.
  process``'s signature)."""
  # 1. processors: applied by ``process_logits``.  2. parameters: canonical.
  # 3. kept sets, with their first ids by probability.
  proc = process(logits, params, order_width=config.max_mask_ids)
  # 5. outputs (no race)
  return processed_mask(proc, params, config, True)


def verify_with(process, target_logits, draft_tokens, n,
                params: SamplingParams, key, positions, draft_logits,
                synthetic_rates, config: SamplerConfig, return_mask: bool):
  """``verify_rows`` with the kept sets of ``process``: ``spec_reference.
  reject_xla`` (processors applied by ``rejection_sample``; kept sets,
  acceptance, the emitted token's race and the masks in its steps)."""
  return spec_reference.reject_xla(
      target_logits, draft_tokens, n, params, key, draft_logits,
      synthetic_rates, positions, config.rng, config.use_fp64_gumbel,
      config.max_mask_ids * return_mask, process)
