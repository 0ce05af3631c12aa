"""The backends of ``sample``, ``extract_sampling_mask`` and
``rejection_sample``."""

from __future__ import annotations

import jax

from jaxsample._src.params import SamplerConfig

__all__ = ["backend", "use_pallas"]


def backend(config: SamplerConfig) -> str:
  """The backend ``config.implementation`` selects here: ``"pallas"``,
  ``"xla_search"`` or ``"xla"`` (``"auto"``: the kernels on GPU, else the
  sorting-free XLA path)."""
  if config.implementation == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla_search"
  return config.implementation


def use_pallas(config: SamplerConfig) -> bool:
  """Whether ``config.implementation`` selects the Pallas kernels here."""
  return backend(config) == "pallas"
