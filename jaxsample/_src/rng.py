"""Counter-based random numbers shared by the XLA reference and the Pallas kernels.

Everything here is plain ``jnp`` uint32 arithmetic, so one definition runs in
XLA, in Pallas interpret mode and inside Pallas-Triton kernels; the kernels and
the reference therefore draw the *same* bits for the same keys.

Noise coordinates
-----------------
Every row ``b`` of a ``[B, V]`` logits batch gets a *stream*: a 2-word key and
a 64-bit counter base ``(base_hi, base_lo)``.  The noise of vocab index ``v``
depends only on (stream key, counter base, v):

* **batch key** (one key for the whole batch): key = that key,
  base = ``b * V`` (the flat index of the row start).  With the threefry
  generator the counter of element ``(b, v)`` is the flat index ``b * V + v``,
  exactly the layout of ``jax.random`` (``jax_threefry_partitionable``), so
  sampling without truncation reproduces ``jax.random.categorical`` bit for bit.
* **per-request keys** (one key per row plus a position per row, required:
  ``check_positions``): key = the row's key, base = ``position << 32``.  The noise of a request is a function
  of (its key, its position, v) only: it does not depend on which other
  requests share the batch, their order or padding.  At position 0 the
  threefry noise equals ``jax.random.categorical(row_key, row_logits)``'s.

Generators
----------
* ``threefry``: Threefry-2x32 (20 rounds) on the 64-bit counter ``base + v``;
  32-bit draws are ``x0 ^ x1``, 64-bit draws ``x0 << 32 | x1`` (as jax).
* ``philox``: Philox-4x32-10 (Random123).  One call yields four words, all
  used: the vocab axis is cut in tiles of ``4 * PHILOX_LANES``; inside a tile,
  lane ``l`` of chunk ``j`` (vocab index ``tile + j * PHILOX_LANES + l``) takes
  word ``j`` of the call on counter ``(tile / 4 + l, base_lo, base_hi, 0)``.
  64-bit draws take their low word from the same call with counter word 3 = 1.

Uniforms are ``u = max(mantissa_bits * 2^-23, 2^-126)`` in fp32 (so that
``-log(-log(u))`` is finite) and ``max(mantissa_bits * 2^-52, 2^-1022)`` in
fp64; both equal ``jax.random.uniform(key, minval=tiny, maxval=1)``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsample._src import rowwise

__all__ = ["bits_at", "check_positions", "FP32_TINY", "FP64_TINY", "Generator",
           "GENERATORS", "gumbel", "gumbel_noise", "key_words", "mulhi",
           "MulHiLo", "mulhilo", "philox4x32", "PHILOX_LANES", "PHILOX_TILE",
           "row_streams", "RowStreams", "threefry2x32", "tile_bits", "uniform"]

Generator = Literal["threefry", "philox"]
GENERATORS: tuple[str, ...] = ("threefry", "philox")

PHILOX_LANES = 512
"""Lanes per Philox chunk; a Philox tile spans ``4 * PHILOX_LANES`` vocab ids."""
PHILOX_TILE = 4 * PHILOX_LANES

_U32 = jnp.uint32
MulHiLo = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def mulhi(a: jax.Array, b: jax.Array) -> jax.Array:
  """High word of the 64-bit product of two uint32 arrays, from 16-bit limbs.

  Bit-identical to ``lax.mulhi``, which lowers to ``chlo.mulhi``: the Shardy
  partitioner cannot convert it, so a sharded ``jit`` containing it fails
  ("Unable to convert MHLO to StableHLO").  With ``a = a1 2^16 + a0`` and
  ``b = b1 2^16 + b0`` every partial product fits 32 bits, and
  ``hi = a1 b1 + (a0 b1 >> 16) + (a1 b0 >> 16) + (mid >> 16)`` with
  ``mid = (a0 b0 >> 16) + (a0 b1 & 0xFFFF) + (a1 b0 & 0xFFFF) < 3 * 2^16``.
  """
  a, b = jnp.broadcast_arrays(_u32(a), _u32(b))
  low16, shift = _u32(0xFFFF), _u32(16)
  a0, a1 = a & low16, a >> shift
  b0, b1 = b & low16, b >> shift
  cross0, cross1 = a0 * b1, a1 * b0
  mid = ((a0 * b0) >> shift) + (cross0 & low16) + (cross1 & low16)
  return a1 * b1 + (cross0 >> shift) + (cross1 >> shift) + (mid >> shift)


def mulhilo(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """High and low words of the 64-bit product of two uint32 arrays
  (``mulhi``: partitionable, no ``lax.mulhi``)."""
  return mulhi(a, b), a * b


def _u32(x) -> jax.Array:
  return jnp.asarray(x, dtype=_U32)


# --------------------------------------------------------------------------
# Block ciphers.
# --------------------------------------------------------------------------


def _rotl(x: jax.Array, r: int) -> jax.Array:
  return (x << _u32(r)) | (x >> _u32(32 - r))


def threefry2x32(k0, k1, c0, c1) -> tuple[jax.Array, jax.Array]:
  """Threefry-2x32 with 20 rounds, bit-identical to ``jax.random``'s hash."""
  rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
  ks = (k0, k1, k0 ^ k1 ^ _u32(0x1BD11BDA))
  x0 = c0 + ks[0]
  x1 = c1 + ks[1]
  for group in range(5):
    for r in rotations[group % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(group + 1) % 3]
    x1 = x1 + ks[(group + 2) % 3] + _u32(group + 1)
  return x0, x1


