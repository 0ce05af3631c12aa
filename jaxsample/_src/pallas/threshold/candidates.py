"""Pass 2: the candidates above a row's bound, compacted and packed."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxsample._src import rng, rowwise
from jaxsample._src.pallas import bitmask, common
from jaxsample._src import tuning
from jaxsample._src.pallas.threshold.base import (FILTER_SLACK, LOG2E,
                                             pack_param_table, pass_plan,
                                             pow2_ceil, row_params, sanitize,
                                             segment_size)
from jaxsample._src.params import SamplerConfig, SamplingParams

__all__ = ["Candidates", "collect_candidates", "Listing", "Segments"]


# ---------------------------------------------------------------------------
# Pass 2: candidates.
# ---------------------------------------------------------------------------


# ``_compact_kernel`` counts a chunk's listed elements in the high half of the
# word whose low half counts its candidates, so one prefix sum places both.
_LISTED = 1 << 16


def _compact_kernel(param_ref, active_ref, bound_ref, t1_ref, row_max_ref,
                    *refs, plan: common.KernelPlan, vocab: int, capacity: int,
                    list_capacity: int, segment: int, windowed: bool,
                    gathering: bool, masked: bool):
  """Writes the split's elements with ``x * (1 / T) >= L - slack`` (a superset
  of ``{y >= L}``: ``collect_candidates`` drops the rest) in vocab order and
  sums the mass of the other min-p survivors.  ``windowed`` (input ``U``,
  outputs ``above_out``): only the elements below ``U + slack`` are written;
  the count and mass of those above it (all ``y >= U``) go to ``above_out``.

  ``active`` holds flags: 1, the row's candidates; 2 (``list_capacity``:
  input ``L2``, output ``list_count_out``), its listing, every element with
  ``x * (1 / T) >= L2 - slack``, written in vocab order after the
  candidates' ``capacity`` slots, from the same loads, prefix sum and
  stores (two store streams cost an H100 as much as two passes).

  ``gathering`` (inputs ``gather``, ``listed`` and ``count`` of
  ``Segments``): ``gather`` rows read only their listed segments, the
  split's share of them in order, and report no outside mass.

  ``masked``: a ``bitmask.MaskedLogits`` words ref follows ``x_ref``.
  """
  row, split = pl.program_id(0), pl.program_id(1)
  flags = active_ref[row]
  active, candidates = flags != 0, (flags & 1) != 0
  listing = list_capacity > 0
  upper_refs, refs = refs[:windowed], refs[windowed:]
  list_refs, refs = refs[:listing], refs[listing:]
  gather_refs, (x_ref, *refs) = refs[:3 * gathering], refs[3 * gathering:]
  words_refs, (x_out, id_out, count_out, outside_out, *outs) = (
      refs[:masked], refs[masked:])
  above_out, list_count_out = outs[:2 * windowed], outs[2 * windowed:]
  gather = gather_refs[0][row] != 0 if gathering else None
  kmath = common.KernelMath(plan.interpret)
  inv_t = 1.0 / row_params(param_ref, row)[0].temperature
  slack = lambda v: FILTER_SLACK * jnp.abs(v)
  bound = bound_ref[row]
  t1 = t1_ref[row]
  row_max = row_max_ref[row]
  filter_bound = bound - slack(bound)
  upper = upper_refs[0][row] if windowed else jnp.inf
  filter_upper = upper + slack(upper)
  if listing:
    list_bound = list_refs[0][row]
    filter_list = jnp.where((flags & 2) != 0, list_bound - slack(list_bound),
                            jnp.inf)

  store = functools.partial(_store, x_out, id_out, row, split)

  def compact(carry, index, x):
    count, list_count, outside, *above = carry
    x = sanitize(x)
    approx = x * inv_t
    finite = x > -jnp.inf
    flag = (approx >= filter_bound) & finite
    # The difference first: y * log2(e) - row_max * log2(e) contracts to an
    # FMA, whose error overflows exp2 for |y| ~ 1e37.
    e = kmath.exp2_approx((approx - row_max) * LOG2E)
    if above_out:
      surely_above = approx >= filter_upper
      flag = flag & ~surely_above
      above = [above[0] + common.indicator(surely_above),
               above[1] + jnp.where(surely_above, e, 0.0)]
      below = ~flag & ~surely_above
    else:
      below = ~flag
    outside = outside + jnp.where(below & (approx >= t1), e, 0.0)
    if listing:
      flag = flag & candidates
      listed = (approx >= filter_list) & finite
      words = common.indicator(flag) + common.indicator(listed, _LISTED)
    else:
      words = common.indicator(flag)
    found = jnp.sum(words, dtype=jnp.int32)

    def write():
      before = jnp.cumsum(words, dtype=jnp.int32) - words
      if not listing:
        position = count + before
        store(position, flag & (position < capacity), index, x)
        return
      _store_with_listing(store, plan.chunk, capacity, list_capacity, before,
                          count, list_count, flag, listed, index, x)

    pl.when(found > 0)(write)
    if listing:
      return (count + (found & (_LISTED - 1)), list_count + (found >> 16),
              outside, *above)
    return count + found, list_count, outside, *above

  lanes = lambda dtype: jnp.zeros((plan.chunk,), dtype)
  init = (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
          lanes(jnp.float32))
  if above_out:
    init += (lanes(jnp.int32), lanes(jnp.float32))

  def finish(count, list_count, outside, above):
    count_out[row, split] = count
    outside_out[row, split] = jnp.sum(outside)
    for out, value in zip(above_out, above):
      out[row, split] = jnp.sum(value, dtype=out.dtype)
    if listing:
      list_count_out[0][row, split] = list_count

  @pl.when(active & ~gather if gathering else active)
  def _():
    count, list_count, outside, *above = common.chunk_loop(
        plan, kmath, split * plan.split_len, vocab,
        bitmask.row_loader(x_ref, words_refs, row, plan.chunk),
        lambda carry, chunk, x: compact(carry, chunk.index, x), init)
    finish(count, list_count, outside, above)

  if not gathering:
    return

  @pl.when(active & gather)
  def _():
    count, list_count, _, *above = _walk_listed_segments(
        plan, split, row, vocab, segment, gather_refs, x_ref, words_refs,
        compact, init)
    finish(count, list_count, jnp.zeros((), jnp.float32), above)


def _store(x_out, id_out, row, split, position, keep, index, x):
  """The compact pass's store: ``x`` and ``index`` at ``position`` of the
  program's output slots where ``keep``."""
  plgpu.store(x_out.at[row, split, position], x, mask=keep)
  plgpu.store(id_out.at[row, split, position], index, mask=keep)


