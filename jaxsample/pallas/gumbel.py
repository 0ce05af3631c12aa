"""Gumbel-max sampling kernel: logits ``[B, V]`` to tokens in one pass over HBM.

Per row ``b`` and vocab split ``s`` (grid ``(B, S)``), one program streams its
split chunk by chunk and keeps, lane-wise:

* the running argmax of ``x / T + g`` (``g`` the Gumbel noise of
  ``jaxsample.rng`` for the global vocab ids: the reference's noise), behind a
  cheap filter that skips the exact arithmetic for chunks that cannot win
  (``GumbelRace``), and
* the running ``sum exp(x / T - bound)`` (one exp per element),

then writes per-split partials.  ``combine_partials`` merges partials along
the split axis, by a max and a rescaled sum; the vocab-parallel sampler merges
partials of vocab shards the same way.  Greedy rows (T = 0) run a branch with
no noise and no exp.  Equivalent to ``jaxsample.reference.sample_reference``
for untruncated rows: the same tokens bit for bit, and logprobs within 1e-5
plus a few ulp of the row's largest tempered logit (the sum-exp uses
``x * (1 / T)``, within ~1 ulp of the reference's ``x / T``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsample import reference, rng
from jaxsample.pallas import common
from jaxsample.params import SamplerConfig, SamplingParams
from jaxsample.reference import SampleResult


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GumbelPartials:
  """Per-split partial results, each ``[B, S]``.

  Attributes:
    race: best ``y + g`` of the split (fp64 on the FP64 path; the kernel
      returns fp64 as two uint32 words, see ``_split_words``).
    index: its global vocab id (smallest on ties).
    max: the split's reference for ``sumexp``: its best race value in fp32
      (the max of ``x`` for greedy rows); finite iff the split's tempered
      logits have a finite max.
    sumexp: ``sum exp(y - max)`` over the split.
  """

  race: jax.Array
  index: jax.Array
  max: jax.Array
  sumexp: jax.Array


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
  """Exact Gumbel-max race over chunks, with a cheap filter in front.

  The state is lane-wise ``(best, index)``, the program-wide best race value
  ``bound`` and lane-wise ``sumexp = sum exp(y - bound)``.  For each chunk a
  conservative test proves most elements cannot reach ``bound``: with
  ``E = -log(u) >= 1 - u``, ``y + g = y - log(E) < bound`` whenever
  ``(1 - u) * (1 - slack) > exp(y' - bound)`` (``1 - u`` from the uniform's
  top 23 bits, less 2^-23 on the fp64 path), where ``y' = x * (1 / T)``
  approximates ``y`` and ``slack = 2^-12 (|bound| + 32)`` covers every
  approximation error (``y'``, ``ex2.approx``, the rounding of the exact
  race).  Only chunks with a possible winner compute the exact race
  ``x / T + g`` (IEEE division, accurate logs: the reference's arithmetic), so
  tokens are the reference's bit for bit; the filter's exponential is also the
  sum-exp term, one exp per element.  Elements below the bound by more than
  ~30 are always proven losers; ``|bound| >= 4064`` disables it (still exact).
  """

  math: common.KernelMath
  t: jax.Array
  race_dtype: jnp.dtype

  def init(self, first_index):
    n = first_index.shape[0]
    return (jnp.full((n,), -jnp.inf, self.race_dtype), first_index,
            jnp.full((), -jnp.inf, self.race_dtype), jnp.zeros((n,), jnp.float32))

  def _exp_below(self, x, bound32):
    """``exp(x * (1 / T) - bound)`` to ~6e-8 |x / T| (FFMA, FMUL, ex2)."""
    return self.math.exp2_approx((x * (1.0 / self.t) - bound32) * _LOG2E)

  def step(self, state, chunk: common.Chunk, x):
    best, index, bound, sumexp = state
    x = x.astype(jnp.float32)
    wide = isinstance(chunk.bits, tuple)
    bits = chunk.bits[0] if wide else chunk.bits
    one_minus_u = 2.0 - lax.bitcast_convert_type(
        (bits >> jnp.uint32(9)) | jnp.uint32(0x3F800000), jnp.float32)
    if wide:  # The high word fixes an fp64 uniform only to within 2^-23.
      one_minus_u = one_minus_u - 2.0**-23
    bound32 = bound.astype(jnp.float32)
    e = self._exp_below(x, bound32)
    margin = 1.0 - _SLACK * (jnp.abs(bound32) + 32.0)
    # NaN-safe: a NaN anywhere makes the element a possible winner.
    loses = one_minus_u * margin > e
    maybe = jnp.max(jnp.where(loses, 0, 1)) > 0

    def exact(_):
      xs = jnp.where(x != x, jnp.inf, x)
      race = self.math.div(xs, self.t).astype(self.race_dtype) + rng.gumbel(
          rng.uniform(chunk.bits))
      new_best, new_index = common.argmax_update(best, index, race, chunk.index)
      new_bound = jnp.maximum(bound, jnp.max(race))
      new_bound32 = new_bound.astype(jnp.float32)
      # A scalar: plain exp (inline asm only takes blocks).
      scale = jnp.where(new_bound32 == bound32, 1.0,
                        jnp.exp(bound32 - new_bound32))
      e_new = jnp.where(x == -jnp.inf, 0.0, self._exp_below(x, new_bound32))
      return new_best, new_index, new_bound, sumexp * scale + e_new

    def fast(_):
      return best, index, bound, sumexp + e

    return lax.cond(maybe, exact, fast, None)

  def finish(self, state):
    """``(race, index, reference, sumexp)`` of the program: its best race value
    and id, and ``sumexp = sum exp(y - reference)`` with ``reference`` the
    fp32 best race value (any finite reference combines exactly)."""
    best, index, bound, sumexp = state
    top, index = common.argmax_finish(best, index)
    return top, index, bound.astype(jnp.float32), jnp.sum(sumexp)


def _kernel(temp_ref, key0_ref, key1_ref, base_hi_ref, base_lo_ref,
            offset_ref, x_ref, race_ref, index_ref, max_ref, sumexp_ref,
            *race_lo_ref, plan: common.KernelPlan, vocab: int, generator: str,
            fp64: bool):
  row, split = pl.program_id(0), pl.program_id(1)
  math = common.KernelMath(plan.interpret)
  split_start = split * plan.split_len
  offset = offset_ref[0]
  t = temp_ref[row]
  race_dtype = jnp.float64 if fp64 else jnp.float32
  lanes = jnp.arange(plan.chunk, dtype=jnp.int32)
  first_index = split_start + lanes  # all -inf rows report the first id

  load = common.row_chunk_loader(x_ref, row, plan.chunk)

  def greedy():
    def step(carry, chunk, x):
      x = x.astype(jnp.float32)
      return common.argmax_update(*carry, jnp.where(x != x, jnp.inf, x),
                                  chunk.index)

    init = (jnp.full((plan.chunk,), -jnp.inf, jnp.float32), first_index)
    best, index = common.chunk_loop(plan, math, split_start, vocab, load, step,
                                    init)
    top, index = common.argmax_finish(best, index)
    # Greedy rows need no sum-exp; it is a computed 1 because Triton's cond
    # lowering cannot yield a literal.
    one = (index - index + 1).astype(jnp.float32)
    return top.astype(race_dtype), index, top, one

  def sampled():
    stream = rng.RowStreams(key0_ref[row], key1_ref[row], base_hi_ref[row],
                            base_lo_ref[row])
    race = GumbelRace(math, t, race_dtype)
    noise = common.Noise(generator, stream, offset, wide=fp64)
    state = common.chunk_loop(plan, math, split_start, vocab, load, race.step,
                              race.init(first_index), noise=noise)
    return race.finish(state)

  top, index, m, s = lax.cond(t > 0, sampled, greedy)
  if fp64:
    race_ref[row, split], race_lo_ref[0][row, split] = _split_words(top)
  else:
    race_ref[row, split] = top
  index_ref[row, split] = index + offset
  max_ref[row, split] = m
  sumexp_ref[row, split] = s


def _split_words(value: jax.Array):
  """fp64 scalar as (high, low) uint32 words.

  A 64-bit kernel output would be narrowed when an outer ``jit`` lowers the
  kernel outside the x64 scope; 32-bit words cross the boundary intact.
  """
  bits = lax.bitcast_convert_type(value, jnp.uint64)
  return ((bits >> jnp.uint64(32)).astype(jnp.uint32),
          (bits & jnp.uint64(0xFFFFFFFF)).astype(jnp.uint32))


def _join_words(hi: jax.Array, lo: jax.Array) -> jax.Array:
  bits = (hi.astype(jnp.uint64) << jnp.uint64(32)) | lo.astype(jnp.uint64)
  return lax.bitcast_convert_type(bits, jnp.float64)


def gumbel_partials(logits: jax.Array, temperature: jax.Array,
                    streams: rng.RowStreams, config: SamplerConfig, *,
                    vocab_offset: jax.Array | int = 0) -> GumbelPartials:
  """Runs the kernel: per-split partials for ``logits`` ``[B, V_local]``.

  ``temperature`` is canonical (0 = greedy); ``vocab_offset`` is the global id
  of local column 0 (vocab-parallel shards), a multiple of the RNG tile.
  """
  batch, vocab = logits.shape
  fp64 = config.use_fp64_gumbel
  plan = common.make_plan(batch, vocab, logits.dtype, config,
                          generator=config.rng)
  shape = (batch, plan.num_splits)
  out_shape = [
      jax.ShapeDtypeStruct(shape, jnp.uint32 if fp64 else jnp.float32),
      jax.ShapeDtypeStruct(shape, jnp.int32),
      jax.ShapeDtypeStruct(shape, jnp.float32),
      jax.ShapeDtypeStruct(shape, jnp.float32),
  ] + [jax.ShapeDtypeStruct(shape, jnp.uint32)] * fp64
  kernel = functools.partial(_kernel, plan=plan, vocab=vocab,
                             generator=config.rng, fp64=fp64)
  call = pl.pallas_call(kernel, out_shape=out_shape,
                        grid=(batch, plan.num_splits),
                        compiler_params=plan.compiler_params(),
                        interpret=plan.interpret, name="jaxsample_gumbel_max")
  offset = jnp.asarray(vocab_offset, jnp.int32).reshape(1)
  race, index, row_max, sumexp, *race_lo = call(
      temperature.astype(jnp.float32), streams.key0, streams.key1,
      streams.base_hi, streams.base_lo, offset, logits)
  if fp64:
    race = _join_words(race, race_lo[0])
  return GumbelPartials(race, index, row_max, sumexp)


def sample_untruncated(logits: jax.Array, params: SamplingParams,
                       streams: rng.RowStreams,
                       config: SamplerConfig):
  """Kernel sampling of every row as if no filter were on.

  Returns ``(SampleResult, row_max, lse)``: ``row_max = max(y)`` and ``lse =
  logsumexp(y)`` of each row (``y = x / T``; ``y = x`` on greedy rows).
  """
  partials = gumbel_partials(logits, params.temperature, streams, config)
  token, row_max, lse = combine_partials(partials)
  x_token = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
  result = reference.finalize(reference.sanitize(x_token), params, token, lse,
                              row_max)
  return result, row_max, lse[0] + lse[1]
