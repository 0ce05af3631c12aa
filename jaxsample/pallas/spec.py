"""Fused rejection sampling for speculative decoding: one pass over the
target logits for one-hot drafts, two with draft logits.

Implements ``jaxsample.spec.rejection_sample`` (its module doc is the spec).
Everything stays on the device: no host sync, no sort, no full softmax in
HBM.

Truncation: in a batch where some sampled request has a filter on, the
threshold kernels first find the kept set ``{y >= floor}`` of every target
row at a slot ``<= n_b`` and draft row at a slot ``< n_b``
(``kept_floors``: ``threshold.kept_sets``, two to four passes over each
such row, more for rows whose ties fill the candidate buffer); the passes
below then read each row through its floor: elements below its
``common.logit_floor`` read as -inf (one compare, no division), so their
sums, races and log-probabilities are those of the processed
distributions.  Untruncated batches skip this (``rowwise.cond``: a
``lax.cond`` with traced params; no cond inside ``kept_sets``) and run
kernels without floors.

One-hot drafts (``_reject_one_hot``): the Gumbel kernel
(``gumbel.gumbel_partials``) reads every target row ``i <= n_b`` once, with
the noise of stream ``(noise_b, p + i)``: greedy rows give their argmax,
sampled rows their race and sum-exp with the draft ``d_i`` left out
(``exclude``) for ``i < n_b``, which is the race of the residual of a one-hot
draft (``w_v = y_v``, ``v != d_i``) whichever slot is the first rejection,
and the plain race at ``i = n_b`` (the bonus token).  An XLA step adds
``d_i`` back into its row's normalizer and validity (from its gathered
logit), decides acceptance exactly as the reference
(``jaxsample.spec.accepted_count``) and picks slot ``j``'s race.  Reads:
the target logits of slots ``<= n_b`` once; noise is drawn for each of those
rows (the price of needing no second pass).

Draft logits (``_reject_with_draft_logits``), ``k >= 1``:

Pass 1, ``stats_partials`` (grid ``(rows, vocab splits)``, no noise): for
every *real* draft slot ``i < n`` it reads target row ``i`` and draft row
``i`` once and writes per-split partials: the max of the sanitized logits
``x``, and ``sum exp((x - max) / T)`` (sampled rows) or the argmax (greedy
target rows).  Padding slots, greedy requests' draft rows and every request's
bonus row ``k`` are not read; nor are rows whose kept set the threshold
kernels measured (``KeptSets.measured``: they bring their normalizer).  A
small XLA combine merges the partials into each row's ``logsumexp`` and
decides acceptance (the logits at the draft tokens are gathered, ``2 B k``
elements).

Pass 2, ``emit_partials`` (grid ``(B, vocab splits)``): one row per request,
target row ``j`` and draft row ``j``, with the Gumbel noise of stream
``(noise_b, p + j)`` drawn in the kernel (``gumbel.GumbelRace``: the
reference's noise and arithmetic).  Per request, one of

* greedy: the argmax of row ``j`` (nothing after a rejection, ``j < n``:
  pass 1 has that argmax; the program exits at once);
* race: Gumbel-max of ``y = x / T`` over row ``j``, with the draft token
  ``d_j`` left out after a rejection whose draft row is invalid (a one-hot
  draft); also the bonus token and invalid rows;
* residual: Gumbel-max of ``w = y + log1p(-exp(ld - lt))``, with the pass-1
  normalizers of both rows; a plain race rides along until the split sees
  its first residual element (for the zero-residual fallback).

Reads: ``B k`` target and draft rows in pass 1, one target row (and one
draft row for a residual) per request in pass 2.

Tokens equal the reference's bit for bit wherever they do not hinge on a
normalizer; the acceptance test and the draft-logits residual use
normalizers summed in another order than XLA's (~1e-7 relative), so they
agree with the reference except within that rounding of a tie.  Logprobs
agree to ~1e-6.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsample import reference, rng, rowwise
from jaxsample import spec as spec_ref
from jaxsample.pallas import common, gumbel, threshold
from jaxsample.params import SamplerConfig, SamplingParams

STATS_BLOCK = 4096
"""Default elements per load of pass 1 (``SamplerConfig.block_size`` overrides)."""


# ---------------------------------------------------------------------------
# Row reductions shared by both passes.
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Pass 1: statistics of the draft slots' target (and draft) rows.
# ---------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowStats:
  """Per-row results of pass 1, ``[B, k]`` each (rows never read: max -inf).

  ``max``: max of the sanitized logits ``x``; ``argmax``: its smallest index
  (greedy target rows only); ``shift`` / ``log_sum``: ``logsumexp(y) = shift +
  log_sum`` with ``shift = max(y)``, ``y`` the tempered logits (sampled
  rows); ``valid``: ``max(y)`` is finite (the reference's row validity).
  """

  max: jax.Array
  argmax: jax.Array
  shift: jax.Array
  log_sum: jax.Array
  valid: jax.Array


def _stats_kernel(temp_ref, n_ref, *refs, plan, k, batch, vocab, floored):
  refs = list(refs)
  floor_ref, measured_ref = (refs.pop(0), refs.pop(0)) if floored else (None,
                                                                       None)
  target_ref, draft_ref, max_ref, arg_ref, sumexp_ref = refs
  r, split = pl.program_id(0), pl.program_id(1)
  math = common.KernelMath(plan.interpret)
  split_start = split * plan.split_len
  is_draft = r >= batch * k
  local = jnp.where(is_draft, r - batch * k, r)
  b, i = local // k, local % k
  t = temp_ref[b]

  zero = split - split  # Triton lowers no store of a literal: a computed 0.

  def write(m, arg, s):
    max_ref[r, split] = m
    arg_ref[r, split] = arg
    sumexp_ref[r, split] = s

  def skip():  # padding slot, or a greedy request's draft row
    write(zero.astype(jnp.float32) - jnp.inf, zero, zero.astype(jnp.float32))

  target_load = common.row_chunk_loader(target_ref, b * (k + 1) + i,
                                        plan.chunk)

  def greedy():
    m, arg = common.split_argmax(plan, math, split_start, vocab,
                                  target_load)
    write(m, arg, zero.astype(jnp.float32))

  def sampled(load):
    if floored:
      load = common.floored_loader(load, floor_ref[r])

    def branch():
      m, s = common.split_sumexp(plan, math, split_start, vocab, load, t)
      write(m, zero, s)
    return branch

  branches = [skip, greedy, sampled(target_load),
              sampled(common.row_chunk_loader(draft_ref, local, plan.chunk))]
  # Computed constants: Triton lowers no select of two scalar literals.
  kind = jnp.where(is_draft, jnp.where(t == 0, zero, zero + 3),
                   jnp.where(t == 0, zero + 1, zero + 2))
  read = i < n_ref[b]
  if floored:  # a measured kept set brings its own normalizer
    read &= measured_ref[r] == 0
  kind = jnp.where(read, kind, zero)
  _switch(kind, branches)


def _switch(index, branches):
  """Runs ``branches[index]`` (side effects only).  ``lax.switch``'s index
  clamp does not compile in Triton (its ``maxsi`` mixes integer widths)."""
  for j, branch in enumerate(branches):
    pl.when(index == j)(branch)


def stats_plan(rows: int, vocab: int, dtype, config: SamplerConfig):
  """Launch plan of pass 1: ``STATS_BLOCK``-element loads (fewer for a small
  vocabulary), no noise."""
  block = config.block_size or min(STATS_BLOCK,
                                   max(16, 1 << (vocab - 1).bit_length()))
  return common.make_plan(rows, vocab, dtype,
                          dataclasses.replace(config, block_size=block),
                          generator=None)


def stats_partials(target, draft, temperature, n, config: SamplerConfig,
                   kept: threshold.KeptSets | None = None):
  """Runs pass 1 on ``target`` ``[B, k + 1, V]`` and ``draft`` ``[B, k,
  V]``: ``(max, argmax, sumexp)``, each ``[rows, S]`` with rows = the ``B k``
  target slots then the ``B k`` draft slots; ``kept`` (``[rows]`` each, or
  None): each sampled row's sum covers its kept set ``{y >= threshold}``
  only, and ``measured`` rows are not read (``combine_stats`` takes their
  normalizers from ``kept``)."""
  batch, k1, vocab = target.shape
  k = k1 - 1
  rows = 2 * batch * k
  plan = stats_plan(rows, vocab, target.dtype, config)
  shape = (rows, plan.num_splits)
  kernel = functools.partial(_stats_kernel, plan=plan, k=k, batch=batch,
                             vocab=vocab, floored=kept is not None)
  call = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.int32),
                 jax.ShapeDtypeStruct(shape, jnp.float32)],
      grid=shape, compiler_params=plan.compiler_params(),
      interpret=plan.interpret, name="jaxsample_spec_stats")
  args = [temperature.astype(jnp.float32), n.astype(jnp.int32),
          *([common.logit_floor(kept.threshold, jnp.tile(jnp.repeat(
              temperature, k), 2)),
             kept.measured.astype(jnp.int32)] if kept is not None else []),
          target.reshape(batch * k1, vocab), draft.reshape(batch * k, vocab)]
  return call(*args)


def combine_stats(m, arg, sumexp, temperature,
                  kept: threshold.KeptSets | None = None) -> RowStats:
  """Merges pass-1 partials ``[B, k, S]`` of rows of requests with
  temperatures ``[B]`` (max and rescaled sum, first split winning ties);
  rows ``kept.measured`` (``[B, k]`` each) take ``logsumexp = row_max +
  log_kept`` from the threshold kernels instead (pass 1 skipped them)."""
  t = temperature[:, None]
  greedy = t == 0
  row_max = jnp.max(m, axis=-1)
  arg = jnp.min(jnp.where(m == row_max[..., None], arg,
                          jnp.iinfo(jnp.int32).max), axis=-1)
  safe = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  inv_t = 1.0 / jnp.where(greedy, 1.0, t)
  total = jnp.sum(sumexp * jnp.exp((m - safe[..., None]) * inv_t[..., None]),
                  axis=-1)
  shift = jnp.where(greedy, row_max, row_max / jnp.where(greedy, 1.0, t))
  log_sum = jnp.log(total)
  if kept is not None:
    shift = jnp.where(kept.measured, kept.row_max, shift)
    log_sum = jnp.where(kept.measured, kept.log_kept, log_sum)
  return RowStats(row_max, arg, shift, log_sum, jnp.isfinite(shift))


def log_probs_at(x, stats_shift, stats_log_sum, temperature, floor=-jnp.inf):
  """``lt(v)`` of sampled valid rows from the sanitized logit ``x`` at ``v``:
  ``(y - shift) - log_sum`` with ``y = x / T``, -inf for a -inf logit or
  ``y`` below the kept set's ``floor`` (reference.log_probs)."""
  t = jnp.where(temperature > 0, temperature, 1.0)
  y = common.xla_temper(x, jnp.broadcast_to(t, x.shape))
  return jnp.where((y > -jnp.inf) & (y >= floor),
                   (y - stats_shift) - stats_log_sum, -jnp.inf)


# ---------------------------------------------------------------------------
# Pass 2: the emitted token (one row per request, Gumbel noise).
# ---------------------------------------------------------------------------

SKIP, GREEDY, RACE, RESIDUAL = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True, eq=False)
class _ResidualMath(common.KernelMath):
  """``KernelMath`` whose ``div`` yields the residual logits of one chunk.

  ``GumbelRace.chunk_step`` races ``div(x, T) + g`` and filters on ``x / T``
  alone; with ``div(x, T) = w = y + log1p(-exp(ld - lt)) <= y``
  (``jaxsample.spec.residual_logits``) its filter stays a valid bound and its
  exact branch races ``w + g``, computing ``w`` only for chunks that may win.
  """

  draft: jax.Array = None
  norms: tuple = ()

  def div(self, x, t):
    shift_t, log_sum_t, shift_d, log_sum_d = self.norms
    y = super().div(x, t)
    lt = (y - shift_t) - log_sum_t
    ld = (super().div(self.draft, t) - shift_d) - log_sum_d
    return spec_ref.residual_logits(y, lt, ld)