def _store_with_listing(store, chunk: int, capacity: int, list_capacity: int,
                        before, count, list_count, flag, listed, index, x):
  """A chunk's candidates and listed elements in one store of ``[2,
  chunk]``: the candidates' slots, then the listing's after ``capacity``
  (``before``: the prefix sum of words counting candidates in their low
  half and listed elements in their high half, ``_LISTED``)."""
  first = lax.broadcasted_iota(jnp.int32, (2, chunk), 0) == 0
  position = jnp.where(first, count + (before & (_LISTED - 1)),
                       list_count + (before >> 16))
  keep = jnp.where(first, flag & (position < capacity),
                   listed & (position < list_capacity))
  wide = lambda v: jnp.broadcast_to(v, (2, chunk))
  store(jnp.where(first, position, capacity + position), keep,
        wide(index), wide(x))


def _walk_listed_segments(plan: common.KernelPlan, split, row, vocab: int,
                          segment: int, gather_refs, x_ref, words_refs, step,
                          carry):
  """Folds ``step(carry, index, x)`` over a gather row's listed segments
  (``Segments``): rounds of one chunk, ``chunk // segment`` listed segments
  each, the split taking its share of the rounds in order (``words_refs``:
  a ``bitmask.MaskedLogits`` row's words)."""
  _, listed_ref, listed_count_ref = gather_refs
  per_round = plan.chunk // segment
  listed = listed_count_ref[row]
  rounds = (listed + per_round - 1) // per_round
  mine = (rounds + plan.num_splits - 1) // plan.num_splits
  slot = lax.broadcasted_iota(jnp.int32, (plan.chunk,), 0) // segment
  offset = lax.broadcasted_iota(jnp.int32, (plan.chunk,), 0) % segment
  last_entry = listed_ref.shape[1] - 1

  def body(r, carry):
    first = r * per_round
    start = jnp.zeros((plan.chunk,), jnp.int32)
    for j in range(per_round):
      entry = jnp.minimum(first + j, last_entry)
      start = jnp.where(slot == j, listed_ref[row, entry] * segment, start)
    index = start + offset
    load = (first + slot < listed) & (index < vocab)
    index = jnp.where(load, index, 0)
    x = plgpu.load(x_ref.at[row, index], mask=load, other=-jnp.inf)
    if words_refs:
      x = jnp.where(bitmask.allowed_at(*words_refs, row, index, load), x,
                    -jnp.inf)
    return step(carry, index, x)

  return common.fori_loop(jnp.minimum(split * mine, rounds),
                          jnp.minimum((split + 1) * mine, rounds), body,
                          carry)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
  """Rows (``gather`` ``[B]``) whose candidates come from listed segments
  alone: ``listed`` ``[B, N]`` segment indices (ascending), ``count`` ``[B]``
  of them (``<= N`` on ``gather`` rows); every element reaching the compact
  pass's filter lies in a listed segment (``RowBounds.listed``).  ``mass``
  ``[B]``: the row's mass relative to ``row_max`` (``RowBounds.mass``).
  Gather rows need no outside mass (top-k on, or the bound is ``t1``) or
  have min-p off: then it is ``mass`` less the candidates'."""

  gather: jax.Array
  listed: jax.Array
  count: jax.Array
  mass: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Candidates:
  """The candidate buffer of each row, in vocab order, ``[B, C]`` each
  (padding: ``y = race = -inf``, ``id = -1``), with ``count`` ``[B]`` (exact,
  possibly above ``C``) and ``outside_mass`` ``[B]``: the mass relative to
  ``row_max`` of min-p survivors below the bound, ``inside_mass`` ``[B]`` that
  of the candidates.  Windowed (``upper`` given):
  the candidates are ``{L <= y < U}`` and ``above_count``/``above_mass`` the
  count and mass of ``{y >= U}`` (else 0).  The buffers of rows not active
  are undefined (their counts and masses 0)."""

  y: jax.Array
  ids: jax.Array
  race: jax.Array
  count: jax.Array
  outside_mass: jax.Array
  inside_mass: jax.Array
  above_count: jax.Array
  above_mass: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Listing:
  """A window with no upper end that the compact pass fills beside the
  candidates, from the same loads: every element of ``rows`` (``[B]``
  bool) with ``y >= lower`` (``[B]``), in vocab order, ``capacity``
  slots."""

  rows: jax.Array
  lower: jax.Array
  capacity: int = dataclasses.field(metadata=dict(static=True))


