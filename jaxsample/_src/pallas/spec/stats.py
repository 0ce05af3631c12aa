"""Pass 1 of the draft-logits verifier: per-row max, argmax and sum-exp
partials of the target and draft rows, and their combine."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxsample._src import reference
from jaxsample._src.pallas import common, threshold
from jaxsample._src import tuning
from jaxsample._src.params import SamplerConfig

__all__ = ["combine_stats", "kernel_switch", "log_probs_at", "SlotStats",
           "stats_partials", "stats_plan"]

# ---------------------------------------------------------------------------
# Row reductions shared by both passes.
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Pass 1: statistics of the draft slots' target (and draft) rows.
# ---------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotStats:
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
  kmath = common.KernelMath(plan.interpret)
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
    m, arg = common.split_argmax(plan, kmath, split_start, vocab,
                                  target_load)
    write(m, arg, zero.astype(jnp.float32))

  def sampled(load):
    if floored:
      load = common.floored_loader(load, floor_ref[r])

    def branch():
      m, s = common.split_sumexp(plan, kmath, split_start, vocab, load, t)
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
  kernel_switch(kind, branches)


def kernel_switch(index, branches):
  """Runs ``branches[index]`` (side effects only).  ``lax.switch``'s index
  clamp does not compile in Triton (its ``maxsi`` mixes integer widths)."""
  for j, branch in enumerate(branches):
    pl.when(index == j)(branch)


def stats_plan(rows: int, vocab: int, config: SamplerConfig):
  """Launch plan of pass 1 (``tuning.SpecStatsLaunch``): loads of
  ``block_size`` elements, at most the vocabulary rounded up to a power of
  2, and no noise."""
  tuned = tuning.resolve(config.tuning)
  launch = tuned.spec_stats
  block = min(launch.block_size, max(16, 1 << (vocab - 1).bit_length()))
  return common.make_plan(rows, vocab, chunk=block, tile=block,
                          num_warps=launch.num_warps,
                          num_splits=launch.num_splits,
                          num_stages=launch.num_stages,
                          occupancy=tuned.occupancy)


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
  plan = stats_plan(rows, vocab, config)
  shape = (rows, plan.num_splits)
  kernel = functools.partial(_stats_kernel, plan=plan, k=k, batch=batch,
                             vocab=vocab, floored=kept is not None)
  call = common.pallas_call(
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
                  kept: threshold.KeptSets | None = None) -> SlotStats:
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
  # The row's y by the formula of every y (log_probs_at): y <= shift.
  shift = jnp.where(greedy, row_max,
                    reference.divide(row_max, jnp.where(greedy, 1.0, t)))
  log_sum = jnp.log(total)
  if kept is not None:
    shift = jnp.where(kept.measured, kept.row_max, shift)
    log_sum = jnp.where(kept.measured, kept.log_kept, log_sum)
  return SlotStats(row_max, arg, shift, log_sum, jnp.isfinite(shift))


def log_probs_at(x, stats_shift, stats_log_sum, temperature, floor=-jnp.inf):
  """``lt(v)`` of sampled valid rows from the sanitized logit ``x`` at ``v``:
  ``(y - shift) - log_sum`` with ``y = x / T``, -inf for a -inf logit or
  ``y`` below the kept set's ``floor`` (reference.log_probs); the
  normalizer holds ``v``'s own term (``reference.holding_token``), so the
  result is ``<= 0``."""
  t = jnp.where(temperature > 0, temperature, 1.0)
  y = reference.divide(x, t)
  gap = y - stats_shift
  return jnp.where((y > -jnp.inf) & (y >= floor),
                   gap - reference.holding_token(stats_log_sum, gap), -jnp.inf)