_EMIT_ROW_DTYPES = ((jnp.float32,) + (jnp.int32,) * 4 + common.STREAM_DTYPES
                    + (jnp.float32,) * 4)
"""The emit kernel's row table: temperature, ``EmitRequest``'s mode, row_t,
row_d, exclude, streams and norms (then its floors, float32)."""


def _emit_kernel(table_ref, target_ref, draft_ref, *outs, plan, vocab,
                 generator, fp64, floored):
  num_floors = 2 if floored else 0
  row = common.table_row(table_ref, pl.program_id(0),
                         _EMIT_ROW_DTYPES + (jnp.float32,) * num_floors)
  t, mode, row_t, row_d, exclude = row[:5]
  stream = rng.RowStreams(*row[5:9])
  shift_t, log_sum_t, shift_d, log_sum_d = row[9:13]
  floors = row[13:]
  (race_ref, index_ref, max_ref, sumexp_ref, plain_race_ref,
   plain_index_ref) = outs[:6]
  lo_refs = outs[6:]
  b, split = pl.program_id(0), pl.program_id(1)
  math = common.KernelMath(plan.interpret)
  split_start = split * plan.split_len
  race_dtype = jnp.float64 if fp64 else jnp.float32
  first_index = split_start + jnp.arange(plan.chunk, dtype=jnp.int32)
  load_t = common.row_chunk_loader(target_ref, row_t, plan.chunk)
  # The races read the kept sets only (the greedy argmax reads the row).
  race_t = common.floored_loader(load_t, floors[0]) if floored else load_t
  noise = common.Noise(generator, stream, jnp.int32(0), wide=fp64)
  race = gumbel.GumbelRace(math, t, race_dtype, wide=fp64)
  one = (split - split + 1).astype(jnp.float32)  # no literal stores in Triton

  def store(ref, lo_index, value):
    if fp64:
      ref[b, split], lo_refs[lo_index][b, split] = gumbel._split_words(value)  # pylint: disable=protected-access
    else:
      ref[b, split] = value

  def write(finished, plain=None):
    top, index, m, s = finished
    store(race_ref, 0, top)
    index_ref[b, split] = index
    max_ref[b, split] = m
    sumexp_ref[b, split] = s
    plain_top, plain_index = plain or (top, index)
    store(plain_race_ref, 1, plain_top)
    plain_index_ref[b, split] = plain_index

  def skip():  # the token is known from pass 1
    none = one * -jnp.inf
    write((none.astype(race_dtype), split - split, none, one))

  def greedy():
    top, index = common.split_argmax(plan, math, split_start, vocab, load_t)
    write((top.astype(race_dtype), index, top, one))

  def plain_race():
    race_load = common.excluding_loader(race_t, exclude, plan.chunk)
    if gumbel.TILE_SKIP:
      state = common.tile_loop(
          plan, math, split_start, vocab, race_load,
          lambda state, tile, loaded: race.step(state, tile, loaded)[0],
          race.init(first_index), noise=noise)
    else:
      state = common.chunk_loop(plan, math, split_start, vocab, race_load,
                                race.chunk_step, race.init(first_index),
                                noise=noise)
    write(race.finish(state))

  load_d = common.row_chunk_loader(draft_ref, row_d, plan.chunk)
  if floored:
    load_d = common.floored_loader(load_d, floors[1])
  norms = (shift_t, log_sum_t, shift_d, log_sum_d)

  def residual():
    def load(start, mask):
      return race_t(start, mask), load_d(start, mask)

    def step(states, chunk, xs):
      x, xd = xs
      res_state, plain_state = states
      res = dataclasses.replace(race, math=_ResidualMath(
          plan.interpret, xd.astype(jnp.float32), norms))
      res_state = res.chunk_step(res_state, chunk, x)
      # Once the split holds a residual element the plain race is moot.
      plain_state = lax.cond(res_state[2] > -jnp.inf, lambda: plain_state,
                             lambda: race.chunk_step(plain_state, chunk, x))
      return res_state, plain_state

    init = race.init(first_index)
    res_state, plain_state = common.chunk_loop(
        plan, math, split_start, vocab, load, step, (init, init),
        noise=noise)
    plain_top, plain_index, _, _ = race.finish(plain_state)
    write(race.finish(res_state), (plain_top, plain_index))

  _switch(mode, [skip, greedy, plain_race, residual])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EmitRequest:
  """Pass-2 work of each request, ``[B]`` each.

  ``mode``: ``SKIP`` (token known from pass 1), ``GREEDY``, ``RACE`` or
  ``RESIDUAL`` (module doc); ``row_t`` / ``row_d``: flat
  target / draft row; ``exclude``: vocab id left out of the race (-1: none);
  ``norms``: ``(shift_t, log_sum_t, shift_d, log_sum_d)`` of those rows
  (``RESIDUAL`` only); ``streams``: noise streams; ``floors``: ``(floor_t,
  floor_d)``, the kept sets ``{y >= floor}`` of those rows, or ``()`` (no
  filter).
  """

  mode: jax.Array
  row_t: jax.Array
  row_d: jax.Array
  exclude: jax.Array
  norms: tuple
  streams: rng.RowStreams
  floors: tuple = ()


