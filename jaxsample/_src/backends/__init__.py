"""The backend table: ``sample``, ``extract_sampling_mask`` and
``rejection_sample`` validate and canonicalize their inputs, then call one
backend module, the one ``config.implementation`` picks (``backend``).

Every backend module defines the same entry points (``ENTRY_POINTS``), each
on checked inputs (canonical ``[B]`` params, ``B >= 1`` but for
``process_logits``), reading top-down as numbered steps: processors ->
parameters -> kept sets -> race -> outputs.

* ``process_logits(logits, processors, config)``: the rows the backend
  reads, the logits processors applied (step 1; before the batch is split);
* ``sample_rows(logits, params, streams, config, return_mask)``:
  ``sample``'s ``(SampleResult, mask or None)`` for the rows' noise streams
  (the mask before ``sampling_mask.with_token``);
* ``extract_rows(logits, params, config)``: ``extract_sampling_mask``'s
  ``SamplingMask``;
* ``verify_rows(target_logits, draft_tokens, n, params, key, positions,
  draft_logits, synthetic_rates, config, return_mask)``:
  ``rejection_sample``'s ``(SpecResult, the target rows' masks or None)``
  for per-request keys and clipped draft counts ``n``.

``parallel.batch.over_batch_shards`` runs any entry point shard by shard.
"""

from __future__ import annotations

import types

import jax

from jaxsample._src.backends import pallas, xla_reference, xla_search
from jaxsample._src.params import SamplerConfig

__all__ = ["BACKENDS", "ENTRY_POINTS", "backend", "backend_name",
           "process_logits"]

BACKENDS = {"xla": xla_reference, "xla_search": xla_search, "pallas": pallas}
ENTRY_POINTS = ("process_logits", "sample_rows", "extract_rows",
                "verify_rows")


def backend_name(config: SamplerConfig) -> str:
  """The backend ``config.implementation`` selects here: ``"pallas"``,
  ``"xla_search"`` or ``"xla"`` (``"auto"``: the kernels on GPU, else the
  sorting-free XLA path)."""
  if config.implementation == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla_search"
  return config.implementation


def backend(config: SamplerConfig) -> types.ModuleType:
  """The backend module ``config`` selects here (``BACKENDS``)."""
  return BACKENDS[backend_name(config)]


def process_logits(logits, processors, config: SamplerConfig):
  """The rows ``config``'s backend reads: its ``process_logits``."""
  return backend(config).process_logits(logits, processors, config)