_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85


def philox4x32(k0, k1, c0, c1, c2, c3, *, mulhilo: MulHiLo = mulhilo):
  """Philox-4x32 with 10 rounds (Random123 / ``jax.random`` 'philox4x32').

  ``mulhilo(a, b)`` returns the (high, low) words of the 64-bit product of two
  uint32 arrays of one shape; kernels pass a hardware ``mul.wide`` instruction.
  """
  m0 = jnp.full(jnp.shape(c0), _PHILOX_M0, _U32)
  m1 = jnp.full(jnp.shape(c2), _PHILOX_M1, _U32)
  for rnd in range(10):
    if rnd:
      k0 = k0 + _u32(_PHILOX_W0)
      k1 = k1 + _u32(_PHILOX_W1)
    hi0, lo0 = mulhilo(m0, c0)
    hi1, lo1 = mulhilo(m1, c2)
    c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
  return c0, c1, c2, c3


# --------------------------------------------------------------------------
# Streams: per-row keys and counter bases.
# --------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowStreams:
  """Per-row noise coordinates: key words and 64-bit counter base, ``[B]`` uint32."""

  key0: jax.Array
  key1: jax.Array
  base_hi: jax.Array
  base_lo: jax.Array

  def __getitem__(self, index) -> "RowStreams":
    return jax.tree.map(lambda a: a[index], self)


def key_words(key) -> jax.Array:
  """The generator's 2 key words ``[..., 2]`` (uint32) of typed keys or raw
  uint32 key data.

  Threefry (``jax.random.key``'s default) and philox keys are 2 words and
  used as they are.  Keys of other sizes (``rbg`` / ``unsafe_rbg``: 4
  words, as under ``JAX_DEFAULT_PRNG_IMPL=unsafe_rbg``) are hashed to 2:
  ``threefry2x32(key=(w0, w1), counter=(w2, w3))`` for 4 words ``w0..w3``
  (longer keys fold their word pairs the same way, the last pair first), so
  distinct keys give distinct streams up to hash collisions.
  Raw data of one row must then be typed (``jax.random.wrap_key_data``):
  raw ``[B, 2]`` data is read as B threefry keys.
  """
  typed = _is_typed_key(key)
  data = jax.random.key_data(key) if typed else jnp.asarray(key)
  words = data.shape[-1] if data.ndim else 0
  if (data.dtype != jnp.uint32 or not words or words % 2 or
      (not typed and words != 2 and words != 4)):
    raise ValueError(
        "key must be typed keys (jax.random.key(seed), or [B] of them from "
        "jax.random.split) or raw uint32 key data of 2 words (threefry2x32, "
        "philox) or 4 (rbg); got data of shape "
        f"{data.shape} and dtype {data.dtype}: make one with "
        "jax.random.key(seed)")
  if words == 2:
    return data
  k0, k1 = data[..., words - 2], data[..., words - 1]
  for i in range(words - 4, -1, -2):  # fold the pairs, last to first
    k0, k1 = threefry2x32(data[..., i], data[..., i + 1], k0, k1)
  return jnp.stack([k0, k1], axis=-1)


def _is_typed_key(key) -> bool:
  return isinstance(key, jax.Array) and jnp.issubdtype(key.dtype,
                                                        jax.dtypes.prng_key)