def emit_partials(target2d, draft2d, temperature, req: EmitRequest,
                  config: SamplerConfig):
  """Runs pass 2 on flat rows ``target2d`` ``[R, V]`` and ``draft2d``:
  ``(partials, plain)``, ``gumbel.GumbelPartials`` ``[B, S]`` of the race
  (the residual race for ``RESIDUAL`` requests) and the ``(race, index)`` of
  the plain race that backs up a zero residual."""
  batch = temperature.shape[0]
  vocab = target2d.shape[1]
  fp64 = config.use_fp64_gumbel
  plan = common.make_plan(batch, vocab, target2d.dtype, config,
                          generator=config.rng)
  shape = (batch, plan.num_splits)
  race_type = jax.ShapeDtypeStruct(shape, jnp.uint32 if fp64 else jnp.float32)
  i32 = jax.ShapeDtypeStruct(shape, jnp.int32)
  f32 = jax.ShapeDtypeStruct(shape, jnp.float32)
  out_shape = [race_type, i32, f32, f32, race_type, i32]
  if fp64:  # the low words of both races
    out_shape += [jax.ShapeDtypeStruct(shape, jnp.uint32)] * 2
  kernel = functools.partial(_emit_kernel, plan=plan, vocab=vocab,
                             generator=config.rng, fp64=fp64,
                             floored=bool(req.floors))
  call = pl.pallas_call(kernel, out_shape=out_shape, grid=shape,
                        compiler_params=plan.compiler_params(),
                        interpret=plan.interpret, name="jaxsample_spec_emit")
  s = req.streams
  table = rowwise.pack_rows([
      temperature.astype(jnp.float32), req.mode, req.row_t, req.row_d,
      req.exclude, s.key0, s.key1, s.base_hi, s.base_lo,
      *[a.astype(jnp.float32) for a in req.norms],
      *[common.logit_floor(f, temperature) for f in req.floors]],
                             temperature.shape[0])
  race, index, row_max, sumexp, plain_race, plain_index, *lo = call(
      table, target2d, draft2d)
  if fp64:
    race = gumbel._join_words(race, lo[0])  # pylint: disable=protected-access
    plain_race = gumbel._join_words(plain_race, lo[1])  # pylint: disable=protected-access
  partials = gumbel.GumbelPartials(race=race, index=index, max=row_max,
                                   sumexp=sumexp, raced_tiles=None)
  return partials, (plain_race, plain_index)