def collect_candidates(logits, params: SamplingParams | jax.Array, active,
                       lower_bound, t1, row_max,
                       streams: rng.RowStreams | None, config: SamplerConfig,
                       *, upper=None, capacity: int | None = None,
                       segments: Segments | None = None,
                       listing: Listing | None = None):
  """Runs the compact pass on the ``active`` rows (``[B]`` bool or int32
  flags; ``params`` or their ``pack_param_table``: their temperatures) and
  packs each row's candidates into ``C`` slots (``capacity``, default ``config.max_candidates``); with ``upper`` ``[B]``
  (``>= lower_bound``, ``>= t1``), only the window ``[lower_bound, upper)``;
  with ``segments``, its ``gather`` rows read only their listed segments
  (``RowBounds.listed``); the outside mass of those with min-p off is the
  row's ``mass`` less the candidates'.  Without ``streams`` no noise is
  drawn (``Candidates.race`` is None).  With ``listing`` (not with
  ``segments``), the pass also lists its window (rows need not be
  ``active``) and returns ``(candidates, listed)``: ``listed`` holds the
  ``Listing``'s elements (``Candidates`` of ``{y >= lower}``; no race, no
  masses)."""
  batch, vocab = logits.shape
  capacity = capacity or config.max_candidates
  windowed = upper is not None
  upper_inputs = (upper,) if windowed else ()
  tuned = tuning.resolve(config.tuning)
  plan = pass_plan(batch, vocab, tuned.compact, tuned.occupancy)
  shape = (batch, plan.num_splits)
  if listing is not None and (segments is not None or plan.chunk >= _LISTED):
    raise ValueError("a listing needs whole rows and chunks below 2^16")
  list_capacity = 0 if listing is None else listing.capacity
  param_table = pack_param_table(params)
  kernel = functools.partial(_compact_kernel, plan=plan, vocab=vocab,
                             capacity=capacity, list_capacity=list_capacity,
                             segment=segment_size(vocab, plan.chunk),
                             windowed=windowed, gathering=segments is not None,
                             masked=isinstance(logits, bitmask.MaskedLogits))
  flags = active.astype(jnp.int32)
  if listing is not None:
    flags = flags + 2 * listing.rows.astype(jnp.int32)
  list_inputs = () if listing is None else (listing.lower,)
  gather = () if segments is None else (segments.gather.astype(jnp.int32),)
  gather_inputs = gather and (*gather, segments.listed, segments.count)
  buffer = lambda dtype: jax.ShapeDtypeStruct(
      shape + (capacity + list_capacity,), dtype)
  split_values = lambda dtype: jax.ShapeDtypeStruct(shape, dtype)
  x, ids, count, outside, *outs = common.pallas_call(
      kernel,
      out_shape=[buffer(jnp.float32), buffer(jnp.int32),
                 split_values(jnp.int32), split_values(jnp.float32)] + [
                     split_values(jnp.int32),
                     split_values(jnp.float32)] * windowed + [
                         split_values(jnp.int32)] * (listing is not None),
      grid=shape, compiler_params=plan.compiler_params(),
      interpret=plan.interpret, name="jaxsample_collect_candidates")(
          param_table, flags, lower_bound, t1, row_max, *upper_inputs,
          *list_inputs, *gather_inputs, *bitmask.operands(logits))
  above, outs = outs[:2 * windowed], outs[2 * windowed:]
  pack = functools.partial(_pack, param_table=param_table, t1=t1,
                           row_max=row_max, splits=plan.num_splits,
                           generator=config.rng, launch=tuned.pack,
                           interpret=plan.interpret)
  candidates = pack(
      active, lower_bound, x, ids, count, outside, capacity=capacity,
      streams=streams, window=upper_inputs and (upper, *above),
      gather=gather and (*gather, segments.mass))
  if listing is None:
    return candidates
  return candidates, pack(listing.rows, listing.lower, x, ids, outs[0],
                          jnp.zeros(shape, jnp.float32),
                          capacity=list_capacity, offset=capacity)


