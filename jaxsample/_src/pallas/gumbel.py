"""Gumbel-max sampling kernel: logits ``[B, V]`` to tokens in one pass over HBM.

Per row ``b`` and vocab split ``s`` (grid ``(B, S)``), one program streams its
split one RNG tile (4 x 512 ids for philox) at a time and keeps, lane-wise:

* the running argmax of ``x / T + g`` (``g`` the Gumbel noise of
  ``jaxsample._src.rng`` for the global vocab ids: the reference's noise), behind
  a cheap exact filter (``GumbelRace``): a test on the uniforms skips the
  exact arithmetic for chunks that cannot win;
* the running ``sum exp(x / T - bound)`` (one exp per element, shared with
  the filter),

then writes per-split partials.  ``combine_partials`` merges partials
along the split axis, by a max and a rescaled sum; the vocab-parallel sampler
merges partials of vocab shards the same way.  Greedy rows (T = 0) run a
branch with no noise and no exp.  Equivalent to
``jaxsample._src.reference.sample_reference`` for untruncated rows: the same tokens
bit for bit, and logprobs within 1e-5 plus a few ulp of the row's largest
tempered logit (the sum-exp uses ``x * (1 / T)``, within ~1 ulp of the
reference's ``x / T``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsample._src import reference, rng, rowwise
from jaxsample._src.pallas import bitmask, common
from jaxsample._src import tuning
from jaxsample._src.params import SamplerConfig, SamplingParams

__all__ = ["combine_partials", "finish_sampling", "gumbel_partials",
           "GumbelPartials", "GumbelRace", "sample_untruncated"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GumbelPartials:
  """Per-split partial results, each ``[B, S]``.

  Attributes:
    race: best ``y + g`` of the split (fp64 on the FP64 path; the kernel
      returns fp64 as two uint32 words, see ``common.split_fp64_words``).
    index: its global vocab id (smallest on ties).
    max: the split's reference for ``sumexp``: its race bound in fp32 (its
      best race value; the max of ``x`` for greedy rows).  The max over a
      row's splits
      is the row's best race value: finite iff the row's tempered logits
      have a finite max.
    sumexp: ``sum exp(y - max)`` over the split.
    kept: with a ``floor``, the split's number of elements ``y >= floor``
      (the others are left out of ``race`` and ``sumexp``); with
      ``count_finite``, of entries ``> -inf``; else None.
  """

  race: jax.Array
  index: jax.Array
  max: jax.Array
  sumexp: jax.Array
  kept: jax.Array | None = None


def combine_partials(p: GumbelPartials):
  """Merges partials along the last axis: ``(token, row_max, (M, log_sum))``.

  The token is the index of the largest race value, the first split winning
  ties; ``logsumexp = M + log_sum`` with ``M = max_s max_s`` and
  ``log_sum = log(sum_s sumexp_s * exp(max_s - M))``.  ``row_max`` is finite
  iff the row's tempered logits have a finite max (the reference's validity).
  """
  top = jnp.max(p.race, axis=-1, keepdims=True)
  token = jnp.min(jnp.where(p.race == top, p.index, jnp.iinfo(jnp.int32).max),
                  axis=-1)
  row_max = jnp.max(p.max, axis=-1)
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  total = jnp.sum(p.sumexp * jnp.exp(p.max - safe_max[:, None]), axis=-1)
  return token, row_max, (safe_max, jnp.log(total))


_LOG2E = 1.4426950408889634
_SLACK = 2.0**-12


@dataclasses.dataclass(frozen=True)
class GumbelRace:
  """Exact Gumbel-max race over RNG tiles, with a cheap filter in front.

  The state is lane-wise ``(best, index)``, the race ``bound`` (the
  program's best race value so far, a lower bound of the row's) and
  lane-wise ``sumexp = sum exp(y - bound)``.  ``y' = x * (1 / T)`` approximates
  ``y = x / T``, and ``e = exp(y' - bound)`` (FFMA, ex2.approx) is computed
  once per element: it is the sum-exp term and feeds the filter.
  ``slack = 2^-12 (|bound| + 32)`` covers every approximation error (``y'``,
  ``ex2.approx``, fp32 rounding of the bound and of the exact race).

  **Chunk filter.**  With ``E = -log(u) >= 1 - u``, ``y + g = y - log(E) <
  bound`` whenever ``(1 - u) (1 - slack) > e`` (``1 - u`` from the uniform's
  top 23 bits, less 2^-23 on the fp64 path).  Only chunks with a possible
  winner compute the exact race ``x / T + g`` (XLA's division, accurate logs:
  the reference's arithmetic), so tokens are the reference's bit for bit.
  ``|bound| >= 4064`` disables the filter (still exact).
  """

  kmath: common.KernelMath
  t: jax.Array
  race_dtype: jnp.dtype
  wide: bool

  def init(self, first_index):
    n = first_index.shape[0]
    return (jnp.full((n,), -jnp.inf, self.race_dtype), first_index,
            jnp.full((), -jnp.inf, self.race_dtype),
            jnp.zeros((n,), jnp.float32))

  def _exp_below(self, x, bound32):
    """``exp(x * (1 / T) - bound)`` to ~6e-8 |x / T| (FFMA, FMUL, ex2)."""
    return self.kmath.exp2_approx((x * (1.0 / self.t) - bound32) * _LOG2E)

  @staticmethod
  def _margin(bound32):
    return 1.0 - _SLACK * (jnp.abs(bound32) + 32.0)

  def _one_minus_u(self, bits):
    """A lower bound of ``1 - u`` from the uniform's top 23 bits."""
    one_minus_u = 2.0 - lax.bitcast_convert_type(
        ((bits[0] if self.wide else bits) >> jnp.uint32(9)) |
        jnp.uint32(0x3F800000), jnp.float32)
    if self.wide:  # The high word fixes an fp64 uniform only to within 2^-23.
      one_minus_u = one_minus_u - 2.0**-23
    return one_minus_u

  def chunk(self, state, index, bits, x, e, e_bound32):
    """Filter + exact race of one chunk; ``e = exp_below(x, e_bound32)``
    (``e_bound32=None``: ``e`` is for the current bound)."""
    best, index_best, bound, sumexp = state
    bound32 = bound.astype(jnp.float32)
    if e_bound32 is not None:
      # The bound moved since e was computed (rare): recompute e.
      e = lax.cond(bound32 == e_bound32, lambda: e,
                   lambda: self._exp_below(x, bound32))
    # NaN-safe: a NaN anywhere makes the element a possible winner.
    loses = self._one_minus_u(bits) * self._margin(bound32) > e
    maybe = jnp.max(jnp.where(loses, jnp.int32(0), jnp.int32(1))) > 0

    def exact(_):
      xs = jnp.where(x != x, jnp.inf, x)
      race = self.kmath.div(xs, self.t).astype(self.race_dtype) + rng.gumbel(
          rng.uniform(bits))
      new_best, new_index = common.argmax_update(best, index_best, race,
                                                 index)
      new_bound = jnp.maximum(bound, jnp.max(race))
      new_bound32 = new_bound.astype(jnp.float32)
      # A scalar: plain exp (inline asm only takes blocks).
      scale = jnp.where(new_bound32 == bound32, 1.0,
                        jnp.exp(bound32 - new_bound32))
      e_new = jnp.where(x == -jnp.inf, 0.0, self._exp_below(x, new_bound32))
      return new_best, new_index, new_bound, sumexp * scale + e_new

    def fast(_):
      return best, index_best, bound, sumexp + e

    return lax.cond(maybe, exact, fast, None)

  def chunk_step(self, state, chunk: common.Chunk, x):
    """The chunk filter and race of one chunk: ``chunk_loop``'s step."""
    x = x.astype(jnp.float32)
    e = self._exp_below(x, state[2].astype(jnp.float32))
    return self.chunk(state, chunk.index, chunk.bits, x, e, None)

  def finish(self, state):
    """``(race, index, reference, sumexp)`` of the program: its best race value
    and id, and ``sumexp = sum exp(y - reference)`` with ``reference`` the
    fp32 bound (any finite reference combines exactly)."""
    best, index, bound, sumexp = state
    reference_ = bound.astype(jnp.float32)
    top, index = common.argmax_finish(best, index)
    return top, index, reference_, jnp.sum(sumexp)


_ROW_DTYPES = (jnp.float32, jnp.int32) + common.STREAM_DTYPES
"""The kernel's row table: temperature, active, the stream (then the floor
and the excluded id, when given)."""


def _kernel(*refs, plan: common.KernelPlan, vocab: int, generator: str,
            fp64: bool, floored: bool, count_finite: bool,
            excluding: bool = False, masked: bool = False):
  """One (row, split) program (``masked``: a ``bitmask.MaskedLogits``
  words ref follows the row ref)."""
  refs = list(refs)
  table_ref, offset_ref, x_ref = refs[:3]  # table: gumbel_partials
  words_refs = refs[3:3 + masked]
  del refs[:3 + masked]
  race_ref, index_ref, max_ref, sumexp_ref = refs[:4]
  del refs[:4]
  kept_ref = refs.pop(0) if floored or count_finite else None
  race_lo_ref = refs
  row, split = pl.program_id(0), pl.program_id(1)
  kmath = common.KernelMath(plan.interpret)
  split_start = split * plan.split_len
  offset = offset_ref[0]
  t, active, *stream = common.table_row(
      table_ref, row, _ROW_DTYPES + ((jnp.float32,) if floored else ()) +
      ((jnp.int32,) if excluding else ()))
  exclude = stream.pop() if excluding else None
  x_floor = stream.pop() if floored else None  # common.logit_floor
  stream = rng.RowStreams(*stream)
  race_dtype = jnp.float64 if fp64 else jnp.float32
  lanes = jnp.arange(plan.chunk, dtype=jnp.int32)
  first_index = split_start + lanes  # all -inf rows report the first id

  load = bitmask.row_loader(x_ref, words_refs, row, plan.chunk)
  # Sampled rows race (and sum) without the excluded id.
  race_load = (common.excluding_loader(load, exclude, plan.chunk)
               if excluding else load)

  def greedy():
    best, index, *finite = common.split_argmax(
        plan, kmath, split_start, vocab, load, count_finite=count_finite)
    # Greedy rows need no sum-exp; it is a computed 1 because Triton's cond
    # lowering cannot yield a literal.
    one = (index - index + 1).astype(jnp.float32)
    return (best.astype(race_dtype), index, best, one, *finite) + (
        index - index,) * floored

  def sampled():
    race = GumbelRace(kmath, t, race_dtype, wide=fp64)
    noise = common.Noise(generator, stream, offset, wide=fp64)
    if floored or count_finite:  # and count the raced entries (kept)
      state, kept = common.chunk_loop(
          plan, kmath, split_start, vocab, race_load,
          _counting_step(race, x_floor),
          (race.init(first_index), jnp.zeros((plan.chunk,), jnp.int32)),
          noise=noise)
      return (*race.finish(state), jnp.sum(kept, dtype=jnp.int32))
    state = common.chunk_loop(plan, kmath, split_start, vocab, race_load,
                              race.chunk_step, race.init(first_index),
                              noise=noise)
    return race.finish(state)

  @pl.when(active != 0)
  def _():
    best, index, m, s, *counts = lax.cond(t > 0, sampled, greedy)
    if fp64:
      race_ref[row, split], race_lo_ref[0][row, split] = (
          common.split_fp64_words(best))
    else:
      race_ref[row, split] = best
    index_ref[row, split] = index + offset
    max_ref[row, split] = m
    sumexp_ref[row, split] = s
    if kept_ref is not None:
      kept_ref[row, split] = counts[0]


def _counting_step(race: GumbelRace, x_floor):
  """``chunk_loop``'s step for ``(race state, kept)``: races a chunk and
  counts its entries ``> -inf`` (NaN is not counted); with ``x_floor``
  (``common.logit_floor``) only those with ``y >= floor``, the others
  raced and summed as -inf (NaN still races)."""

  def step(carry, chunk, x):
    state, kept = carry
    x = x.astype(jnp.float32)
    inside = x > -jnp.inf
    if x_floor is not None:
      below = common.below_floor(x, x_floor)
      inside = inside & ~below
      x = jnp.where(below, -jnp.inf, x)
    return race.chunk_step(state, chunk, x), kept + common.indicator(inside)

  return step


def gumbel_partials(logits: jax.Array, temperature: jax.Array,
                    streams: rng.RowStreams, config: SamplerConfig, *,
                    vocab_offset: jax.Array | int = 0,
                    active: jax.Array | None = None,
                    floor: jax.Array | None = None,
                    exclude: jax.Array | None = None,
                    count_finite: bool = False) -> GumbelPartials:
  """Runs the kernel: per-split partials for ``logits`` ``[B, V_local]``.

  ``temperature`` is canonical (0 = greedy); ``vocab_offset`` is the global id
  of local column 0 (vocab-parallel shards), a multiple of the RNG tile.
  ``active`` ``[B]`` bool: rows to sample (default all); the programs of the
  other rows return at once and their partials are undefined.  ``floor``
  ``[B]`` (sampled rows): race and sum only the elements with ``y >= floor``
  (the reference's ``y = x / T``), i.e. Gumbel-max on the kept set ``{y >=
  floor}`` of a truncated row, and count them (``kept``; a NaN entry races,
  as +inf, uncounted: its row is invalid).  ``exclude``
  ``[B]`` int32 (sampled rows): a local vocab id (-1: none) left out of the
  race, the sum-exp and ``kept``, i.e. read as -inf (speculative decoding's
  residual of a one-hot draft).
  ``count_finite`` (no ``floor``): ``kept`` counts the entries ``> -inf``
  (for the sampling masks of rows without a filter).
  """
  batch, vocab = logits.shape
  fp64 = config.use_fp64_gumbel
  tuned = tuning.resolve(config.tuning)
  plan = common.race_plan(batch, vocab, tuned.gumbel, tuned.occupancy,
                          generator=config.rng, fp64=fp64)
  shape = (batch, plan.num_splits)
  floored = floor is not None
  if floored and count_finite:
    raise ValueError("count_finite counts rows without a floor")
  counted = floored or count_finite
  out_shape = [
      jax.ShapeDtypeStruct(shape, jnp.uint32 if fp64 else jnp.float32),
      jax.ShapeDtypeStruct(shape, jnp.int32),
      jax.ShapeDtypeStruct(shape, jnp.float32),
      jax.ShapeDtypeStruct(shape, jnp.float32),
  ] + [jax.ShapeDtypeStruct(shape, jnp.int32)] * counted + [
      jax.ShapeDtypeStruct(shape, jnp.uint32)] * fp64
  kernel = functools.partial(_kernel, plan=plan, vocab=vocab,
                             generator=config.rng, fp64=fp64,
                             floored=floored, count_finite=count_finite,
                             excluding=exclude is not None,
                             masked=isinstance(logits, bitmask.MaskedLogits))
  call = common.pallas_call(kernel, out_shape=out_shape,
                            grid=(batch, plan.num_splits),
                            compiler_params=plan.compiler_params(),
                            interpret=plan.interpret,
                            name="jaxsample_gumbel_max")
  offset = jnp.asarray(vocab_offset, jnp.int32).reshape(1)
  table = _row_table(temperature, streams, active, [
      *([common.logit_floor(floor, temperature)] if floored else []),
      *([exclude.astype(jnp.int32)] if exclude is not None else [])])
  race, index, row_max, sumexp, *rest = call(table, offset,
                                              *bitmask.operands(logits))
  kept = rest.pop(0) if counted else None
  if fp64:
    race = common.join_fp64_words(race, rest[0])
  return GumbelPartials(race, index, row_max, sumexp, kept)


def _row_table(temperature, streams: rng.RowStreams, active, extra):
  """The kernel's ``[F, B]`` row table (``_ROW_DTYPES``, then ``extra``)."""
  batch = temperature.shape[0]
  active = jnp.ones((batch,), bool) if active is None else active
  return rowwise.pack_rows([
      temperature.astype(jnp.float32), active, streams.key0, streams.key1,
      streams.base_hi, streams.base_lo, *extra], batch)


def sample_untruncated(logits: jax.Array, params: SamplingParams,
                       streams: rng.RowStreams,
                       config: SamplerConfig, *,
                       active: jax.Array | None = None,
                       count_finite: bool = False):
  """Kernel sampling of every row as if no filter were on (of the ``active``
  rows only, when given: the results of other rows are undefined).

  Returns ``(SampleResult, row_max, lse)`` per row, and with
  ``count_finite`` the row's number of entries ``> -inf``.  Sampled rows:
  ``lse = logsumexp(y)`` (``y = x / T``) and ``row_max`` the row's best race
  value ``max(y + g)`` (not ``max(y)``; finite iff the row is valid).  Greedy
  rows: ``row_max = lse = max(x)``.
  """
  partials = gumbel_partials(logits, params.temperature, streams, config,
                             active=active, count_finite=count_finite)
  result, row_max, (shift, log_sum) = finish_sampling(logits, params, partials)
  return (result, row_max, shift + log_sum) + (
      (jnp.sum(partials.kept, axis=-1, dtype=jnp.int32),) if count_finite
      else ())


def finish_sampling(logits, params: SamplingParams, partials: GumbelPartials,
                    *, logit_at=None):
  """``(SampleResult, row_max, (shift, log_sum))`` of a row's partials
  (``combine_partials``), with the token's logprob under the raced set.
  ``logit_at(token)``: the logits ``[B]`` at the tokens, for rows that
  ``logits`` does not hold whole (vocab shards); by default read there."""
  token, row_max, (shift, log_sum) = combine_partials(partials)
  if logit_at is None:
    logit_at = lambda t: bitmask.logits_at(logits, t[:, None])[:, 0]
  x_token = reference.sanitize(logit_at(token))
  # The sum-exp approximates y against the race bound: at least the token's
  # term, so lse (the masks') and the logprob agree and logprob <= 0.
  lse = (shift, reference.holding_token(
      log_sum, reference.temper(x_token, params.temperature) - shift))
  result = reference.finalize(x_token, params, token, lse, row_max)
  return result, row_max, lse