def row_streams(key, positions, batch_size: int, vocab_size: int, *,
                first_row=0) -> tuple[RowStreams, bool]:
  """Per-row streams for one batch key or per-request keys (see module doc).

  ``first_row``: the global index of row 0 (a batch shard's first row) for
  one batch key's counters.  Returns the streams and whether the keys were
  per request.
  """
  data = key_words(key)
  rows = jnp.arange(batch_size, dtype=_U32) + _u32(first_row)
  if data.ndim == 1:
    if positions is not None:
      raise ValueError(
          "positions apply to per-request keys ([B] typed keys or [B, 2] raw "
          "key data); with one batch key the row index is the counter")
    k0 = jnp.broadcast_to(data[0], (batch_size,))
    k1 = jnp.broadcast_to(data[1], (batch_size,))
    v = _u32(vocab_size)
    return RowStreams(k0, k1, mulhi(rows, jnp.broadcast_to(v, rows.shape)),
                      rows * v), False
  if data.shape != (batch_size, 2):
    raise ValueError(f"per-request keys must have batch size {batch_size}; "
                     f"got key data of shape {data.shape}")
  positions = check_positions(positions, batch_size)
  return RowStreams(data[:, 0], data[:, 1], positions.astype(_U32),
                    jnp.zeros((batch_size,), _U32)), True


def check_positions(positions, batch_size: int) -> jax.Array:
  """``positions`` as a ``[B]`` integer array, for per-request keys.

  Raises:
    ValueError: positions missing (the same noise at every step) from a
      non-empty batch, not ``[B]`` integers, or concrete and negative.
  """
  if positions is None and batch_size == 0:
    return jnp.zeros((0,), jnp.int32)
  if positions is None:
    raise ValueError(
        "per-request keys need positions: pass positions=[B] ints, each "
        "request's token position (e.g. its sequence length so far), and "
        "advance them every step; without them every step would reuse the "
        "same noise")
  positions = jnp.asarray(positions)
  if positions.shape != (batch_size,) or not jnp.issubdtype(
      positions.dtype, jnp.integer):
    raise ValueError(f"positions must be integers of shape ({batch_size},); "
                     f"got {positions.dtype}{list(positions.shape)}")
  if not isinstance(positions, jax.core.Tracer) and positions.size and (
      jnp.issubdtype(positions.dtype, jnp.signedinteger) and
      int(np.min(np.asarray(positions))) < 0):  # concrete, even under jit
    raise ValueError(f"positions must be >= 0; got {np.asarray(positions)} "
                     "(traced positions count modulo 2^32)")
  return positions


# --------------------------------------------------------------------------
# Bits, uniforms and Gumbel noise for a tile of vocab ids.
# --------------------------------------------------------------------------


def tile_bits(generator: str, stream: RowStreams, tile_start, lanes, *,
              wide: bool = False, mulhilo: MulHiLo = mulhilo):
  """Random bits for the vocab ids of one tile, as ``[(offset, bits), ...]``.

  ``lanes`` is ``arange(n)`` (uint32), broadcast against ``tile_start`` and the
  stream's arrays.  For threefry the tile is the single chunk
  ``tile_start + lanes``; for philox ``n`` must be ``PHILOX_LANES``,
  ``tile_start`` a multiple of ``PHILOX_TILE``, and the four chunks start at
  ``tile_start + j * PHILOX_LANES``.  ``bits`` is uint32, or with ``wide`` a
  ``(hi, lo)`` pair of uint32 holding 64 bits.
  """
  tile_start = _u32(tile_start)
  if generator == "threefry":
    lo = stream.base_lo + tile_start + lanes
    hi = stream.base_hi + (lo < stream.base_lo).astype(_U32)
    x0, x1 = threefry2x32(stream.key0, stream.key1, hi, lo)
    return [(0, (x0, x1) if wide else x0 ^ x1)]
  if generator == "philox":
    shape = jnp.broadcast_shapes(jnp.shape(tile_start), jnp.shape(lanes),
                                 jnp.shape(stream.base_lo))
    counter = jnp.broadcast_to((tile_start >> _u32(2)) + lanes, shape)
    c1 = jnp.broadcast_to(stream.base_lo, shape)
    c2 = jnp.broadcast_to(stream.base_hi, shape)
    zero = jnp.zeros_like(counter)
    words = philox4x32(stream.key0, stream.key1, counter, c1, c2, zero,
                       mulhilo=mulhilo)
    if wide:
      low_words = philox4x32(stream.key0, stream.key1, counter, c1, c2,
                             zero + _u32(1), mulhilo=mulhilo)
      words = tuple(zip(words, low_words))
    return [(j * PHILOX_LANES, w) for j, w in enumerate(words)]
  raise ValueError(f"unknown generator {generator!r}; expected one of "
                   f"{GENERATORS}")


