"""Sampling masks: the kept set each row was sampled from, with its mass.

For request ``b`` with tempered logits ``y = logits / T`` and kept set ``K``
(``jaxsample._src.reference``, steps 2 and 4; ``reference.process`` computes both
for the sampler and for this module), ``SamplingMask`` holds, with shapes fixed
by ``K_cap = SamplerConfig.max_mask_ids``:

* ``ids`` ``[B, K_cap]`` int32: ``K`` by descending ``y`` (descending
  probability), the smallest id first among equal values, padded with -1;
  when ``|K| > K_cap`` the first ``K_cap`` ids of that order, except that a
  sampled token (``sample``, ``spec.rejection_sample``) always appears: if
  it is not among them it takes the last slot (``with_token``);
* ``count`` ``[B]`` int32: ``|K|``, exact even past ``K_cap``;
* ``lse`` ``[B]`` fp32: ``logsumexp(y)`` over the finite entries;
* ``logz`` ``[B]`` fp32: ``log`` of ``K``'s mass under ``softmax(y)``, i.e.
  ``logsumexp_K(y) - lse``;
* ``truncated`` ``[B]`` bool: ``ids`` lists ``K``.  False exactly when the row
  is valid, sampled (``T > 0``) and ``K`` is every finite entry (no filter
  removed anything): then ``ids`` is all -1, ``logz`` is 0 and the host form
  is ``None``, never a full-vocabulary list;
* ``overflow`` ``[B]`` bool: ``truncated & (count > K_cap)`` (``ids`` is then
  incomplete; ``count`` and ``logz`` still describe all of ``K``).

Host forms (``to_lists``, ``to_json``) never drop ids silently: an
overflowed request's entry is ``{"ids": [...K_cap ids], "count": |K|,
"overflow": True}`` instead of the plain list (``on_overflow="flag"``, the
default), or ``on_overflow="raise"`` raises ``MaskOverflowError`` naming the
requests and the fix (a larger ``SamplerConfig.max_mask_ids``).

The truncated, renormalized log-probability of a kept id ``i`` is ``y_i - lse -
logz`` (``= log_softmax(y)[i] - logz``); for the sampled token it is the
sampler's ``SampleResult.logprobs``.

Rows the sampler treats specially:

* greedy rows (``T = 0``, where ``y = logits``): ``K = {argmax(y)}``, the
  sampler's token (smallest id on ties).  ``count = 1``, ``truncated = True``,
  ``logz = 0`` and ``lse = max(y)``, so the rebuilt distribution is the point
  mass on that id (``y_i - lse - logz = 0``, the sampler's logprob): the
  ``T -> 0`` limit of ``softmax(y / T)`` with ties broken as the sampler does.
* invalid rows (``valid = False``: NaN, +inf, no finite entry or tempered
  overflow): ``K`` is empty, matching the sampler's logprob of -inf.
  ``count = 0``, ``ids`` all -1, ``truncated = True`` (host form ``[]``, not
  ``None``, which would claim the full distribution), ``overflow = False`` and
  ``logz = lse = -inf``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample._src import reference, xla_search
from jaxsample._src.params import SamplingParams

__all__ = ["MaskOverflowError", "OnOverflow", "SamplingMask", "assemble",
           "from_processed", "with_token"]

OnOverflow = Literal["flag", "raise"]


class MaskOverflowError(ValueError):
  """A host form of a mask whose kept set outgrew ``K_cap`` under
  ``on_overflow="raise"``."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMask:
  """Kept sets of a batch (module doc); every field may carry a leading token
  axis ``[T, B, ...]`` (one mask per token slot, e.g.
  ``spec.rejection_sample(..., return_mask=True)``'s, ``jax.vmap`` over
  target rows, or ``jax.tree.map(lambda *a: jnp.stack(a), *masks)`` for a
  list of masks)."""

  ids: jax.Array
  count: jax.Array
  logz: jax.Array
  lse: jax.Array
  truncated: jax.Array
  overflow: jax.Array

  def to_lists(self, num_tokens=None, *,
               on_overflow: OnOverflow = "flag") -> list:
    """Per request, in request order, ``(ids, logz)``: the kept ids as a list
    of ints (``None`` where not truncated) and ``logz`` as a float.  On
    overflow (``|K| > K_cap``) ``ids`` is ``{"ids": [the K_cap listed ids],
    "count": |K|, "overflow": True}``, or with ``on_overflow="raise"`` a
    ``MaskOverflowError``.  With a leading token axis: per request, a list of
    ``T`` such pairs, or of its first ``num_tokens[b]`` (``[B]`` integers in
    ``[0, T]``, e.g. ``SpecResult.num_accepted + 1``).

    Raises:
      ValueError: ``num_tokens`` for a mask without a token axis, or not
        ``[B]`` integers in ``[0, T]``; ``on_overflow`` not "flag" or
        "raise".
      MaskOverflowError: with ``on_overflow="raise"``, an overflowed entry
        (of the emitted slots with ``num_tokens``).
    """
    if on_overflow not in ("flag", "raise"):
      raise ValueError(f"on_overflow must be 'flag' or 'raise'; got "
                       f"{on_overflow!r}")
    host = jax.tree.map(np.asarray, jax.device_get(self))
    if host.count.ndim == 1:
      if num_tokens is not None:
        raise ValueError("num_tokens needs a mask with a leading token axis "
                         f"[T, B, ...]; got count of shape {host.count.shape}")
      overflowed = np.flatnonzero(host.overflow)
      if on_overflow == "raise" and overflowed.size:
        counts = host.count[overflowed].tolist()
        raise MaskOverflowError(
            f"requests {overflowed.tolist()} keep {counts} ids, more than "
            f"max_mask_ids={host.ids.shape[1]} lists: raise "
            "SamplerConfig.max_mask_ids or pass on_overflow='flag'")
      return [(_host_ids(host, b), float(host.logz[b]))
              for b in range(host.count.shape[0])]
    steps, batch = host.count.shape
    num_tokens = (np.full(batch, steps) if num_tokens is None else
                  np.asarray(num_tokens))
    if (num_tokens.shape != (batch,) or
        not np.issubdtype(num_tokens.dtype, np.integer) or
        np.any((num_tokens < 0) | (num_tokens > steps))):
      raise ValueError(f"num_tokens must be [{batch}] integers in [0, "
                       f"{steps}]; got {num_tokens!r}")
    emitted = np.arange(steps)[:, None] < num_tokens[None, :]
    if on_overflow == "raise" and np.any(host.overflow & emitted):
      slots, requests = np.nonzero(host.overflow & emitted)
      raise MaskOverflowError(
          f"requests {requests.tolist()} (token slots {slots.tolist()}) keep "
          f"more ids than max_mask_ids={host.ids.shape[-1]} lists: raise "
          "SamplerConfig.max_mask_ids or pass on_overflow='flag'")
    per_step = [jax.tree.map(lambda a, t=t: a[t], host).to_lists()
                for t in range(steps)]
    return [[step[b] for step in per_step[:num_tokens[b]]]
            for b in range(batch)]

  def to_json(self, num_tokens=None, *,
              on_overflow: OnOverflow = "flag") -> list:
    """FastDeploy's OpenAI-style ``sampling_mask`` field of each request.

    Per request, in request order, a list with one entry per generated token:
    the kept ids (a list of ints, ``to_lists``'s) or ``None`` (JSON ``null``)
    where not truncated.  A one-step mask gives one entry per request; a mask
    with a leading token axis gives ``T``, or request ``b``'s first
    ``num_tokens[b]`` (speculative decoding: ``num_tokens =
    SpecResult.num_accepted + 1``, the emitted tokens).  Extend each
    response's list with its request's entries; ``json.dumps`` serializes
    them.  ``logz`` is not part of the field (see ``to_lists``).  An
    overflowed entry is ``{"ids": [...], "count": |K|, "overflow": true}``
    (``to_lists``), or raises with ``on_overflow="raise"``.

    Raises:
      ValueError, MaskOverflowError: as ``to_lists``.
    """
    pairs = self.to_lists(num_tokens, on_overflow=on_overflow)
    if self.count.ndim == 1:
      pairs = [[pair] for pair in pairs]
    return [[ids for ids, _ in steps] for steps in pairs]


