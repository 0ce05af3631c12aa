"""jaxsample._src.rng: block ciphers, stream layout, uniforms and Gumbel noise.

Expected values come from JAX's own PRNG primitives (``threefry2x32_p``,
``philox4x32_p``, ``jax.random``), the Random123 known-answer vectors and the
formulas of the ``jaxsample._src.rng`` module docstring evaluated in numpy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.random.philox4x32 import philox4x32_p
from jax.extend.random import threefry2x32_p

from jaxsample._src import rng

U32 = np.uint32
LANES, TILE = 512, 2048  # documented PHILOX_LANES and tile width 4 * LANES


def test_philox_constants_match_docs():
  assert rng.PHILOX_LANES == LANES
  assert rng.PHILOX_TILE == TILE


def batch_bits(generator, key, batch, vocab):
  """Bits of the batch-key stream for a ``[B, V]`` batch via row_streams/tile_bits."""
  streams, per_request = rng.row_streams(key, None, batch, vocab)
  assert per_request is False
  column = jax.tree.map(lambda a: a[:, None], streams)
  lanes = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
  ((offset, bits),) = rng.tile_bits(generator, column, 0, lanes)
  assert offset == 0
  return np.asarray(bits)


def np_threefry(key_data, counters):
  """JAX's threefry2x32 primitive on 64-bit python-int counters -> (x0, x1)."""
  counters = np.asarray(counters, dtype=object)
  hi = np.array([int(c) >> 32 for c in counters.ravel()], U32).reshape(counters.shape)
  lo = np.array([int(c) & 0xFFFFFFFF for c in counters.ravel()], U32).reshape(counters.shape)
  k0, k1 = (jnp.uint32(int(w)) for w in key_data)
  x0, x1 = threefry2x32_p.bind(k0, k1, jnp.asarray(hi), jnp.asarray(lo))
  return np.asarray(x0), np.asarray(x1)


# ---------------------------------------------------------------------------
# Threefry.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 5), (4, 1007), (2, 4096),
                                   (7, 3000)])
def test_threefry_batch_bits_equal_jax_random_bits(shape):
  key = jax.random.key(sum(shape))
  got = batch_bits("threefry", key, *shape)
  want = np.asarray(jax.random.bits(key, shape, jnp.uint32))
  np.testing.assert_array_equal(got, want)


def test_threefry_raw_key_data_equals_typed_key():
  key = jax.random.key(5)
  raw = jax.random.key_data(key)
  np.testing.assert_array_equal(batch_bits("threefry", raw, 3, 50),
                                batch_bits("threefry", key, 3, 50))


def test_threefry_cipher_equals_jax_primitive():
  r = np.random.default_rng(0)
  k0, k1, c0, c1 = (jnp.asarray(r.integers(0, 2**32, 4096, dtype=np.uint64).astype(U32))
                    for _ in range(4))
  got = rng.threefry2x32(k0, k1, c0, c1)
  want = threefry2x32_p.bind(k0, k1, c0, c1)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_threefry_jax_random_layout_is_flat_counter():
  """Ties the manual hash to jax.random: element (b, v) hashes counter b*V+v."""
  key = jax.random.key(3)
  batch, vocab = 3, 37
  counters = np.arange(batch * vocab).reshape(batch, vocab)
  x0, x1 = np_threefry(np.asarray(jax.random.key_data(key)), counters)
  np.testing.assert_array_equal(
      x0 ^ x1, np.asarray(jax.random.bits(key, (batch, vocab), jnp.uint32)))


@pytest.mark.parametrize("base_hi,base_lo", [(0, 2**32 - 5), (7, 2**32 - 1),
                                             (2**32 - 1, 2**32 - 100)])
def test_threefry_64bit_counter_carry(base_hi, base_lo):
  """Counters base + v that cross a 2^32 boundary carry into the high word."""
  key_data = np.array([0x12345678, 0x9ABCDEF0], U32)
  stream = rng.RowStreams(*(jnp.asarray(np.array([w], U32))
                            for w in (key_data[0], key_data[1], base_hi, base_lo)))
  column = jax.tree.map(lambda a: a[:, None], stream)
  lanes = jnp.arange(300, dtype=jnp.uint32)[None, :]
  for tile_start in (0, 64):
    ((_, bits),) = rng.tile_bits("threefry", column, tile_start, lanes)
    ((_, wide),) = rng.tile_bits("threefry", column, tile_start, lanes, wide=True)
    counters = [(((base_hi << 32) + base_lo + tile_start + v) % 2**64)
                for v in range(300)]
    x0, x1 = np_threefry(key_data, counters)
    np.testing.assert_array_equal(np.asarray(bits)[0], x0 ^ x1)
    np.testing.assert_array_equal(np.asarray(wide[0])[0], x0)
    np.testing.assert_array_equal(np.asarray(wide[1])[0], x1)


