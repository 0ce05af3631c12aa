"""A grammar bitmask read inside the kernels' passes (``docs/processing.md``).

When the only processor that changes a row is its packed grammar bitmask
(``LogitsProcessors.bitmask``, ``int32 [B, ceil(V / 32)]``, bit ``v % 32``
of word ``v // 32`` allows id ``v``) and ``SamplerConfig.kernel_bitmask`` is
on, ``sample`` and ``extract_sampling_mask`` hand the kernel route
``MaskedLogits`` instead of the XLA pre-pass's fp32 copy: every kernel that
reads the row loads, with each block of logits, the bitmask word of each
element and reads a disallowed element as -inf (``allowed_at``, through
``row_loader`` in the block loop and in the compact pass's gathered loads),
so the row is ``where(allowed, x, -inf)`` exactly as
``processors.apply_processors`` writes it, without the extra pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from jaxsample._src.processors import bitmask_allows
from jaxsample._src.pallas import common

__all__ = ["allowed_at", "logits_at", "MaskedLogits",
           "operands", "row_loader", "unmasked"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskedLogits:
  """Logits ``values`` ``[B, V]`` whose ids the packed ``bitmask`` ``[B,
  ceil(V / 32)]`` int32 disallows read as -inf: the row
  ``where(bit(v), values, -inf)``.  The kernel route takes it where it
  takes logits (``operands``: the kernels' inputs); XLA code reads it by
  ``logits_at`` or ``unmasked``."""

  values: jax.Array
  bitmask: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def dtype(self):
    return self.values.dtype

  @property
  def ndim(self) -> int:
    return self.values.ndim


def operands(logits) -> tuple[jax.Array, ...]:
  """A kernel's row inputs: ``(logits,)``, or ``(values, bitmask)`` of
  ``MaskedLogits`` (the kernel then takes a words ref after its row ref and
  loads through ``row_loader``)."""
  if isinstance(logits, MaskedLogits):
    return logits.values, logits.bitmask
  return (logits,)


def unmasked(logits) -> jax.Array:
  """The rows as an array (XLA): ``MaskedLogits``' ``where(bit(v), values,
  -inf)`` in their dtype; logits as they are."""
  if not isinstance(logits, MaskedLogits):
    return logits
  allows = bitmask_allows(logits.bitmask, logits.shape[1])
  return jnp.where(allows, logits.values, -jnp.inf).astype(logits.dtype)


def logits_at(logits, ids: jax.Array) -> jax.Array:
  """``[B, N]`` entries at ``ids`` ``[B, N]`` (in ``[0, V)``) of the rows,
  -inf where a ``MaskedLogits`` bitmask disallows them (a gather, no
  pass over the row)."""
  values = jnp.take_along_axis(operands(logits)[0], ids, axis=-1)
  if not isinstance(logits, MaskedLogits):
    return values
  words = jnp.take_along_axis(logits.bitmask, ids >> 5, axis=-1)
  allowed = (lax.shift_right_logical(words, ids & 31) & 1) != 0
  return jnp.where(allowed, values, -jnp.inf).astype(values.dtype)


def allowed_at(words_ref, row, index: jax.Array, mask: jax.Array
               ) -> jax.Array:
  """In a kernel: whether row ``row``'s bitmask allows each local id of
  ``index`` (int32 block; lanes off ``mask`` read False): one masked load
  of each element's word (lanes of a word share its address) and a shift."""
  word = plgpu.load(words_ref.at[row, jnp.where(mask, index >> 5, 0)],
                    mask=mask, other=0)
  return (lax.shift_right_logical(word, index & 31) & 1) != 0


def row_loader(x_ref, words_refs, row, size: int):
  """``common.row_chunk_loader`` of ``x_ref``'s row ``row`` (chunks of
  ``size``), with ``words_refs`` = ``(words_ref,)`` (a ``MaskedLogits``
  kernel's) each element the bitmask disallows read as -inf; ``()``: the
  plain loader."""
  load = common.row_chunk_loader(x_ref, row, size)
  if not words_refs:
    return load
  (words_ref,) = words_refs
  lanes = jnp.arange(size, dtype=jnp.int32)

  def masked(start, mask):
    allowed = allowed_at(words_ref, row, start + lanes, mask)
    return jnp.where(allowed, load(start, mask), -jnp.inf)

  return masked
