"""jaxsample._src.rowwise: per-row choices and branches run only when needed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample._src import rowwise

BATCH = 3


def leaves():
  """One of each leaf kind ``only_if`` exchanges: [B] int32, float32 and
  bool, a [B, W] leaf, and a nested [B] leaf."""
  return (jnp.arange(BATCH, dtype=jnp.int32) - 1,
          jnp.where(jnp.arange(BATCH) == 2, -jnp.inf,
                    jnp.arange(BATCH, dtype=jnp.float32) / 3),
          jnp.array([True, False, True]),
          jnp.arange(BATCH * 5, dtype=jnp.int32).reshape(BATCH, 5),
          {"nested": jnp.full((BATCH,), -7.5, jnp.float32)})


def assert_trees_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape, (g, w)
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("needed", [[False, True, False], [False] * BATCH])
def test_only_if_returns_the_branch_or_zeros(pack, needed):
  got = jax.jit(lambda n: rowwise.only_if(n, leaves, pack=pack))(
      jnp.array(needed))
  want = leaves() if any(needed) else jax.tree.map(jnp.zeros_like, leaves())
  assert_trees_equal(got, want)


def test_only_if_passes_64_bit_leaves():
  with jax.enable_x64(True):
    fn = lambda: (jnp.arange(BATCH, dtype=jnp.float64) / 3,
                  jnp.arange(BATCH, dtype=jnp.int64) - 2**40,
                  jnp.ones((BATCH, 2), jnp.float64) / 7)
    assert_trees_equal(
        jax.jit(lambda n: rowwise.only_if(n, fn))(jnp.ones(BATCH, bool)), fn())


def test_only_if_packs_the_rows_it_closes_over():
  """Closed-over ``[B]`` arrays of 32-bit and bool dtypes enter the cond as
  one operand, others (wider arrays, keys) as they are; the results do not
  change."""
  def outer(x, k, needed, wide, keys):
    return rowwise.only_if(needed, lambda: (
        x * 2, jnp.where(needed, k, -1), wide.sum(axis=1),
        jax.random.key_data(keys)[:, 0]))

  args = (jnp.array([0.5, -jnp.inf, 3.0]), jnp.array([4, -5, 6], jnp.int32),
          jnp.array([True, False, True]), jnp.ones((BATCH, 4)),
          jax.random.split(jax.random.key(0), BATCH))
  x, k, needed, wide, keys = args
  assert_trees_equal(jax.jit(outer)(*args), (
      x * 2, jnp.where(needed, k, -1), wide.sum(axis=1),
      jax.random.key_data(keys)[:, 0]))
  jaxpr = jax.make_jaxpr(outer)(*args).jaxpr
  [cond] = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
  operands = sorted(str(v.aval) for v in cond.invars[1:])  # after the index
  assert operands == sorted([f"int32[3,{BATCH}]", f"float32[{BATCH},4]",
                             f"key<fry>[{BATCH}]"]), operands


def test_only_if_with_known_rows_takes_one_branch():
  """Concrete ``needed`` (an eager call): no ``lax.cond``, same results."""
  assert_trees_equal(rowwise.only_if(jnp.array([True, False, False]), leaves),
                     leaves())
  assert_trees_equal(rowwise.only_if(jnp.zeros(BATCH, bool), leaves),
                     jax.tree.map(jnp.zeros_like, leaves()))


def test_where_rows_picks_per_row():
  a, b = leaves(), jax.tree.map(lambda x: x + 1 if x.dtype != bool else ~x,
                                leaves())
  where = jnp.array([True, False, True])
  got = rowwise.where_rows(where, a, b)
  want = jax.tree.map(lambda u, v: np.where(
      np.asarray(where).reshape((-1,) + (1,) * (u.ndim - 1)), u, v), a, b)
  assert_trees_equal(got, jax.tree.map(jnp.asarray, want))