@pytest.mark.parametrize("vocab", [2**31 + 1, 2**32 - 1, 151936])
def test_row_streams_batch_key_base_is_64bit_flat_index(vocab):
  """base = b * V as a 64-bit (hi, lo) pair, also when b * V >= 2^32."""
  batch = 5
  streams, _ = rng.row_streams(jax.random.key(0), None, batch, vocab)
  hi = np.asarray(streams.base_hi).astype(np.uint64)
  lo = np.asarray(streams.base_lo).astype(np.uint64)
  got = [(int(h) << 32) + int(l) for h, l in zip(hi, lo)]
  assert got == [b * vocab for b in range(batch)]


def test_threefry_bits_past_2_32_flat_index():
  """Row 2 of a V = 2^31 + 1 batch starts at counter 2^32 + 2 (carry on)."""
  vocab = 2**31 + 1
  key = jax.random.key(9)
  streams, _ = rng.row_streams(key, None, 3, vocab)
  column = jax.tree.map(lambda a: a[:, None], streams)
  tile_start = vocab - 200  # the last 200 ids of every row
  lanes = jnp.arange(200, dtype=jnp.uint32)[None, :]
  ((_, bits),) = rng.tile_bits("threefry", column, tile_start, lanes)
  counters = [[b * vocab + tile_start + v for v in range(200)] for b in range(3)]
  x0, x1 = np_threefry(np.asarray(jax.random.key_data(key)), counters)
  np.testing.assert_array_equal(np.asarray(bits), x0 ^ x1)


# ---------------------------------------------------------------------------
# Philox.
# ---------------------------------------------------------------------------


