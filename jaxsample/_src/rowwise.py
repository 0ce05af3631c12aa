"""Per-row helpers for batches of ``[B, ...]`` arrays: choosing between two
results row by row, running a branch only when some row needs it (inside
``jax.shard_map`` too: the branch functions type their outputs' varying
manual axes, ``manual_switch``), and an exact ``lax.top_k`` of long rows by runs
(``top_k``)."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp

__all__ = ["TOP_K_CHUNK", "barrier", "cond", "key_values", "manual_cond",
           "manual_switch", "mark_varying", "only_if", "pack_rows", "run_keys",
           "switch", "top_k", "total_order_keys", "unpack_rows", "varying_axes",
           "where_rows"]

TOP_K_CHUNK = 128
"""``top_k``'s first stage: the largest key of each run of this many ids."""


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
    return unknown() if unknown else manual_cond(pred, true_fn, false_fn)
  return true_fn() if taken else false_fn()


def barrier(values):
  """One ``lax.optimization_barrier`` per array of a pytree.  A barrier of
  several arrays aborts XLA in jax 0.11.2 wherever the program is
  partitioned over devices (inside ``jax.shard_map``, or a ``jit`` with an
  input placed on a mesh), e.g. TopkDecomposer on a barrier of both
  ``lax.top_k`` outputs: "cannot be downcasted to
  HloGetTupleElementInstruction"."""
  return jax.tree.map(jax.lax.optimization_barrier, values)


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over (``jax.shard_map``'s vma)."""
  return jax.typeof(x).manual_axis_type.varying


def mark_varying(x, axes):
  """``x`` typed as varying over ``axes`` too (``lax.pcast``; no data moves)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def manual_cond(pred: jax.Array, true_fn, false_fn):
  """``lax.cond`` that ``manual_switch`` types (branches may differ in the
  manual axes their outputs vary over)."""
  return manual_switch(jnp.asarray(pred, jnp.int32), [false_fn, true_fn])


def manual_switch(index: jax.Array, branches):
  """``lax.switch`` whose branches may differ in the manual axes their
  outputs vary over (inside ``jax.shard_map`` with ``check_vma``: a constant
  in one branch, a value computed from the shard in another): each output is
  marked varying over the union of the branches' axes.  Each branch is
  traced once (then replayed); outside ``shard_map`` a plain
  ``lax.switch``."""
  if not jax.sharding.get_abstract_mesh().manual_axes:
    return jax.lax.switch(index, branches)
  traced = [jax.make_jaxpr(f, return_shape=True)() for f in branches]
  axes = [frozenset().union(*(a.manual_axis_type.varying for a in avals))
          for avals in zip(*(t[0].out_avals for t in traced))]

  def replay(jaxpr, shapes):
    outs = jax.extend.core.jaxpr_as_fun(jaxpr)()
    return jax.tree.unflatten(jax.tree.structure(shapes), [
        mark_varying(o, a) for o, a in zip(outs, axes)])

  return jax.lax.switch(index, [lambda t=t: replay(*t) for t in traced])


def switch(index: jax.Array, branches):
  """``lax.switch(index, branches)``, or the one branch ``index`` picks when
  it is known while tracing (as ``cond``)."""
  try:
    taken = int(index)
  except (jax.errors.ConcretizationTypeError,
          jax.errors.TracerIntegerConversionError):
    return manual_switch(index, branches)
  return branches[min(max(taken, 0), len(branches) - 1)]()


def _is_row_word(x, batch: int) -> bool:
  """Whether ``x`` is a ``[B]`` array that ``pack_rows`` packs (32-bit
  numbers or bools: one word each; not keys)."""
  return (x.ndim == 1 and x.shape[0] == batch and
          (x.dtype == jnp.bool_ or (jnp.issubdtype(x.dtype, jnp.number) and
                                    x.dtype.itemsize == 4)))


def pack_rows(values, batch: int) -> jax.Array:
  """``[B]`` arrays of 32-bit or bool dtypes stacked as int32 ``[F, B]``
  (bitcast; bool as 0/1): one XLA op makes it, where ``F`` arrays each in
  memory (a cond's operands, a kernel's inputs) would cost a launch each on
  a GPU.  Kernels read a row of it with ``pallas.common.table_row``."""
  if not values:
    return jnp.zeros((0, batch), jnp.int32)
  return jnp.stack([v.astype(jnp.int32) if v.dtype == jnp.bool_ else
                    jax.lax.bitcast_convert_type(v, jnp.int32)
                    for v in values])


def unpack_rows(block: jax.Array, dtypes) -> list[jax.Array]:
  """The inverse of ``pack_rows``: its rows as arrays of ``dtypes``."""
  return [block[i] != 0 if d == jnp.bool_ else
          jax.lax.bitcast_convert_type(block[i], d)
          for i, d in enumerate(dtypes)]


def only_if(needed, fn, *, pack: bool = True):
  """``fn()`` if any of ``needed`` (a ``[B]`` array, or a sequence of them:
  rows of several batches), else zeros of its shapes (``cond``).

  The values ``fn`` closes over enter the cond with every ``[B]`` array of
  32-bit or bool dtype (``B`` the length of one of ``needed``) packed into
  one ``[F, B]`` operand per length (``pack_rows``): an operand must exist
  in memory, so each would otherwise cost a launch on a GPU wherever XLA
  would fuse it into its other users.
  ``fn`` returns a pytree of ``[B]`` and ``[B, W]`` arrays of 32- or 64-bit
  or bool dtypes.  With ``pack``, the branches exchange the ``[B]`` leaves
  of 32-bit or bool dtypes as one ``[F, B]`` array per length too and the
  other leaves as they are, so the zeros branch is one fill per other leaf
  and one per length for the rest rather than one per leaf; pass
  ``pack=False`` for large outputs of a branch that usually runs.
  """
  needed = list(needed) if isinstance(needed, (list, tuple)) else [needed]
  lengths = sorted({n.shape[0] for n in needed})
  row_length = lambda x: next(
      (b for b in lengths if _is_row_word(x, b)), None)
  # One trace of fn (eval_shape and then the cond's own trace would trace it
  # twice, and nested calls 2^depth times): the cond branch replays its jaxpr.
  traced, shapes = jax.make_jaxpr(fn, return_shape=True)()
  consts = list(traced.consts)
  # One operand per row length and set of manual axes the values vary
  # over (inside jax.shard_map): a replayed value keeps its type.
  group = lambda c: (row_length(c), tuple(sorted(varying_axes(c))))
  groups = sorted({group(c) for c in consts if row_length(c)})
  rows = {g: [i for i, c in enumerate(consts) if row_length(c) and
              group(c) == g] for g in groups}
  # The barrier keeps each packed operand one array: XLA would fold the
  # branch's slices of the stack back into the stack's operands.
  inputs = barrier(
      [pack_rows([consts[i] for i in rows[g]], g[0]) for g in groups])

  def replay():
    values = list(consts)
    for g, block in zip(groups, inputs):
      for i, v in zip(rows[g], unpack_rows(block, [consts[i].dtype
                                                   for i in rows[g]])):
        values[i] = v
    return jax.tree.unflatten(jax.tree.structure(shapes), jax.extend.core.
                              jaxpr_as_fun(traced.replace(consts=values))())

  zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  any_needed = jnp.any(jnp.concatenate(needed))
  if not pack:
    return cond(any_needed, replay, zeros)
  leaves, tree = jax.tree.flatten(shapes)
  length = [row_length(s) for s in leaves]

  def packed():
    values = jax.tree.leaves(replay())
    return [pack_rows([v for v, n in zip(values, length) if n == b], b)
            for b in lengths], [v for v, n in zip(values, length) if n is None]

  def empty():
    return [jnp.zeros((length.count(b), b), jnp.int32) for b in lengths], [
        jnp.zeros(s.shape, s.dtype) for s, n in zip(leaves, length)
        if n is None]

  blocks, others = cond(any_needed, packed, empty)
  columns = {b: iter(unpack_rows(block, [s.dtype for s, n in zip(leaves, length)
                                         if n == b]))
             for b, block in zip(lengths, blocks)}
  others = iter(others)
  return jax.tree.unflatten(tree, [next(columns[n]) if n else next(others)
                                   for n in length])


def total_order_keys(values: jax.Array) -> jax.Array:
  """int32 keys of fp32/bf16/fp16 ``values`` in ``lax.top_k``'s order:
  ``-NaN < -inf < ... < -0 < +0 < ... < inf < NaN``, each key the float's
  bits with the magnitude bits flipped where the sign bit is set."""
  bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def key_values(keys: jax.Array) -> jax.Array:
  """The fp32 values of ``total_order_keys`` (its inverse on fp32)."""
  return jax.lax.bitcast_convert_type(keys ^ ((keys >> 31) & 0x7FFFFFFF),
                                      jnp.float32)


def run_keys(values: jax.Array, chunk: int = TOP_K_CHUNK) -> jax.Array:
  """int32 ``[B, ceil(V / chunk)]``: the largest ``total_order_keys`` of
  each run of ``chunk`` consecutive ids of ``values`` ``[B, V]`` (one row
  reduction)."""
  batch, vocab = values.shape
  keys = total_order_keys(values)
  whole = vocab // chunk * chunk
  runs = jnp.max(keys[:, :whole].reshape(batch, -1, chunk), axis=2)
  if whole < vocab:
    runs = jnp.concatenate(
        [runs, jnp.max(keys[:, whole:], axis=1, keepdims=True)], axis=1)
  return runs


def top_k(values: jax.Array, k: int, chunk: int = TOP_K_CHUNK, *,
          runs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """``lax.top_k(values, k)`` of ``[B, V]`` fp32/bf16/fp16 rows, the same
  values and int32 ids, from one read of the row: the largest key
  (``total_order_keys``) of each run of ``chunk`` consecutive ids
  (``run_keys``, or ``runs`` when the caller has them), the ``k`` runs of
  the largest keys (lower run first among equal keys), then the top ``k`` of
  those runs' ``k * chunk`` entries laid out in id order.

  Exact, ties included (descending, the smaller id first among equal
  values): if a run holds one of the row's top ``k``, every run ranked
  above it holds a larger entry, or an equal one of a smaller id, so one
  of the top ``k`` other than that entry; at most ``k - 1`` runs rank above
  it.  Ids past ``V`` in the last run get the smallest key and come last in
  id order, after at least ``(k - 1) * chunk + 1 >= k`` real entries.  Rows
  of at most ``k * chunk`` ids take one ``lax.top_k``.
  """
  batch, vocab = values.shape
  if vocab <= k * chunk or k == 0 or jnp.dtype(values.dtype).itemsize > 4:
    top, ids = jax.lax.top_k(values, k)
    return top, ids.astype(jnp.int32)
  if runs is None:
    runs = run_keys(values, chunk)
  best = jnp.sort(jax.lax.top_k(runs, k)[1], axis=1)  # in id order
  ids = (best[:, :, None] * chunk
         + jnp.arange(chunk, dtype=best.dtype)).reshape(batch, k * chunk)
  inside = ids < vocab
  ids = jnp.minimum(ids, vocab - 1)
  candidates = jnp.where(
      inside, total_order_keys(jnp.take_along_axis(values, ids, axis=1)),
      jnp.iinfo(jnp.int32).min)
  at = jax.lax.top_k(candidates, k)[1]
  ids = jnp.take_along_axis(ids, at, axis=1).astype(jnp.int32)
  return jnp.take_along_axis(values, ids, axis=1), ids
