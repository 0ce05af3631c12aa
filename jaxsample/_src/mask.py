"""``jaxsample.extract_sampling_mask``: the kept set each row would be sampled
from, with its mass, and no token.  The mask itself (``SamplingMask``: its
fields, host forms and the rows the sampler treats specially) is defined in
``jaxsample._src.sampling_mask``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxsample._src import backends, dispatch
from jaxsample._src.parallel.batch import explicit_axes, over_batch_shards
from jaxsample._src.parallel.vocab import (extract_sampling_mask_sharded,
                                           vocab_mesh_call)
from jaxsample._src.params import SamplerConfig, SamplingParams, as_config
from jaxsample._src.processors import LogitsProcessors
from jaxsample._src.sampling_mask import MaskOverflowError, SamplingMask

__all__ = ["MaskOverflowError", "SamplingMask", "extract_sampling_mask"]


def extract_sampling_mask(logits: jax.Array, params: SamplingParams, *,
                          config: SamplerConfig | None = None,
                          processors: LogitsProcessors | None = None
                          ) -> SamplingMask:
  """The sampling mask of ``logits`` ``[B, V]`` under ``params``, no token.

  Equivalent to ``jaxsample.sample(logits, params, key, return_mask=True,
  config=config)[1]`` for any key, on the backend ``config.implementation``
  picks (``backends``' ``extract_rows``): ``xla_search.process`` off GPU by
  default, ``reference.process`` (a sort of each row) with
  ``implementation="xla"``; the kernel path is the truncation kernels'
  kept sets without a race, in 32 bits whatever ``use_fp64_gumbel``
  says (``logz``/``lse`` equal the kernel path's up to fp32 rounding: see
  ``sample``).  ``processors``: as ``sample``'s (the mask of the processed
  distribution).

  Raises:
    ValueError: for logits that ``jaxsample.sample`` rejects.
  """
  config = as_config(config)
  logits = jnp.asarray(logits)
  params = dispatch.check_logits(logits, params)
  if explicit_axes(logits, 1):  # vocab-sharded under jit
    return vocab_mesh_call(
        functools.partial(extract_sampling_mask_sharded,
                          config=config),
        split=dict(logits=logits), rows=dict(params=params),
        processors=processors)
  logits = backends.process_logits(logits, processors, config)
  with jax.ensure_compile_time_eval():  # concrete params stay concrete
    params = params.canonical(logits.shape[1])
  # An empty batch has no rows to launch kernels or searches on.
  rows = (backends.backend(config) if logits.shape[0] else
          backends.xla_reference)
  return over_batch_shards(rows.extract_rows, (logits, params), config=config)