def _race_winner(race, index):
  """``(top, token)`` of per-split race partials ``[B, S]`` (first split wins
  ties), as ``gumbel.combine_partials``."""
  top = jnp.max(race, axis=-1)
  token = jnp.min(jnp.where(race == top[:, None], index,
                            jnp.iinfo(jnp.int32).max), axis=-1)
  return top, token


# ---------------------------------------------------------------------------
# The whole sampler.
# ---------------------------------------------------------------------------


def _at(a, j):
  """``a[b, j[b]]`` for ``a`` ``[B, m]``."""
  return jnp.take_along_axis(a, j[:, None], axis=1)[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeptFloors:
  """``threshold.KeptSets`` of the target rows (``[B, k + 1]`` each) and of
  the draft rows (``[B, k]``; None without draft logits), without their
  ``ordered_ids``; ``target_ids``: the target rows' (``[B, k + 1, W]``, or
  None)."""

  target: threshold.KeptSets
  draft: threshold.KeptSets | None
  target_ids: jax.Array | None = None


def kept_floors(target_logits, draft_logits, n, params: SamplingParams,
                config: SamplerConfig, *, order_width: int = 0) -> KeptFloors:
  """``threshold.kept_sets`` of the target rows and the draft rows that the
  kernels may read (target slots ``<= n``, draft slots ``< n``; one cond:
  ``threshold.joint_kept_sets``); threshold -inf, not measured, for the
  other rows.  ``order_width``: also the target rows' ids by probability
  (``KeptSets.ordered_ids``, ``[B, k + 1, W]``), and every target kept set
  measured (their masks' counts and masses)."""
  batch, k1, vocab = target_logits.shape

  def query(logits, live, width=0):
    m = live.shape[1]
    rows = spec_ref.per_row_params(params, m, live)  # greedy rows: no floor
    return threshold.KeptSetQuery(logits.reshape(batch * m, vocab), rows,
                                  width, measure_all=bool(width))

  slots = jnp.arange(k1)
  queries = [query(target_logits, slots <= n[:, None], order_width)]
  if draft_logits is not None and k1 > 1:
    queries.append(query(draft_logits, slots[:-1] < n[:, None]))
  # One cond for the large-set routes of both (one predicate's trip).
  target, *draft = [
      jax.tree.map(lambda a, m=q.logits.shape[0] // batch: a.reshape(
          (batch, m) + a.shape[1:]), sets)
      for q, sets in zip(queries, threshold.joint_kept_sets(queries, config))]
  return KeptFloors(dataclasses.replace(target, ordered_ids=None),
                    draft[0] if draft else None, target.ordered_ids)