def test_philox_cipher_equals_jax_primitive():
  r = np.random.default_rng(1)
  words = [jnp.asarray(r.integers(0, 2**32, 4096, dtype=np.uint64).astype(U32))
           for _ in range(6)]
  got = rng.philox4x32(*words)
  want = philox4x32_p.bind(*words)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("ctr,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_random123_known_answers(ctr, key, expected):
  u = lambda v: jnp.uint32(v)
  got = rng.philox4x32(*map(u, key), *map(u, ctr))
  assert tuple(int(w) for w in got) == expected


def np_philox_words(key_data, c0, c1, c2, c3):
  return [np.asarray(w) for w in philox4x32_p.bind(
      *(jnp.asarray(np.asarray(a, U32)) for a in (key_data[0], key_data[1], c0, c1,
                                                  c2, c3)))]


def np_uniform32(bits):
  """Documented fp32 uniform: max(mantissa * 2^-23, 2^-126), computed exactly."""
  u = (np.asarray(bits, U32) >> 9).astype(np.float64) * 2.0**-23
  return np.maximum(u, 2.0**-126).astype(np.float32)


def np_uniform64(hi, lo):
  """Documented fp64 uniform from 64 bits ``hi << 32 | lo``."""
  mant = np.asarray(hi, U32).astype(np.float64) * 2.0**20 + (
      np.asarray(lo, U32) >> 12).astype(np.float64)
  return np.maximum(mant * 2.0**-52, 2.0**-1022)


def philox_layout_bits(key_rows, base_hi, base_lo, vocab, *, wide=False):
  """Per-element philox bits from the module docstring's formula.

  id v: tile = v - v % TILE, chunk j = (v % TILE) // LANES, lane l = v % LANES;
  word j of philox(key, (tile / 4 + l, base_lo, base_hi, 0)) (word 3 = 1 for
  the low word of a 64-bit draw).
  """
  v = np.arange(vocab)
  tile = v - v % TILE
  j = (v % TILE) // LANES
  lane = v % LANES
  out_hi, out_lo = [], []
  for b in range(len(key_rows)):
    args = (tile // 4 + lane, np.full(vocab, base_lo[b]), np.full(vocab, base_hi[b]))
    words = np_philox_words(key_rows[b], *args, np.zeros(vocab))
    out_hi.append(np.choose(j, words))
    if wide:
      words1 = np_philox_words(key_rows[b], *args, np.ones(vocab))
      out_lo.append(np.choose(j, words1))
  return (np.stack(out_hi), np.stack(out_lo)) if wide else np.stack(out_hi)


def test_philox_tile_bits_layout():
  streams = rng.RowStreams(*(jnp.asarray(np.array(a, U32)) for a in (
      [1, 0xFFFFFFFF], [2, 7], [0, 3], [0xFFFFF000, 12345])))
  column = jax.tree.map(lambda a: a[:, None], streams)
  lanes = jnp.arange(LANES, dtype=jnp.uint32)[None, :]
  for tile_start in (0, TILE, 5 * TILE):
    chunks = rng.tile_bits("philox", column, tile_start, lanes)
    assert [offset for offset, _ in chunks] == [0, LANES, 2 * LANES, 3 * LANES]
    want = philox_layout_bits([[1, 2], [0xFFFFFFFF, 7]], [0, 3],
                              [0xFFFFF000, 12345], tile_start + TILE)
    for j, (_, bits) in enumerate(chunks):
      lo = tile_start + j * LANES
      np.testing.assert_array_equal(np.asarray(bits), want[:, lo:lo + LANES])


@pytest.mark.parametrize("per_request", [False, True])
@pytest.mark.parametrize("vocab", [5000, 2048, 77])
def test_philox_gumbel_noise_layout(per_request, vocab):
  batch = 3
  if per_request:
    keys = jax.random.split(jax.random.key(4), batch)
    positions = jnp.array([0, 17, 2**31 + 5], jnp.uint32)
    streams, _ = rng.row_streams(keys, positions, batch, vocab)
    key_rows = np.asarray(jax.random.key_data(keys))
  else:
    key = jax.random.key(4)
    streams, _ = rng.row_streams(key, None, batch, vocab)
    key_rows = np.repeat(np.asarray(jax.random.key_data(key))[None], batch, 0)
  base_hi = np.asarray(streams.base_hi)
  base_lo = np.asarray(streams.base_lo)
  if per_request:
    np.testing.assert_array_equal(base_hi, [0, 17, 2**31 + 5])
    np.testing.assert_array_equal(base_lo, 0)
  bits = philox_layout_bits(key_rows, base_hi, base_lo, vocab)
  want = -jnp.log(-jnp.log(jnp.asarray(np_uniform32(bits))))
  got = rng.gumbel_noise("philox", streams, vocab)
  assert got.shape == (batch, vocab) and got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_philox_fp64_noise_layout():
  batch, vocab = 2, 2100
  key = jax.random.key(8)
  with jax.enable_x64(True):
    streams, _ = rng.row_streams(key, None, batch, vocab)
    key_rows = np.repeat(np.asarray(jax.random.key_data(key))[None], batch, 0)
    hi, lo = philox_layout_bits(key_rows, np.asarray(streams.base_hi),
                                np.asarray(streams.base_lo), vocab, wide=True)
    want = -jnp.log(-jnp.log(jnp.asarray(np_uniform64(hi, lo))))
    got = rng.gumbel_noise("philox", streams, vocab, fp64=True)
    assert got.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_philox_rows_are_distinct_streams():
  """Different rows (counter bases) and keys draw different noise."""
  streams, _ = rng.row_streams(jax.random.key(0), None, 4, 3000)
  noise = np.asarray(rng.gumbel_noise("philox", streams, 3000))
  for a in range(4):
    for b in range(a):
      assert np.mean(noise[a] == noise[b]) < 0.01


# ---------------------------------------------------------------------------
# Uniforms and Gumbel noise.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (3, 1007), (2, 4096)])
def test_threefry_fp32_gumbel_equals_jax_random_gumbel(shape):
  key = jax.random.key(shape[1])
  streams, _ = rng.row_streams(key, None, *shape)
  got = rng.gumbel_noise("threefry", streams, shape[1])
  want = jax.random.gumbel(key, shape)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("shape", [(1, 5), (3, 1007)])
def test_threefry_fp64_gumbel_equals_jax_random_gumbel(shape):
  key = jax.random.key(11)
  with jax.enable_x64(True):
    streams, _ = rng.row_streams(key, None, *shape)
    got = rng.gumbel_noise("threefry", streams, shape[1], fp64=True)
    want = jax.random.gumbel(key, shape, jnp.float64)
    assert got.dtype == jnp.float64 and want.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_uniform_fp32_matches_formula_and_extremes():
  r = np.random.default_rng(2)
  bits = np.concatenate([
      np.array([0, 1, 511, 512, 513, 0xFFFFFFFF, 0xFFFFFE00, 0x80000000], U32),
      r.integers(0, 2**32, 5000, dtype=np.uint64).astype(U32)])
  u = np.asarray(rng.uniform(jnp.asarray(bits)))
  assert u.dtype == np.float32
  np.testing.assert_array_equal(u, np_uniform32(bits))
  assert np.all(u > 0) and np.all(u < 1)
  assert u[0] == np.float32(2.0**-126)  # bits 0 -> tiny, never 0
  assert u[5] == np.float32(1 - 2.0**-23)  # all ones -> largest value below 1
  g = np.asarray(rng.gumbel(jnp.asarray(u)))
  assert np.all(np.isfinite(g))
  # Gumbel is increasing in u.
  order = np.argsort(u, kind="stable")
  assert np.all(np.diff(g[order]) >= 0)


def test_uniform_fp64_extremes():
  hi = np.array([0, 0, 0xFFFFFFFF, 0xFFFFFFFF, 0x80000000, 0], U32)
  lo = np.array([0, 0xFFF, 0xFFFFFFFF, 0, 0, 0x1000], U32)
  with jax.enable_x64(True):
    u = np.asarray(rng.uniform((jnp.asarray(hi), jnp.asarray(lo))))
    assert u.dtype == np.float64
    np.testing.assert_array_equal(u, np_uniform64(hi, lo))
    assert u[0] == 2.0**-1022 and u[1] == 2.0**-1022
    assert u[2] == 1 - 2.0**-52
    assert u[4] == 0.5 and u[5] == 2.0**-52
    assert np.all(u > 0) and np.all(u < 1)
    g = np.asarray(rng.gumbel(jnp.asarray(u)))
    assert np.all(np.isfinite(g))


EDGE = np.concatenate([np.arange(2**16), np.arange(2**32 - 2**16, 2**32)]
                      ).astype(U32)  # the lowest and highest 2^16 patterns


def assert_noise_never_lifts_neg_inf(u, upper):
  """``u`` in ``[tiny, upper]`` (never 0 or 1), its noise finite, and a
  ``-inf`` logit plus that noise still ``-inf`` (not NaN): it never wins."""
  assert u.min() > 0 and u.max() == upper
  g = np.asarray(rng.gumbel(jnp.asarray(u)))
  assert np.isfinite(g).all()
  assert (np.float32(-np.inf) + g == -np.inf).all()
  assert (np.argmax(np.stack([np.full_like(g, -np.inf), np.full_like(g, -3e38)
                              + g]), axis=0) == 1).all()


def test_uniform_fp32_never_0_or_1_at_the_extreme_bits():
  """Every 32-bit pattern within 2^16 of all-zero or all-one bits."""
  u = np.asarray(rng.uniform(jnp.asarray(EDGE)))
  assert u.dtype == np.float32 and u[0] == np.float32(2.0**-126)
  assert_noise_never_lifts_neg_inf(u, np.float32(1 - 2.0**-23))


def test_uniform_fp64_never_0_or_1_at_the_extreme_bits():
  """Both words at all-zero or all-one high bits, with every low word within
  2^16 of all-zero or all-one bits."""
  hi = np.repeat(np.array([0, 1, 0xFFFFFFFE, 0xFFFFFFFF], U32), EDGE.size)
  lo = np.tile(EDGE, 4)
  with jax.enable_x64(True):
    u = np.asarray(rng.uniform((jnp.asarray(hi), jnp.asarray(lo))))
    assert u.dtype == np.float64 and u[0] == 2.0**-1022
    assert_noise_never_lifts_neg_inf(u, 1 - 2.0**-52)


# ---------------------------------------------------------------------------
# Per-request streams.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("generator", ["philox", "threefry"])
def test_per_request_noise_depends_only_on_key_and_position(generator):
  batch, vocab = 6, 2100
  keys = jax.random.split(jax.random.key(21), batch)
  positions = jnp.array([0, 1, 5, 1, 1000, 2**20], jnp.int32)
  streams, per_request = rng.row_streams(keys, positions, batch, vocab)
  assert per_request is True
  full = np.asarray(rng.gumbel_noise(generator, streams, vocab))
  for b in range(batch):
    alone, _ = rng.row_streams(keys[b:b + 1], positions[b:b + 1], 1, vocab)
    np.testing.assert_array_equal(
        np.asarray(rng.gumbel_noise(generator, alone, vocab))[0], full[b])
  perm = np.array([3, 0, 5, 1, 4, 2])
  shuffled, _ = rng.row_streams(keys[perm], positions[perm], batch, vocab)
  np.testing.assert_array_equal(
      np.asarray(rng.gumbel_noise(generator, shuffled, vocab)), full[perm])
  # A shorter vocabulary sees a prefix of the same stream.
  short, _ = rng.row_streams(keys, positions, batch, 100)
  np.testing.assert_array_equal(
      np.asarray(rng.gumbel_noise(generator, short, 100)), full[:, :100])
  # Positions and keys matter: rows 1 and 3 share a position, not a key.
  assert np.mean(full[1] == full[3]) < 0.01
  moved, _ = rng.row_streams(keys, positions + 1, batch, vocab)
  assert np.mean(np.asarray(rng.gumbel_noise(generator, moved, vocab)) == full) < 0.01


def test_per_request_threefry_position0_equals_jax_random():
  """At position 0 a request's threefry noise is jax.random.gumbel(row_key)."""
  keys = jax.random.split(jax.random.key(2), 3)
  streams, _ = rng.row_streams(keys, jnp.zeros(3, jnp.int32), 3, 1007)
  got = np.asarray(rng.gumbel_noise("threefry", streams, 1007))
  for b in range(3):
    np.testing.assert_array_equal(
        got[b], np.asarray(jax.random.gumbel(keys[b], (1007,))))


def test_per_request_raw_key_data_equals_typed_keys():
  keys = jax.random.split(jax.random.key(2), 3)
  pos = jnp.array([3, 2, 1])
  a, _ = rng.row_streams(keys, pos, 3, 10)
  b, _ = rng.row_streams(jax.random.key_data(keys), pos, 3, 10)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------
# row_streams / key_words errors.
# ---------------------------------------------------------------------------


def test_row_streams_positions_with_single_key_rejected():
  with pytest.raises(ValueError, match="positions"):
    rng.row_streams(jax.random.key(0), jnp.zeros((4,), jnp.int32), 4, 10)


@pytest.mark.parametrize("keys", [
    lambda: jax.random.split(jax.random.key(0), 3),  # 3 keys for 4 rows
    lambda: jnp.zeros((5, 2), jnp.uint32),
    lambda: jax.random.split(jax.random.key(0), (4, 1)),  # [4, 1] keys
])
def test_row_streams_key_batch_mismatch_rejected(keys):
  with pytest.raises(ValueError):
    rng.row_streams(keys(), None, 4, 10)


@pytest.mark.parametrize("positions", [
    jnp.zeros((3,), jnp.int32), jnp.zeros((4, 1), jnp.int32),
    jnp.zeros((4,), jnp.float32)])
def test_row_streams_bad_positions_rejected(positions):
  keys = jax.random.split(jax.random.key(0), 4)
  with pytest.raises(ValueError, match="positions"):
    rng.row_streams(keys, positions, 4, 10)


@pytest.mark.parametrize("key", [
    lambda: jnp.zeros((3,), jnp.uint32),
    lambda: jnp.zeros((2,), jnp.int32),  # not uint32
    lambda: jnp.zeros((4, 6), jnp.uint32),  # raw data: 2 or 4 words only
])
def test_non_two_word_key_data_rejected(key):
  with pytest.raises(ValueError, match="2 words"):
    rng.row_streams(key(), None, 4, 10)


def test_tile_bits_unknown_generator_rejected():
  streams, _ = rng.row_streams(jax.random.key(0), None, 1, 4)
  with pytest.raises(ValueError, match="generator"):
    rng.tile_bits("mt19937", streams, 0, jnp.arange(4, dtype=jnp.uint32))


def test_portable_mulhi_equals_lax_mulhi():
  """``rng.mulhi`` (16-bit limbs, partitionable) is ``lax.mulhi`` bit for bit:
  on edge words, on random words and on the Philox multipliers."""
  edges = np.array([0, 1, 2, 0xFFFF, 0x10000, 0x1FFFF, 0x7FFFFFFF, 0x80000000,
                    0xFFFF0000, 0xFFFFFFFE, 0xFFFFFFFF, 0xD2511F53,
                    0xCD9E8D57], np.uint32)
  a_edge, b_edge = (x.ravel() for x in np.meshgrid(edges, edges))
  words = jax.random.bits(jax.random.key(7), (2, 1 << 16), jnp.uint32)
  a = jnp.concatenate([jnp.asarray(a_edge), words[0]])
  b = jnp.concatenate([jnp.asarray(b_edge), words[1]])
  hi, lo = jax.jit(rng.mulhilo)(a, b)
  np.testing.assert_array_equal(hi, jax.lax.mulhi(a, b))
  np.testing.assert_array_equal(lo, a * b)
  exact = np.asarray(a).astype(np.uint64) * np.asarray(b).astype(np.uint64)
  np.testing.assert_array_equal(np.asarray(hi), (exact >> 32).astype(np.uint32))