def bits_at(generator: str, stream: RowStreams, ids, *, wide: bool = False,
            mulhilo: MulHiLo = mulhilo):
  """The bits ``tile_bits`` gives vocab ids ``ids`` (any shape, broadcast
  against the stream's arrays): noise for a sparse set of ids."""
  ids = _u32(ids)
  if generator == "threefry":
    ((_, bits),) = tile_bits(generator, stream, 0, ids, wide=wide,
                             mulhilo=mulhilo)
    return bits
  if generator != "philox":
    raise ValueError(f"unknown generator {generator!r}; expected one of "
                     f"{GENERATORS}")
  lane = ids & _u32(PHILOX_LANES - 1)
  # A literal mask: the Triton lowering cannot invert a constant.
  tile_start = ids & _u32(0xFFFFFFFF ^ (PHILOX_TILE - 1))
  chunks = tile_bits(generator, stream, tile_start, lane, wide=wide,
                     mulhilo=mulhilo)
  word = (ids >> _u32(PHILOX_LANES.bit_length() - 1)) & _u32(3)
  pick = lambda words: functools.reduce(
      lambda acc, j: jnp.where(word == j, words[j], acc), range(1, 4),
      words[0])
  if wide:
    return tuple(pick([bits[i] for _, bits in chunks]) for i in range(2))
  return pick([bits for _, bits in chunks])


FP32_TINY = float(np.finfo(np.float32).tiny)  # 2^-126
FP64_TINY = float(np.finfo(np.float64).tiny)  # 2^-1022


def uniform(bits) -> jax.Array:
  """Uniform in ``[tiny, 1)`` from 32 bits (fp32) or a ``(hi, lo)`` pair (fp64)."""
  if isinstance(bits, tuple):
    hi, lo = bits
    mantissa = (hi.astype(jnp.float64) * 2.0**20 +
                (lo >> _u32(12)).astype(jnp.float64))
    return jnp.maximum(mantissa * 2.0**-52, FP64_TINY)
  one_bits = (bits >> _u32(9)) | _u32(0x3F800000)
  floats = lax.bitcast_convert_type(one_bits, jnp.float32) - 1.0
  return jnp.maximum(floats, jnp.float32(FP32_TINY))


def gumbel(u: jax.Array) -> jax.Array:
  """Standard Gumbel noise ``-log(-log(u))``: finite for ``u`` in [tiny, 1)."""
  return -jnp.log(-jnp.log(u))


def gumbel_noise(generator: str, streams: RowStreams, vocab_size: int, *,
                 fp64: bool = False, first_id=None) -> jax.Array:
  """Gumbel noise ``[B, V]`` for every row and vocab id (XLA reference path);
  with ``first_id`` (traced), for the ``vocab_size`` ids from it (a vocab
  shard's).  Written to memory on CPU (``_materialized``)."""
  if first_id is not None:
    ids = _u32(first_id) + jnp.arange(vocab_size, dtype=_U32)[None, :]
    column = jax.tree.map(lambda a: a[:, None], streams)
    return _materialized(gumbel(uniform(bits_at(generator, column, ids,
                                                 wide=fp64))))
  if generator == "philox":
    n_tiles = -(-vocab_size // PHILOX_TILE)
    starts = (jnp.arange(n_tiles, dtype=_U32) * _u32(PHILOX_TILE))[None, :,
                                                                     None]
    lanes = jnp.arange(PHILOX_LANES, dtype=_U32)[None, None, :]
    column = jax.tree.map(lambda a: a[:, None, None], streams)
    # The four words apart: XLA:CPU fusing them into the stack below runs
    # the Philox rounds per element, unvectorized (10x the CPU time).
    chunks = _materialized([bits for _, bits in tile_bits(
        generator, column, starts, lanes, wide=fp64)])
    noise = jnp.stack([gumbel(uniform(bits)) for bits in chunks], axis=2)
    return _materialized(noise.reshape(noise.shape[0], -1)[:, :vocab_size])
  lanes = jnp.arange(vocab_size, dtype=_U32)[None, :]
  column = jax.tree.map(lambda a: a[:, None], streams)
  ((_, bits),) = tile_bits(generator, column, 0, lanes, wide=fp64)
  return _materialized(gumbel(uniform(bits)))


def _materialized(arrays):
  """A pytree of arrays, each written to memory on CPU (``rowwise.barrier``:
  one optimization barrier per array); as it is elsewhere.
  XLA:CPU fuses a generator into its users (the race's row reduction
  ``argmax(y + noise)``, the words' stack), where it runs up to 10x slower
  than as its own loop: B = 8, V = 32000, Philox noise and race took 29 ms
  of CPU time fused, 3.2 ms apart."""
  return lax.platform_dependent(
      arrays, cpu=rowwise.barrier,
      default=lambda a: a)
