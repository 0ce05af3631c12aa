"""Sharded calls and their checks: vocab-parallel calls
(``jaxsample._src.parallel.vocab``) as one jitted ``jax.shard_map``, the
mixed batch the sharding tests split, bit-for-bit comparison of results."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxsample
from jaxsample import sharded


VOCAB_SPLIT = P("b", "v")


def vocab_parallel(fn, shape=(1, 2), *, specs=(VOCAB_SPLIT, P("b")),
                   out_specs=P("b"), check_vma=True):
  """``fn`` (a ``jaxsample._src.parallel.vocab`` call on mesh axis ``"v"``) as one jitted
  ``jax.shard_map`` over a ``("b", "v")`` mesh of ``shape``, called on whole
  arrays: ``run(*args)`` puts each argument on the mesh by its spec of
  ``specs`` (by default logits split ``P("b", "v")`` and params ``P("b")``;
  a None argument stays None) and returns ``fn``'s results ``out_specs``."""
  mesh = jax.make_mesh(shape, ("b", "v"))
  body = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs,
                               out_specs=out_specs, check_vma=check_vma))

  def run(*args):
    with jax.set_mesh(mesh):
      return body(*(None if a is None else jax.device_put(a, s)
                    for a, s in zip(args, specs, strict=True)))

  return run


def sample_vocab_parallel(key, config, shape=(1, 2), *, return_mask=False,
                          check_vma=True):
  """``vocab_parallel`` of ``sharded.sample_sharded(x, params, key)``:
  ``run(x, params)``."""
  return vocab_parallel(lambda x, p: sharded.sample_sharded(
      x, p, key, axis_name="v", config=config, return_mask=return_mask),
                        shape, check_vma=check_vma)


def truncating_params(batch):
  """A batch of greedy, plain and truncated rows (top-k, top-p, min-p)."""
  return jaxsample.SamplingParams.make(
      batch, temperature=[1.0, 0.7, 0.0, 1.3] * (batch // 4),
      top_k=[0, 5, 0, 0] * (batch // 4), top_p=[1.0, 0.9, 1.0, 0.8] * (batch // 4),
      min_p=[0.0, 0.0, 0.0, 0.05] * (batch // 4))


def assert_same_leaves(want, got):
  """Every leaf of ``got`` equals ``want``'s bit for bit."""
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def require_two_gpus():
  """Skips the test unless JAX runs on at least 2 GPUs."""
  if jax.default_backend() != "gpu" or jax.device_count() < 2:
    pytest.skip("needs 2 GPUs")
