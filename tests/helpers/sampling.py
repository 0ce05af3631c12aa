"""The public sampler jitted once per static config (shares compilations),
and ``SamplingParams`` built from raw arrays."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample


_jitted_sample = jax.jit(jaxsample.sample, static_argnames=("config",))


def without_truncation(params, vocab: int) -> bool:
  """Whether no sampled request of concrete ``params`` has a filter on."""
  canon = params.canonical(vocab)
  return not np.any(np.asarray(canon.truncates()) &
                    (np.asarray(canon.temperature) > 0))


_closing_over: dict = {}


def closing_over(params, fn, *static):
  """``jax.jit(fn(params))``, one per params value and ``static`` (cached).

  The kernel path's static-params case (``rowwise.cond``): with params the
  jitted function closes over, a batch without filters compiles the Gumbel
  branch alone; in interpret mode the truncation branch it skips costs ~10 s
  of compile per shape.  Tests of untruncated batches on the kernels use it;
  ``test_sample.test_static_and_traced_params_agree`` pins it to the traced
  path.
  """
  values = tuple((a.dtype.str, a.shape, a.tobytes())
                 for a in map(np.asarray, jax.tree.leaves(params)))
  key = (values,) + static
  if key not in _closing_over:
    _closing_over[key] = jax.jit(fn(params))
  return _closing_over[key]


def run_sample(logits, params, key, *, positions=None, impl="xla",
               rng="philox", fp64=False, jit=True, traced_params=False,
               **config_kw):
  """``jaxsample.sample`` with a config built from the arguments, as numpy.

  Jitted by default (compilations are cached per shape and config; kernel
  runs of batches without filters close over the params, ``closing_over``,
  unless ``traced_params``); the FP64 path runs under
  ``jax.enable_x64(True)`` as the docs require for jit.
  """
  config = jaxsample.SamplerConfig(rng=rng, implementation=impl,
                                   use_fp64_gumbel=fp64, **config_kw)
  fn = functools.partial(_jitted_sample if jit else jaxsample.sample,
                         config=config)
  if (jit and impl == "pallas" and not traced_params and
      without_truncation(params, np.shape(logits)[1])):
    closed = closing_over(params, lambda p: lambda x, k, pos: jaxsample.sample(
        x, p, k, positions=pos, config=config), config)
    fn = lambda x, p, k, positions: closed(x, k, positions)
  with jax.enable_x64(True) if fp64 and jit else contextlib.nullcontext():
    out = fn(logits, params, key, positions=positions)
    return jax.tree.map(np.asarray, jax.device_get(out))


def make_params(batch, **kw):
  """``SamplingParams`` built directly from arrays (no validation): the traced
  path, where out-of-range values follow ``SamplingParams.canonical``."""
  defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
  defaults.update(kw)
  dt = dict(temperature=jnp.float32, top_k=jnp.int32, top_p=jnp.float32,
            min_p=jnp.float32)
  return jaxsample.SamplingParams(**{
      name: jnp.broadcast_to(jnp.asarray(v, dt[name]), (batch,))
      for name, v in defaults.items()})
