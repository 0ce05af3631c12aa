"""Per-row helpers for batches of ``[B, ...]`` arrays: choosing between two
results row by row, and running a branch only when some row needs it."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp


def where_rows(where: jax.Array, a, b):
  """Per-row choice between two pytrees of ``[B, ...]`` arrays."""
  return jax.tree.map(
      lambda u, v: jnp.where(where.reshape((-1,) + (1,) * (u.ndim - 1)), u, v),
      a, b)


def cond(pred: jax.Array, true_fn, false_fn, *, unknown=None):
  """``lax.cond(pred, true_fn, false_fn)``, or the one branch ``pred`` picks
  when it is known while tracing (computed under
  ``jax.ensure_compile_time_eval`` from parameters the caller's ``jit``
  closes over, or in an eager call): only that branch is traced and
  compiled, and no cond runs.  ``unknown``: a function giving the same
  result for either ``pred``, called instead of the ``lax.cond`` when
  ``pred`` is not known (on a GPU a cond costs every call the trip of its
  predicate, 6-10 us of a decode loop's step on an H100)."""
  try:
    taken = bool(pred)
  except jax.errors.ConcretizationTypeError:
    taken = None
  if taken is None:
    return unknown() if unknown else jax.lax.cond(pred, true_fn, false_fn)
  return true_fn() if taken else false_fn()


def only_if(needed: jax.Array, fn, *, pack: bool = True):
  """``fn()`` if any of ``needed``, else zeros of its shapes (``cond``).

  ``fn`` returns a pytree of ``[B]`` and ``[B, W]`` arrays of 32- or 64-bit
  or bool dtypes.  With ``pack``, the branches exchange the ``[B]`` leaves as
  one int32 ``[B, F]`` array (side by side, bitcast) and each ``[B, W]`` leaf
  as it is, so the zeros branch is one fill per wide leaf and one for the
  rest rather than one per leaf (each a launch on a GPU), and XLA's fusions
  of the ``[B]`` leaves read a narrow array; pass ``pack=False`` for large
  outputs of a branch that usually runs.
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
  wide = [s.ndim > 1 for s in leaves]
  # int32 words per row of each [B] leaf (bool: one word per element).
  words = [max(s.dtype.itemsize // 4, 1) for s in leaves]

  def packed():
    values = jax.tree.leaves(fn())
    block = jnp.concatenate([jnp.zeros((batch, 0), jnp.int32)] + [
        (leaf.astype(jnp.int32) if leaf.dtype == jnp.bool_ else
         jax.lax.bitcast_convert_type(leaf, jnp.int32)).reshape(batch, -1)
        for leaf, w in zip(values, wide) if not w], axis=1)
    return block, [v for v, w in zip(values, wide) if w]

  def empty():
    narrow = sum(n for n, w in zip(words, wide) if not w)
    return jnp.zeros((batch, narrow), jnp.int32), [
        jnp.zeros(s.shape, s.dtype) for s, w in zip(leaves, wide) if w]

  block, wide_values = cond(jnp.any(needed), packed, empty)
  out, start, wide_values = [], 0, iter(wide_values)
  for s, size, w in zip(leaves, words, wide):
    if w:
      out.append(next(wide_values))
      continue
    column = block[:, start:start + size]
    start += size
    if s.dtype == jnp.bool_:
      out.append(column[:, 0] != 0)
    else:
      out.append(jax.lax.bitcast_convert_type(
          column.reshape(s.shape + ((2,) if size == 2 else ())), s.dtype))
  return jax.tree.unflatten(tree, out)