def _host_ids(host: SamplingMask, b: int):
  """Request ``b``'s host ids (numpy fields): ``None`` untruncated, a list,
  or the overflow dict (``to_lists``)."""
  if not host.truncated[b]:
    return None
  ids = host.ids[b, :host.count[b]].tolist()
  if host.overflow[b]:
    return {"ids": ids, "count": int(host.count[b]), "overflow": True}
  return ids


def with_token(m: SamplingMask, token: jax.Array,
               member: jax.Array) -> SamplingMask:
  """``m`` with each ``token`` listed: where a row overflowed and its token,
  a member of its kept set (``member``), is not among the listed ids, the
  last slot holds the token.  ``token``/``member`` have ``m.count``'s
  shape."""
  listed = jnp.any(m.ids == token[..., None], axis=-1)
  missing = m.overflow & member & ~listed
  last = jnp.arange(m.ids.shape[-1], dtype=jnp.int32) == m.ids.shape[-1] - 1
  return dataclasses.replace(m, ids=jnp.where(
      missing[..., None] & last, token[..., None].astype(jnp.int32), m.ids))


def assemble(*, valid, greedy, token, count, finite, logz, lse, row_max,
             ordered_ids, max_ids: int) -> SamplingMask:
  """Builds the mask from per-row facts (``[B]`` each) of any sampler path.

  ``count``/``logz``/``lse``: ``|K|``, ``logsumexp_K(y) - lse`` and
  ``logsumexp(y)`` of sampled rows; ``finite`` the row's number of finite
  entries; ``token`` the sampler's token (greedy rows' ``K``); ``row_max =
  max(y)``.  ``ordered_ids`` ``[B, w]`` (``w <= max_ids``) starts with ``K``
  by descending ``y``, smallest id first on ties (only rows that list ``K``
  are read).
  """
  count = jnp.where(valid, jnp.where(greedy, 1, count), 0).astype(jnp.int32)
  truncated = ~valid | greedy | (count < finite)
  logz = jnp.where(truncated & ~greedy, logz, 0.0)
  lse = jnp.where(greedy, row_max, lse)
  logz, lse = (jnp.where(valid, v, -jnp.inf).astype(jnp.float32)
               for v in (logz, lse))
  ids = jnp.where(greedy[:, None], token[:, None], ordered_ids)
  width = ids.shape[1]
  listed = ((jnp.arange(width, dtype=jnp.int32) < count[:, None]) &
            truncated[:, None])
  ids = jnp.where(listed, ids.astype(jnp.int32), -1)
  ids = jnp.pad(ids, ((0, 0), (0, max_ids - width)), constant_values=-1)
  return SamplingMask(ids, count, logz, lse, truncated,
                      truncated & (count > max_ids))


