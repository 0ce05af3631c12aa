"""Per-row helpers for batches of ``[B, ...]`` arrays: choosing between two
results row by row, and running a branch only when some row needs it."""

from __future__ import annotations

import math

import jax
import jax.extend
import jax.numpy as jnp


def where_rows(where: jax.Array, a, b):
  """Per-row choice between two pytrees of ``[B, ...]`` arrays."""
  return jax.tree.map(
      lambda u, v: jnp.where(where.reshape((-1,) + (1,) * (u.ndim - 1)), u, v),
      a, b)


def cond(pred: jax.Array, true_fn, false_fn):
  """``lax.cond(pred, true_fn, false_fn)``, or the one branch ``pred`` picks
  when it is known while tracing (computed under
  ``jax.ensure_compile_time_eval`` from parameters the caller's ``jit``
  closes over, or in an eager call): only that branch is traced and
  compiled, and no predicate goes to the host."""
  try:
    taken = bool(pred)
  except jax.errors.ConcretizationTypeError:
    taken = None
  if taken is None:
    return jax.lax.cond(pred, true_fn, false_fn)
  return true_fn() if taken else false_fn()


def only_if(needed: jax.Array, fn, *, pack: bool = True):
  """``fn()`` if any of ``needed``, else zeros of its shapes (``cond``).

  ``fn`` returns a pytree of ``[B]`` and ``[B, W]`` arrays of 32- or 64-bit
  or bool dtypes.  With ``pack``, the branches exchange one int32 ``[B, F]``
  array (the leaves side by side, bitcast), so the zeros branch is one fill
  rather than one per leaf (each a launch on a GPU); pass ``pack=False`` for
  large outputs of a branch that usually runs.
  """
  # One trace of fn (eval_shape and then the cond's own trace would trace it
  # twice, and nested calls 2^depth times): the cond branch replays its jaxpr.
  traced, shapes = jax.make_jaxpr(fn, return_shape=True)()
  replay = jax.extend.core.jaxpr_as_fun(traced)
  fn = lambda: jax.tree.unflatten(jax.tree.structure(shapes), replay())
  zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  if not pack:
    return cond(jnp.any(needed), fn, zeros)
  leaves, tree = jax.tree.flatten(shapes)
  batch = leaves[0].shape[0]
  # int32 words per row of each leaf (bool: one word per element).
  words = [math.prod(s.shape[1:]) * max(s.dtype.itemsize // 4, 1)
           for s in leaves]

  def packed():
    return jnp.concatenate([
        (leaf.astype(jnp.int32) if leaf.dtype == jnp.bool_ else
         jax.lax.bitcast_convert_type(leaf, jnp.int32)).reshape(batch, -1)
        for leaf in jax.tree.leaves(fn())], axis=1)

  block = cond(jnp.any(needed), packed,
               lambda: jnp.zeros((batch, sum(words)), jnp.int32))
  out, start = [], 0
  for s, size in zip(leaves, words):
    column = block[:, start:start + size]
    start += size
    if s.dtype == jnp.bool_:
      out.append(column.reshape(s.shape) != 0)
    else:
      column = column.reshape(s.shape + ((2,) if s.dtype.itemsize == 8 else ()))
      out.append(jax.lax.bitcast_convert_type(column, s.dtype))
  return jax.tree.unflatten(tree, out)