def _reject_one_hot(target_logits, d, n, params: SamplingParams, noise_keys,
                    accept_keys, positions, synthetic_rates,
                    config: SamplerConfig,
                    floors: KeptFloors | None) -> spec_ref.SpecResult:
  """``reject`` for one-hot drafts in one pass: the Gumbel kernel races every
  target row ``i <= n`` with the noise of position ``p + i``, leaving the
  draft ``d_i`` out of sampled rows ``i < n`` (the one-hot residual), and
  sums it (module doc, "One-hot drafts")."""
  batch, k1, vocab = target_logits.shape
  k = k1 - 1
  t = params.temperature
  greedy = t == 0
  slots = jnp.arange(k1, dtype=jnp.int32)
  drafted = (slots[:k] < n[:, None]) & ~greedy[:, None]  # d_i left out
  exclude = jnp.concatenate([jnp.where(drafted, d, -1),
                             jnp.full((batch, 1), -1, jnp.int32)], axis=1)
  streams, _ = rng.row_streams(
      jnp.repeat(noise_keys, k1, axis=0),
      (positions[:, None] + slots.astype(jnp.uint32)).reshape(-1),
      batch * k1, vocab)
  floor_t = (floors.target.threshold if floors is not None else
             jnp.full((batch, k1), -jnp.inf))
  target2d = target_logits.reshape(batch * k1, vocab)
  partials = gumbel.gumbel_partials(
      target2d, jnp.repeat(t, k1), streams,
      config, active=(slots <= n[:, None]).reshape(-1),
      floor=floor_t.reshape(-1) if floors is not None else None,
      exclude=exclude.reshape(-1))
  per_slot = lambda a: a.reshape(batch, k1)
  token, race_max, shift, log_sum = map(per_slot, jax.tree.leaves(
      gumbel.combine_partials(partials)))
  top = per_slot(_race_winner(partials.race, partials.index)[0])

  # Add the left-out drafts back into their rows' normalizers and validity.
  first_row = jnp.arange(batch, dtype=jnp.int32) * k1
  x_d = reference.sanitize(target2d[first_row[:, None] + slots[:k], d])
  y_d = common.xla_temper(x_d, jnp.where(greedy, 1.0, t)[:, None])
  pad = lambda a, v: jnp.concatenate([a, jnp.full((batch, 1), v, a.dtype)], 1)
  y_out = pad(jnp.where(drafted & (y_d >= floor_t[:, :k]), y_d, -jnp.inf),
              -jnp.inf)
  back = y_out > -jnp.inf
  new_shift = jnp.where(back, jnp.maximum(shift, y_out), shift)
  log_sum = jnp.where(back, jnp.log(jnp.exp(log_sum + (shift - new_shift)) +
                                    jnp.exp(y_out - new_shift)), log_sum)
  valid = ((race_max < jnp.inf) & (y_out < jnp.inf) &
           (jnp.isfinite(race_max) | jnp.isfinite(y_out)))

  lt_d = jnp.where(greedy[:, None], jnp.where(d == token[:, :k], 0.0, -jnp.inf),
                   log_probs_at(x_d, new_shift[:, :k], log_sum[:, :k],
                                t[:, None], floor_t[:, :k]))
  lt_d = jnp.where(valid[:, :k], lt_d, -jnp.inf).astype(jnp.float32)
  j = jnp.zeros((batch,), jnp.int32)
  if k:
    u = spec_ref.acceptance_uniforms(accept_keys, positions, k, vocab,
                                     config.rng)
    j = spec_ref.accepted_count(u, lt_d, jnp.zeros_like(lt_d),
                                d == token[:, :k], greedy, valid[:, :k], n,
                                synthetic_rates)

  # The token at slot j: its row's race (without d_j after a rejection).
  token_j, top_j, valid_j = _at(token, j), _at(top, j), _at(valid, j)
  d_j = _at(pad(d, 0), j)
  left_out = _at(exclude, j) >= 0
  # d_j wins when nothing else is left (a zero residual) and, on an invalid
  # row, when it is the first of the row's +inf (reference.race_tokens).
  inf_first = (~valid_j & (_at(y_out, j) == jnp.inf) &
               ((d_j < token_j) | (top_j < jnp.inf)))
  token_j = jnp.where(left_out & ((valid_j & (top_j == -jnp.inf)) | inf_first),
                      d_j, token_j).astype(jnp.int32)
  x_token = reference.sanitize(target2d[first_row + j, token_j])
  lp = jnp.where(greedy, 0.0, log_probs_at(
      x_token, _at(new_shift, j), _at(log_sum, j), t, _at(floor_t, j)))
  lp = jnp.where(valid_j, lp, -jnp.inf).astype(jnp.float32)
  return spec_ref.assemble(d, j, token_j, lt_d, lp)


