"""``jaxsample.pallas.order``: a listing's largest entries, in order."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample.pallas import order


def listing_batch(size: int, seed: int):
  """``(y, ids, count, rows)`` of 10 rows covering the kernel's cases."""
  r = np.random.default_rng(seed)
  rows = 10
  y = r.standard_normal((rows, size)).astype(np.float32)
  ids = np.stack([r.permutation(4 * size)[:size] for _ in range(rows)])
  count = np.full(rows, size)
  y[1] = np.round(y[1] * 2)  # groups of ties, ordered by id
  ids[1] = np.arange(size)
  y[2, ::7] = -np.inf  # holes
  count[2] = size - size // 3
  count[3] = max(size // 5, 1)  # fewer entries than most widths
  y[5] = 1.5  # one value: one bucket
  count[6] = size + 17  # above the buffer: all of it
  y[7] = np.sort(y[7])  # ascending slots: splitters spread evenly
  y[8] = np.where(r.random(size) < 0.5, 0.0, -0.0)  # -0.0 ties 0.0
  y[9] = -np.inf  # nothing finite
  flags = np.ones(rows, bool)
  flags[4] = False
  return y, ids.astype(np.int32), count.astype(np.int32), flags


def oracle_order(y, ids, count):
  """The finite entries among the first ``count``, by (-y, id) (float64)."""
  y, ids = y[:count].astype(np.float64), ids[:count]
  finite = np.isfinite(y)
  y, ids = y[finite] + 0.0, ids[finite]  # + 0.0: -0.0 ties 0.0
  return ids[np.lexsort((ids, -y))]


def check_listing_order(size: int, width: int, seed: int):
  y, ids, count, rows = listing_batch(size, seed)
  got, finite = order.listing_top_ids(jnp.asarray(y), jnp.asarray(ids),
                                      jnp.asarray(count), jnp.asarray(rows),
                                      width)
  ref = np.asarray(order.listing_top_ids_reference(
      jnp.asarray(y), jnp.asarray(ids), jnp.minimum(jnp.asarray(count), size),
      width))
  got, finite = np.asarray(got), np.asarray(finite)
  assert got.shape == (len(rows), width)
  for b in range(len(rows)):
    want = oracle_order(y[b], ids[b], min(count[b], size))
    if not rows[b]:
      assert finite[b] == 0
      continue
    assert finite[b] == len(want), b
    listed = min(width, len(want))
    np.testing.assert_array_equal(got[b, :listed], want[:listed],
                                  err_msg=f"row {b}")
    np.testing.assert_array_equal(ref[b, :listed], want[:listed],
                                  err_msg=f"reference row {b}")
    assert (ref[b, listed:] == -1).all()


@pytest.mark.parametrize("size,width", [(256, 100), (64, 64), (32, 5),
                                        (16, 16)])
def test_listing_order_matches_oracle(size, width):
  """Ties (by id), holes, short and over-full counts, one-value rows,
  sorted slots, -0.0 against 0.0, rows with nothing finite, rows not
  flagged; widths below, at and above the entry count."""
  check_listing_order(size, width, seed=size + width)


@pytest.mark.parametrize("size,width", [(0, 1), (64, 0), (64, 65), (48, 8),
                                        (1 << 15, 8)])
def test_listing_order_rejects_bad_shapes(size, width):
  with pytest.raises(ValueError, match="power of 2"):
    order.listing_top_ids(jnp.zeros((1, size)), jnp.zeros((1, size), int),
                          jnp.zeros((1,), int), jnp.ones((1,), bool), width)
