"""Pass 2 of the draft-logits verifier: one row per request emits its token
(greedy, race or residual race) and its partials."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsample._src import rng, rowwise, spec_reference
from jaxsample._src.pallas import common, gumbel
from jaxsample._src import tuning
from jaxsample._src.pallas.spec.stats import kernel_switch
from jaxsample._src.params import SamplerConfig

__all__ = ["emit_partials", "EmitRequest", "GREEDY", "RACE", "RESIDUAL", "SKIP"]


# ---------------------------------------------------------------------------
# Pass 2: the emitted token (one row per request, Gumbel noise).
# ---------------------------------------------------------------------------

SKIP, GREEDY, RACE, RESIDUAL = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True, eq=False)
class _ResidualMath(common.KernelMath):
  """``KernelMath`` whose ``div`` yields the residual logits of one chunk.

  ``GumbelRace.chunk_step`` races ``div(x, T) + g`` and filters on ``x / T``
  alone; with ``div(x, T) = w = y + log1p(-exp(ld - lt)) <= y``
  (``spec_reference.residual_logits``) its filter stays a valid bound and its
  exact branch races ``w + g``, computing ``w`` only for chunks that may win.
  """

  draft: jax.Array = None
  norms: tuple = ()

  def div(self, x, t):
    shift_t, log_sum_t, shift_d, log_sum_d = self.norms
    y = super().div(x, t)
    lt = (y - shift_t) - log_sum_t
    ld = (super().div(self.draft, t) - shift_d) - log_sum_d
    return spec_reference.residual_logits(y, lt, ld)


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
  kmath = common.KernelMath(plan.interpret)
  split_start = split * plan.split_len
  race_dtype = jnp.float64 if fp64 else jnp.float32
  first_index = split_start + jnp.arange(plan.chunk, dtype=jnp.int32)
  load_t = common.row_chunk_loader(target_ref, row_t, plan.chunk)
  # The races read the kept sets only (the greedy argmax reads the row).
  race_t = common.floored_loader(load_t, floors[0]) if floored else load_t
  noise = common.Noise(generator, stream, jnp.int32(0), wide=fp64)
  race = gumbel.GumbelRace(kmath, t, race_dtype, wide=fp64)
  one = (split - split + 1).astype(jnp.float32)  # no literal stores in Triton

  def store(ref, lo_index, value):
    if fp64:
      ref[b, split], lo_refs[lo_index][b, split] = (
          common.split_fp64_words(value))
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
    top, index = common.split_argmax(plan, kmath, split_start, vocab, load_t)
    write((top.astype(race_dtype), index, top, one))

  def plain_race():
    race_load = common.excluding_loader(race_t, exclude, plan.chunk)
    state = common.chunk_loop(plan, kmath, split_start, vocab, race_load,
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
      res = dataclasses.replace(race, kmath=_ResidualMath(
          plan.interpret, xd.astype(jnp.float32), norms))
      res_state = res.chunk_step(res_state, chunk, x)
      # Once the split holds a residual element the plain race is moot.
      plain_state = lax.cond(res_state[2] > -jnp.inf, lambda: plain_state,
                             lambda: race.chunk_step(plain_state, chunk, x))
      return res_state, plain_state

    init = race.init(first_index)
    res_state, plain_state = common.chunk_loop(
        plan, kmath, split_start, vocab, load, step, (init, init),
        noise=noise)
    plain_top, plain_index, _, _ = race.finish(plain_state)
    write(race.finish(res_state), (plain_top, plain_index))

  kernel_switch(mode, [skip, greedy, plain_race, residual])


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
  tuned = tuning.resolve(config.tuning)
  plan = common.race_plan(batch, vocab, tuned.spec_emit, tuned.occupancy,
                          generator=config.rng, fp64=fp64)
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
  call = common.pallas_call(kernel, out_shape=out_shape, grid=shape,
                            compiler_params=plan.compiler_params(),
                            interpret=plan.interpret,
                            name="jaxsample_spec_emit")
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
    race = common.join_fp64_words(race, lo[0])
    plain_race = common.join_fp64_words(plain_race, lo[1])
  partials = gumbel.GumbelPartials(race=race, index=index, max=row_max,
                                   sumexp=sumexp)
  return partials, (plain_race, plain_index)