def reject(target_logits, d, n, params: SamplingParams, noise_keys,
           accept_keys, positions, draft_logits, synthetic_rates,
           config: SamplerConfig,
           floors: KeptFloors | None = None) -> spec_ref.SpecResult:
  """``rejection_sample`` by the kernels for canonical params; ``d`` clipped
  drafts, ``n`` clipped counts, raw stream keys ``[B, 2]``
  (``spec.stream_keys``) and uint32 positions.  ``floors``: ``kept_floors``
  (a batch with filters on), or None where no request truncates."""
  if draft_logits is None or target_logits.shape[1] == 1:
    return _reject_one_hot(target_logits, d, n, params, noise_keys,
                           accept_keys, positions, synthetic_rates, config,
                           floors)
  return _reject_with_draft_logits(target_logits, d, n, params, noise_keys,
                                   accept_keys, positions, draft_logits,
                                   synthetic_rates, config, floors)


def _reject_with_draft_logits(target_logits, d, n, params: SamplingParams,
                              noise_keys, accept_keys, positions, draft_logits,
                              synthetic_rates, config: SamplerConfig,
                              floors: KeptFloors | None) -> spec_ref.SpecResult:
  """``reject`` with draft logits (``k >= 1``): passes 1 and 2."""
  batch, k1, vocab = target_logits.shape
  k = k1 - 1
  t = params.temperature
  greedy = t == 0
  target2d = target_logits.reshape(batch * k1, vocab)
  draft2d = draft_logits.reshape(batch * k, vocab)
  rows = jnp.arange(batch, dtype=jnp.int32)
  floored = floors is not None
  kept_t = floors.target if floored else threshold.untruncated_sets((batch, k1))
  kept_d = floors.draft if floored else threshold.untruncated_sets((batch, k))
  floor_t, floor_d = kept_t.threshold, kept_d.threshold

  kept_t_slots = jax.tree.map(lambda a: a[:, :k], kept_t)
  row_kept = None
  if floored:
    row_kept = jax.tree.map(
        lambda *a: jnp.concatenate([x.reshape(-1) for x in a]),
        kept_t_slots, kept_d)
  m, arg, sumexp = stats_partials(target_logits, draft_logits, t, n, config,
                                  kept=row_kept)
  split = lambda a: a.reshape(-1, batch, k, a.shape[-1])
  m, arg, sumexp = split(m), split(arg), split(sumexp)
  ts = combine_stats(m[0], arg[0], sumexp[0], t,
                     kept_t_slots if floored else None)
  ds = combine_stats(m[1], arg[1], sumexp[1], t, kept_d if floored else None)
  # The logits at the drafts, gathered from the flat rows (no slice copy).
  slots = jnp.arange(k, dtype=jnp.int32)
  x_t = reference.sanitize(target2d[rows[:, None] * k1 + slots, d])
  lt_d = jnp.where(greedy[:, None],
                   jnp.where(d == ts.argmax, 0.0, -jnp.inf),
                   log_probs_at(x_t, ts.shift, ts.log_sum, t[:, None],
                                floor_t[:, :k]))
  lt_d = jnp.where(ts.valid, lt_d, -jnp.inf).astype(jnp.float32)
  x_d = reference.sanitize(draft2d[rows[:, None] * k + slots, d])
  ld_d = jnp.where(ds.valid, log_probs_at(x_d, ds.shift, ds.log_sum,
                                          t[:, None], floor_d), 0.0)
  u = spec_ref.acceptance_uniforms(accept_keys, positions, k, vocab,
                                   config.rng)
  j = spec_ref.accepted_count(u, lt_d, ld_d, d == ts.argmax, greedy,
                              ts.valid, n, synthetic_rates)
  jc = jnp.minimum(j, k - 1)
  # A greedy rejection emits row j's argmax: pass 1 has it.
  known = greedy & (j < n)
  known_token = _at(ts.argmax, jc)
  known_lp = jnp.where(_at(ts.valid, jc), 0.0, -jnp.inf)
  rejected = (j < n) & ~greedy & _at(ts.valid, jc)
  d_j = _at(d, jc)
  use_draft = rejected & _at(ds.valid, jc)
  norms = (_at(ts.shift, jc), _at(ts.log_sum, jc), _at(ds.shift, jc),
           _at(ds.log_sum, jc))

  emit_floors = ()
  if floored:
    emit_floors = (_at(floor_t, j), _at(floor_d, jc))
  streams, _ = rng.row_streams(noise_keys, positions + j.astype(jnp.uint32),
                               batch, vocab)
  mode = jnp.where(known, SKIP, jnp.where(
      greedy, GREEDY, jnp.where(use_draft, RESIDUAL, RACE)))
  req = EmitRequest(mode.astype(jnp.int32), rows * k1 + j, rows * k + jc,
                    jnp.where(rejected & ~use_draft, d_j, -1).astype(jnp.int32),
                    norms, streams, emit_floors)
  partials, plain = emit_partials(target2d, draft2d, t, req, config)

  # The plain race's token and logprob: as jaxsample.sample's kernel path.
  token, row_max, lse = gumbel.combine_partials(partials)
  top, _ = _race_winner(partials.race, partials.index)
  _, plain_token = _race_winner(*plain)
  token = jnp.where((mode == RESIDUAL) & (top == -jnp.inf), plain_token, token)
  # A one-hot residual with no mass: d_j is the target's only token.
  token = jnp.where(rejected & ~use_draft & (top == -jnp.inf), d_j, token)
  x_token = reference.sanitize(target2d[req.row_t, token])
  plain_lp = reference.finalize(x_token, params, token, lse, row_max).logprobs
  residual_lp = log_probs_at(x_token, norms[0], norms[1], t, _at(floor_t, j))
  lp = jnp.where(rejected, residual_lp, plain_lp)
  token = jnp.where(known, known_token, token).astype(jnp.int32)
  lp = jnp.where(known, known_lp, lp).astype(jnp.float32)
  return spec_ref.assemble(d, j, token, lt_d, lp)
