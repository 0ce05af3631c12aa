"""Batch-parallel sampling: calls on batch-sharded inputs run shard by shard.

Every row of a sampling call is computed from that row alone (its logits,
params and noise stream), so a batch split over devices is sampled by
running the call on each shard's rows, with no communication:

* under ``jax.jit`` with inputs sharded along the batch on a mesh of
  **Explicit** axes (``jax.make_mesh``'s default), ``per_batch_shard`` runs
  the call inside ``jax.shard_map`` over those axes (kernels included:
  ``pallas_call`` is not partitioned by XLA);
* inside the caller's own ``jax.shard_map`` the call already sees its
  shard; ``manual_rows`` gives the shard's first global row, so the
  one-key noise counters (``b * V + v``) and the kernels' launch plans are
  those of the whole batch.

Either way the results are bit-identical to the single-device call on the
whole batch.  Meshes of Auto axes carry no sharding in the types: XLA
partitions the ``jnp`` path itself (tested bit-identical); the kernel path
under Auto axes is untested (``pallas_call`` is not partitioned by XLA): use
Explicit axes or ``shard_map`` for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxsample._src import rowwise
from jaxsample._src import tuning
from jaxsample._src.params import SamplerConfig

__all__ = ["batch_split_over", "explicit_axes", "manual_rows",
           "over_batch_shards", "per_batch_shard", "shard_config"]

_BATCH_SPLIT = contextvars.ContextVar("batch_split", default=())


def explicit_axes(x, dim: int) -> tuple[str, ...]:
  """The Explicit mesh axes that shard dimension ``dim`` of ``x`` (``()``
  when none: unsharded, or a mesh of Auto axes, or outside any mesh)."""
  sharding = jax.typeof(x).sharding
  spec = tuple(sharding.spec) + (None,) * x.ndim
  axes = spec[dim]
  if axes is None:
    return ()
  axes = axes if isinstance(axes, tuple) else (axes,)
  types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
  return tuple(a for a in axes if types[a] == AxisType.Explicit)


@contextlib.contextmanager
def batch_split_over(axes: tuple[str, ...]):
  """Inside a ``jax.shard_map`` without ``check_vma`` (no vma types): the
  manual axes the batch is split over, which ``manual_rows`` then counts
  as if the arrays' types said so."""
  token = _BATCH_SPLIT.set(tuple(axes))
  try:
    yield
  finally:
    _BATCH_SPLIT.reset(token)


def manual_rows(x, batch: int, *, exclude: str | None = None):
  """``(shards, first_row)`` of a batch ``x`` ``[B_local, ...]`` inside
  ``jax.shard_map``: the number of shards of the manual axes ``x`` varies
  over and the global index of its first row, the batch split over those
  axes in mesh order (``P(("a", "b"))`` for a mesh ``("a", "b")``).  Outside
  ``shard_map`` (or for a replicated ``x``): ``(1, 0)``.  ``exclude``: a
  manual axis that splits something else (the vocabulary)."""
  mesh = jax.sharding.get_abstract_mesh()
  varying = rowwise.varying_axes(x) if mesh.manual_axes else frozenset()
  varying = varying | frozenset(_BATCH_SPLIT.get())
  axes = [a for a in mesh.axis_names if a in varying and a != exclude]
  if not axes:
    return 1, jnp.uint32(0)
  index = jnp.uint32(0)
  for a in axes:
    index = index * jnp.uint32(mesh.shape[a]) + jax.lax.axis_index(a).astype(
        jnp.uint32)
  return math.prod(mesh.shape[a] for a in axes), index * jnp.uint32(batch)


def shard_config(config: SamplerConfig, shards: int) -> SamplerConfig:
  """``config`` for a call on one of ``shards`` batch shards: its kernels
  plan as for the whole batch (``tuning.Occupancy.batch_shards``), or as for
  one row with ``config.batch_invariant``."""
  return dataclasses.replace(config, tuning=tuning.planned(
      config.tuning, shards=shards, batch_invariant=config.batch_invariant))


def per_batch_shard(entry, axes: tuple[str, ...], batched, shared, *,
                    config: SamplerConfig, static=(), out_batch_dims=0):
  """``entry(*batched, *shared, config, *static)`` run on each batch shard
  inside ``jax.shard_map`` over the Explicit mesh axes ``axes``.

  ``batched``: a pytree of arrays with the batch as leading dimension,
  resharded to ``P(axes)`` (a no-op where they already are); ``shared``:
  arrays every shard reads whole (replicated).  ``out_batch_dims``: a
  pytree prefix of ``entry``'s output giving each output's batch dimension.
  ``entry`` gets ``config`` planned for the whole batch (``shard_config``).
  """
  leaves = jax.tree.leaves(batched)
  mesh = jax.typeof(leaves[0]).sharding.mesh
  shards = math.prod(mesh.shape[a] for a in axes)
  batch = leaves[0].shape[0]
  if batch % shards:
    raise ValueError(
        f"a batch of {batch} rows cannot be split over the {shards} devices "
        f"of mesh axes {axes}: pad the batch to a multiple of {shards}")
  rows = lambda a: jax.sharding.reshard(a, P(axes, *(None,) * (a.ndim - 1)))
  batched = jax.tree.map(rows, batched)
  shared = jax.tree.map(lambda a: jax.sharding.reshard(a, P()), shared)
  out_specs = jax.tree.map(lambda d: P(*(None,) * d, axes), out_batch_dims)

  def body(batched, shared):
    return entry(*batched, *shared, shard_config(config, shards), *static)

  # check_vma off: the kernels' interpret mode cannot lower with it (JAX
  # 0.11.2), and every output is declared split over ``axes`` anyway.
  return jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P()),
                       out_specs=out_specs, check_vma=False)(batched, shared)


def over_batch_shards(entry, batched: tuple, shared: tuple = (), *,
                      config: SamplerConfig, static: tuple = (),
                      out_batch_dims=0):
  """``entry(*batched, *shared, config, *static)`` (a backend's entry point,
  ``jaxsample._src.backends``) for inputs that may be split along the
  batch: ``per_batch_shard`` when the first leaf of ``batched`` is split
  over Explicit mesh axes, else ``entry`` itself, with ``config`` planned
  for the whole batch inside the caller's ``jax.shard_map``
  (``manual_rows``, ``shard_config``).  ``batched``: the arguments with the
  batch as leading dimension; ``shared``: those every shard reads whole;
  ``static``: the arguments after ``config`` (hashable)."""
  first = jax.tree.leaves(batched)[0]
  if axes := explicit_axes(first, 0):
    return per_batch_shard(entry, axes, batched, shared, config=config,
                           static=static, out_batch_dims=out_batch_dims)
  shards, _ = manual_rows(first, first.shape[0])
  return entry(*batched, *shared, shard_config(config, shards), *static)
