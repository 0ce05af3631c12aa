"""Shared by the public entry points (``sample``, ``extract_sampling_mask``,
``spec.rejection_sample``) and the vocab-parallel ones: the logits check
and the scoped x64 of the FP64 path (the backend choice:
``jaxsample._src.backends``)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from jaxsample._src.params import SamplingParams

__all__ = ["check_logits", "x64_scope"]


def check_logits(logits, params: SamplingParams) -> SamplingParams:
  """``params`` as ``[B]`` arrays (``SamplingParams.rows``) for logits
  ``[B, V]``; raises ``ValueError`` for logits that are not ``[B, V]``
  floats or params that do not fit them."""
  if logits.ndim != 2:
    raise ValueError(f"logits must be [B, V]; got shape {logits.shape}")
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"logits must be floating point; got {logits.dtype}")
  if logits.shape[1] == 0:
    raise ValueError("logits must have a non-empty vocabulary (V >= 1)")
  return SamplingParams.rows(params, logits.shape[0])


def x64_scope(enabled: bool, *arrays):
  """Scoped x64 for the FP64 Gumbel path; a no-op otherwise.

  JAX lowers a jitted function after tracing it, outside any scope entered
  during the trace, so under an outer ``jit`` the caller must hold the scope
  for the whole call: ``with jax.enable_x64(True): jitted(...)``.
  """
  if not enabled:
    return contextlib.nullcontext()
  traced = any(isinstance(a, jax.core.Tracer) for a in arrays)
  if traced and not jax.config.read("jax_enable_x64"):
    raise ValueError(
        "use_fp64_gumbel=True under jax.jit needs x64 while the jitted "
        "function is traced and compiled: call it inside "
        "`with jax.enable_x64(True):` (eager calls enable it themselves)")
  return jax.enable_x64(True)