def from_processed(proc: reference.Processed, params: SamplingParams,
                   max_ids: int,
                   split: xla_search.Split = xla_search.Split()) -> SamplingMask:
  """The mask of rows processed by ``reference.process(..., order_width=
  max_ids)`` or ``xla_search.process`` (canonical params): the ids come from
  the threshold's order.  ``split``: rows split over devices
  (``xla_search.search`` with it; ``proc`` holds this device's columns):
  counts and the digit sums of the mass reduced over them."""
  finite = proc.y > -jnp.inf
  valid = jnp.isfinite(proc.row_max)
  shift = jnp.where(valid, proc.row_max, 0.0)  # the max of the finite y
  log_sum = jnp.log(xla_search.masked_sum(
      finite, jnp.exp(proc.y - shift[:, None]), split.reduce))
  count = lambda where: split.reduce(jnp.sum(where, axis=-1, dtype=jnp.int32))
  # logsumexp_K(y) - logsumexp(y), shifts apart so large y do not cancel.
  logz = (proc.shift - shift) + (proc.log_sum - log_sum)
  return assemble(
      valid=valid, greedy=params.temperature == 0, token=split.argmax(proc.y),
      count=count(proc.keep), finite=count(finite), logz=logz,
      lse=shift + log_sum, row_max=proc.row_max, ordered_ids=proc.order,
      max_ids=max_ids)