def _pack(active, lower, x, ids, count, outside, *, param_table, t1, row_max,
          splits: int, capacity: int, generator: str,
          launch: tuning.PackLaunch, interpret: bool, offset: int = 0, streams: rng.RowStreams | None = None, window=(),
          gather=()) -> Candidates:
  """``Candidates`` of the compact pass's split buffers, ``capacity`` slots
  from ``offset`` (``_pack_kernel``; ``window``: ``(U, above count, above
  mass)``; ``gather``: ``(Segments.gather, mass)``)."""
  batch = active.shape[0]
  raced = streams is not None
  kernel = functools.partial(_pack_kernel, splits=splits, capacity=capacity,
                             offset=offset, generator=generator, raced=raced,
                             windowed=bool(window), gathering=bool(gather),
                             interpret=interpret)
  row_shape = lambda dtype: jax.ShapeDtypeStruct((batch,), dtype)
  slots = lambda dtype: jax.ShapeDtypeStruct((batch, capacity), dtype)
  y, ids, *race, count, outside, inside_mass, above_count, above_mass, _ = (
      common.pallas_call(
          kernel,
          out_shape=[slots(jnp.float32), slots(jnp.int32)] +
          [slots(jnp.float32)] * raced + [
              row_shape(jnp.int32), row_shape(jnp.float32),
              row_shape(jnp.float32), row_shape(jnp.int32),
              row_shape(jnp.float32),
              jax.ShapeDtypeStruct((batch, pow2_ceil(splits)), jnp.int32)],
          grid=(batch,),
          compiler_params=plgpu.CompilerParams(
              num_warps=launch.warps(capacity), num_stages=launch.num_stages),
          interpret=interpret, name="jaxsample_pack_candidates")(
              param_table, active.astype(jnp.int32), lower, t1, row_max,
              *([rowwise.pack_rows(jax.tree.leaves(streams), batch)] if raced
                else []), x, ids, count,
              outside, *window, *gather))
  return Candidates(y, ids, race[0] if raced else None, count, outside,
                    inside_mass, above_count, above_mass)


def _pack_kernel(param_ref, active_ref, lower_ref, t1_ref, row_max_ref, *refs,
                 splits: int, capacity: int, offset: int, generator: str,
                 raced: bool, windowed: bool, gathering: bool,
                 interpret: bool):
  """One row's candidates (``Candidates``) from the compact pass's split
  buffers (``capacity`` slots from ``offset``): the splits' entries side by
  side (vocab order; split ``s``'s first at slot ``starts[s]``, the sum of
  the earlier splits' written counts, which the kernel writes to its last
  output and reads back), tempered with the reference's division, the
  filter's extra elements moved to the outside mass (``y < L``) or above the
  window (``y >= U``; ``windowed``: inputs ``U`` and the compact pass's
  above count and mass), and the race values of the rest with the noise of
  their ids (``raced``: inputs the row streams, output the race).
  ``gathering`` (inputs ``Segments.gather`` and ``mass``): the outside mass
  of gather rows with min-p off is the row's less the candidates'."""
  stream_refs, refs = refs[:raced], refs[raced:]
  x_ref, id_ref, count_ref, outside_ref, *refs = refs
  window_refs, refs = refs[:3 * windowed], refs[3 * windowed:]
  gather_refs, refs = refs[:2 * gathering], refs[2 * gathering:]
  y_out, id_out, *refs = refs
  race_out, refs = (refs[0], refs[1:]) if raced else (None, refs)
  (count_out, outside_out, inside_out, above_count_out, above_mass_out,
   starts_ref) = refs
  row = pl.program_id(0)
  upper, above_refs = ((window_refs[0][row], window_refs[1:]) if windowed
                       else (jnp.inf, ()))
  kmath = common.KernelMath(interpret)
  active = active_ref[row] != 0

  def pack():
    lanes = jnp.arange(pow2_ceil(splits), dtype=jnp.int32)
    written = plgpu.load(count_ref.at[row, lanes], mask=lanes < splits,
                         other=0)
    written = jnp.minimum(written, capacity)
    starts_ref[row, :] = jnp.cumsum(written, dtype=jnp.int32) - written
    if not interpret:  # the stores above are read by other threads
      plgpu.debug_barrier()
    slot = lax.broadcasted_iota(jnp.int32, (capacity,), 0)
    # Each slot's split: the last one starting at or before it (binary search).
    source = jnp.zeros((capacity,), jnp.int32)
    step = pow2_ceil(splits) // 2
    while step:
      probe = source + step
      inside = probe < splits
      start = plgpu.load(starts_ref.at[row, jnp.where(inside, probe, 0)],
                         mask=inside, other=capacity)
      source = jnp.where(inside & (start <= slot), probe, source)
      step //= 2
    local = slot - plgpu.load(starts_ref.at[row, source])
    filled = local < jnp.minimum(plgpu.load(count_ref.at[row, source]),
                                 capacity)
    local = jnp.where(filled, local, 0) + offset
    x = plgpu.load(x_ref.at[row, source, local], mask=filled, other=-jnp.inf)
    ids = plgpu.load(id_ref.at[row, source, local], mask=filled, other=0)

    def split_sum(ref):  # one load of the row's per-split values
      return jnp.sum(plgpu.load(ref.at[row, lanes], mask=lanes < splits,
                                other=0), dtype=ref.dtype)

    count, outside = split_sum(count_ref), split_sum(outside_ref)
    above_count, above_mass = (split_sum(ref) for ref in above_refs) if (
        windowed) else (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))
    t = row_params(param_ref, row)[0].temperature
    y = jnp.where(x > -jnp.inf, kmath.temper(x, t), -jnp.inf)
    e = jnp.where(y > -jnp.inf, jnp.exp(y - row_max_ref[row]), 0.0)
    over = y >= upper
    inside = (y >= lower_ref[row]) & ~over
    t1 = t1_ref[row]
    extra = ~inside & ~over & (y >= t1)
    y = jnp.where(inside, y, -jnp.inf)
    ids = jnp.where(inside, ids, 0)
    y_out[row, :] = y
    id_out[row, :] = jnp.where(inside, ids, -1)
    if raced:
      stream = rng.RowStreams(*common.table_row(stream_refs[0], row,
                                                common.STREAM_DTYPES))
      race_out[row, :] = y + rng.gumbel(rng.uniform(rng.bits_at(
          generator, stream, ids, mulhilo=kmath.mulhilo)))
    count_out[row] = count
    inside_mass = jnp.sum(jnp.where(inside, e, 0.0))
    outside = outside + jnp.sum(jnp.where(extra, e, 0.0))
    if gathering:
      gather_ref, mass_ref = gather_refs
      outside = jnp.where((gather_ref[row] != 0) & (t1 == -jnp.inf),
                          jnp.maximum(mass_ref[row] - inside_mass, 0.0),
                          outside)
    outside_out[row] = outside
    inside_out[row] = inside_mass
    above_count_out[row] = above_count + common.count(over)
    above_mass_out[row] = above_mass + jnp.sum(jnp.where(over, e, 0.0))

  # Rows not active skip the packing: their buffers stay undefined, their
  # counts and masses are 0.
  pl.when(active)(pack)

  @pl.when(~active)
  def _():
    count_out[row] = 0
    above_count_out[row] = 0
    for out in (outside_out, inside_out, above_mass_out):
      out[row] = 0.0
