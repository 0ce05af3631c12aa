"""``jaxsample.sample``: one public entry point, backends behind a small dispatch."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Literal, overload

import jax
import jax.numpy as jnp

from jaxsample import mask, processors as processing, reference, rng, rowwise
from jaxsample import xla_search
from jaxsample.params import SamplerConfig, SamplingParams, as_config
from jaxsample.reference import SampleResult


def check_logits(logits, params: SamplingParams) -> SamplingParams:
  """``params`` as ``[B]`` arrays (``SamplingParams.rows``) for logits
  ``[B, V]``; raises ``ValueError`` for logits that are not ``[B, V]``
  floats or params that do not fit them."""
  if logits.ndim != 2:
    raise ValueError(f"logits must be [B, V]; got shape {logits.shape}")
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"logits must be floating point; got {logits.dtype}")
  if logits.shape[1] == 0:
    raise ValueError("logits must have a non-empty vocabulary (V >= 1)")
  return SamplingParams.rows(params, logits.shape[0])


def backend(config: SamplerConfig) -> str:
  """The backend ``config.implementation`` selects here: ``"pallas"``,
  ``"xla_search"`` or ``"xla"`` (``"auto"``: the kernels on GPU, else the
  sorting-free XLA path)."""
  if config.implementation == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla_search"
  return config.implementation


def use_pallas(config: SamplerConfig) -> bool:
  """Whether ``config.implementation`` selects the Pallas kernels here."""
  return backend(config) == "pallas"


def x64_scope(enabled: bool, *arrays):
  """Scoped x64 for the FP64 Gumbel path; a no-op otherwise.

  JAX lowers a jitted function after tracing it, outside any scope entered
  during the trace, so under an outer ``jit`` the caller must hold the scope
  for the whole call: ``with jax.enable_x64(True): jitted(...)``.
  """
  if not enabled:
    return contextlib.nullcontext()
  traced = any(isinstance(a, jax.core.Tracer) for a in arrays)
  if traced and not jax.config.read("jax_enable_x64"):
    raise ValueError(
        "use_fp64_gumbel=True under jax.jit needs x64 while the jitted "
        "function is traced and compiled: call it inside "
        "`with jax.enable_x64(True):` (eager calls enable it themselves)")
  return jax.enable_x64(True)


@overload
def sample(logits: jax.Array, params: SamplingParams, key: jax.Array, *,
           positions: jax.Array | None = None,
           config: SamplerConfig | str | None = None,
           return_mask: Literal[False] = False,
           processors: processing.LogitsProcessors | None = None
           ) -> SampleResult:
  ...


@overload
def sample(logits: jax.Array, params: SamplingParams, key: jax.Array, *,
           positions: jax.Array | None = None,
           config: SamplerConfig | str | None = None,
           return_mask: Literal[True],
           processors: processing.LogitsProcessors | None = None
           ) -> tuple[SampleResult, mask.SamplingMask]:
  ...


def sample(logits: jax.Array,
           params: SamplingParams,
           key: jax.Array,
           *,
           positions: jax.Array | None = None,
           config: SamplerConfig | str | None = None,
           return_mask: bool = False,
           processors: processing.LogitsProcessors | None = None
           ) -> SampleResult | tuple[SampleResult, mask.SamplingMask]:
  """Samples one token per row of ``logits`` ``[B, V]``.

  Equivalent to the reference in ``jaxsample.reference``: temperature, then
  min-p, top-k and top-p (upward-closed kept sets, ties kept), then Gumbel-max
  over the kept set; greedy rows (T = 0) take the argmax.

  Args:
    logits: ``[B, V]`` fp32, bf16 or fp16 logits (read in their own dtype).
    params: per-request ``SamplingParams`` (scalar fields apply to every
      row: ``SamplingParams.rows``); out-of-range traced values follow
      ``SamplingParams.canonical``.
    key: one key for the batch (noise counter = flat index ``b * V + v``;
      pass a fresh key every step), or ``[B]`` keys, one per request (noise
      depends on the request's key, position and ``v`` only).  Typed keys
      (any ``jax.random`` implementation: keys that are not 2 words are
      hashed to 2, ``rng.key_words``) or raw uint32 key data.
    positions: ``[B]`` integer positions, required with per-request keys
      and only then: the request's token position (e.g. its sequence
      length so far), which a decode loop advances every step so every step
      draws fresh noise.  Concrete negative positions raise; traced ones
      count modulo 2^32.
    config: static ``SamplerConfig``, or an implementation name (``"xla"``,
      ``"pallas"``, ``"auto"``) for the default config with it.  Hashable:
      ``jax.jit(sample, static_argnames=("config", "return_mask"))``.  With
      ``use_fp64_gumbel`` inside your
      own ``jax.jit``, call the jitted function under
      ``with jax.enable_x64(True):`` (a clear error says so otherwise).
    return_mask: static; also return the ``SamplingMask`` of the kept sets the
      tokens were drawn from (``jaxsample.mask``; ``config.max_mask_ids``
      wide; a valid row's token is always listed, ``mask.with_token``), built from the same kept set as the tokens: the XLA path's
      ``reference.process``, or on the kernel path the truncation kernels'
      candidate buffer and threshold (the XLA path's kept set except where
      a top-p crossing lies within fp32 rounding of ``p``; ``logz``/``lse``
      within a few fp32 ulps: another summation order, and on a GPU
      ``exp`` by ``ex2.approx`` of ``x * (1 / T)``).

  Returns:
    ``SampleResult`` with ``tokens`` ``[B]`` int32 (always in ``[0, V)``),
    ``logprobs`` ``[B]`` fp32 under the processed distribution and ``valid``
    ``[B]`` (False for rows with NaN, +inf or no finite logit); with
    ``return_mask``, the pair ``(SampleResult, SamplingMask)``.
  """
  config = as_config(config)
  logits = jnp.asarray(logits)
  params = check_logits(logits, params)
  logits = processing.maybe_apply(logits, processors)
  batch, vocab = logits.shape
  streams, _ = rng.row_streams(key, positions, batch, vocab)
  with jax.ensure_compile_time_eval():  # concrete params stay concrete
    params = params.canonical(vocab)
  if batch == 0:
    result = SampleResult(jnp.zeros((0,), jnp.int32),
                          jnp.zeros((0,), jnp.float32), jnp.zeros((0,), bool))
    if not return_mask:
      return result
    return result, mask.extract_sampling_mask(logits, params, config=config)
  with x64_scope(config.use_fp64_gumbel, logits, key, positions,
                 *jax.tree.leaves(params)):
    if use_pallas(config):
      out = _sample_pallas(logits, params, streams, config, return_mask)
      result, result_mask = out if return_mask else (out, None)
    else:
      result, result_mask = _sample_xla(logits, params, streams, config,
                                        return_mask)
  if not return_mask:
    return result
  # Valid rows' tokens are in their kept sets: listed even on overflow.
  return result, mask.with_token(result_mask, result.tokens, result.valid)


def _sample_xla(logits, params: SamplingParams, streams: rng.RowStreams,
                config: SamplerConfig, return_mask: bool):
  """The XLA paths, sort-based (``"xla"``) or not (``"xla_search"``):
  ``(SampleResult, mask or None)``."""
  order_width = config.max_mask_ids * return_mask
  if backend(config) == "xla_search":
    result, proc = xla_search.sample(
        logits, params, streams, generator=config.rng,
        fp64=config.use_fp64_gumbel, order_width=order_width)
  else:
    proc = reference.process(logits, params, order_width=order_width)
    result = reference.sample_reference(
        logits, params, streams, generator=config.rng,
        fp64=config.use_fp64_gumbel, proc=proc)
  if not return_mask:
    return result, None
  return result, mask.from_processed(proc, params, config.max_mask_ids)


# The kernel path's mask is assembled once, from per-row facts: ``mask.
# assemble``'s keyword arguments but ``valid``, ``greedy``, ``token`` (the
# route's ``SampleResult``) and ``max_ids`` (``width`` = K_cap, or 0 without
# a mask: then the facts are None).


def _untruncated_rows(logits, params: SamplingParams, streams: rng.RowStreams,
                      config: SamplerConfig, width: int, active=None):
  """``(SampleResult, facts)`` of ``active`` rows raced with no filter
  (``gumbel.sample_untruncated``): their kept set is every finite entry."""
  from jaxsample.pallas import gumbel  # pylint: disable=g-import-not-at-top
  result, row_max, lse, *finite = gumbel.sample_untruncated(
      logits, params, streams, config, active=active, count_finite=bool(width))
  return result, dict(
      count=finite[0], finite=finite[0], logz=jnp.zeros_like(lse), lse=lse,
      row_max=row_max,
      ordered_ids=jnp.zeros((logits.shape[0], width), jnp.int32)
  ) if width else None


def _kept_facts(count, log_kept, ordered_ids, rows, width: int):
  """Facts of kept sets ``ordered_ids``; ``rows`` (a ``Truncation`` or
  ``KeptSets``) gives each row's ``finite``, ``row_max`` and ``lse``."""
  if not width:
    return None
  return dict(count=count, finite=rows.finite,
              logz=(rows.row_max + log_kept) - rows.lse, lse=rows.lse,
              row_max=rows.row_max, ordered_ids=ordered_ids)


def _choose(where, a, b, width: int):
  """Per row, route ``a``'s or ``b``'s ``(SampleResult, facts)``."""
  if not width:
    return rowwise.where_rows(where, a[0], b[0]), None
  pad = lambda ids: jnp.pad(ids, ((0, 0), (0, width - ids.shape[1])),
                            constant_values=-1)
  a, b = ((r, dict(f, ordered_ids=pad(f["ordered_ids"]))) for r, f in (a, b))
  return rowwise.where_rows(where, a, b)


def _with_mask(result, facts, params: SamplingParams, width: int):
  """``(result, mask)``: one ``mask.assemble`` of ``facts``, or ``(result,
  None)`` without a mask."""
  if not width:
    return result, None
  return result, mask.assemble(valid=result.valid,
                               greedy=params.temperature == 0,
                               token=result.tokens, max_ids=width, **facts)


def kept_set_masks(logits, params: SamplingParams, sets,
                   config: SamplerConfig) -> mask.SamplingMask:
  """The masks of ``logits`` ``[B, V]`` under canonical ``params`` from
  their kept sets ``sets``, each measured (``threshold.kept_sets(logits,
  params, config, order_width=config.max_mask_ids, measure_all=True)``'s,
  in 32 bits), equal to ``sample``'s (``logz``/``lse`` up to fp32
  rounding).  Rows without a kept set (threshold -inf: greedy, no filter,
  invalid) take the Gumbel kernel.  ``extract_sampling_mask``'s kernel path
  and the spec sampler's masks (its ``kept_floors`` found the sets)."""
  width = config.max_mask_ids
  config = dataclasses.replace(config, use_fp64_gumbel=False)
  zeros = jnp.zeros((logits.shape[0],), jnp.uint32)
  streams = rng.RowStreams(*(zeros,) * 4)
  kept = sets.threshold > -jnp.inf
  with jax.enable_x64(False):
    facts = _kept_facts(sets.count, sets.log_kept, sets.ordered_ids, sets,
                        width)
    return _with_mask(*_choose(
        kept, (SampleResult(zeros.astype(jnp.int32),
                            jnp.zeros(zeros.shape, jnp.float32), kept), facts),
        _untruncated_rows(logits, params, streams, config, width, ~kept),
        width), params, width)[1]


def extract_pallas(logits, params: SamplingParams,
                   config: SamplerConfig) -> mask.SamplingMask:
  """``extract_sampling_mask``'s kernel path (canonical ``params``, ``B >=
  1``): the kept sets with their ids by probability and every set measured
  (``threshold.kept_sets``), then ``kept_set_masks``; no race.  Params
  known while tracing to truncate no row compile the Gumbel kernel alone
  (as ``sample``)."""
  from jaxsample.pallas import threshold  # pylint: disable=g-import-not-at-top
  with jax.ensure_compile_time_eval():  # known for concrete params
    truncating = jnp.any(params.truncates() & (params.temperature > 0))
  width = config.max_mask_ids
  kept = lambda: threshold.kept_sets(logits, params, config,
                                     order_width=width, measure_all=True)
  sets = rowwise.cond(truncating, kept, lambda: threshold.untruncated_sets(
      logits.shape[:1], width), unknown=kept)
  return kept_set_masks(logits, params, sets, config)


def _sample_pallas(logits, params: SamplingParams, streams: rng.RowStreams,
                   config: SamplerConfig, return_mask: bool):
  """The kernel path (``sample``'s result, with the mask if asked).

  A batch without truncating rows runs the Gumbel kernel alone.  Otherwise
  each row takes its route, and every route's kernels skip the rows of the
  others: the truncation kernels (``jaxsample.pallas.threshold``) sample the
  truncating rows; the Gumbel kernel rows with no filter (greedy rows
  included) and invalid rows; and one branch, taken only when some row
  needs it (``lax.cond``), rows with large kept sets or overflowed
  candidate buffers (``threshold.sample_large``, with their masks; inside
  it only the mask listing's fallback conds).  Where the caller's ``jit``
  closes over the params, a batch without truncating rows compiles the
  Gumbel route alone (``rowwise.cond``); traced params run every route
  rather than a cond on the batch.  A ``lax.cond`` costs every step the
  trip of its predicate (6-10 us of a decode loop's step on an H100,
  ``scripts/measure_host_gaps.py``): less than running the large-set route
  idle; a cond on the batch would save steps without filters about what it
  would cost filtered ones (``benchmarks/results/2026-11-24-idle-skips``).

  The FP64 path finds every kept set's threshold (``threshold.kept_sets``;
  with a mask, also the kept ids by probability) and races the kept set with
  FP64 noise (one more pass, which also counts the set and sums its mass).
  No path sorts the vocabulary.
  """
  from jaxsample.pallas import threshold  # pylint: disable=g-import-not-at-top
  with jax.ensure_compile_time_eval():  # known for concrete params
    truncating = params.truncates() & (params.temperature > 0)
    any_truncating = jnp.any(truncating)
  width = config.max_mask_ids if return_mask else 0
  untruncated_rows = functools.partial(_untruncated_rows, logits, params,
                                       streams, config, width)

  def floored_fp64_batch():
    """FP64 noise: the kept sets (with their ids by probability, for the
    mask), then one FP64 race per row, which also counts the kept set and
    sums its mass."""
    sets = threshold.kept_sets(logits, params, config, order_width=width)
    floor = sets.threshold
    floored = floor > -jnp.inf  # a threshold of -inf keeps every finite y
    result, count, log_kept = threshold.floored_race(
        logits, params, streams, config, floored, floor, sets.row_max)
    return _choose(floored, (result, _kept_facts(
        count, log_kept, sets.ordered_ids, sets, width)),
                   untruncated_rows(~floored), width)

  def any_batch():
    """Every row, by its route (rows skip the kernels of other routes)."""
    trunc = threshold.sample_truncated(
        logits, params, streams, config, order_width=width,
        finish_large=False)
    done = trunc.complete
    rows = (SampleResult(trunc.token, trunc.logprob, done),
            _kept_facts(trunc.count, trunc.log_kept, trunc.ordered_ids, trunc,
                        width))
    # invalid rows: the argmax, as without a filter
    plain = ~truncating | ~jnp.isfinite(trunc.row_max)
    unfinished = trunc.unfinished(params)

    # The one cond: idle, this route's kernels and XLA glue cost more than
    # the cond (scripts/measure_host_gaps.py).
    token, logprob, _, _, count, log_kept, *ordered = rowwise.only_if(
        unfinished, lambda: threshold.sample_large(
            logits, params, trunc, streams, config, unfinished,
            order_width=width))
    large = (SampleResult(token, logprob, unfinished),
             _kept_facts(count, log_kept, ordered[0] if ordered else None,
                         trunc, width))
    return _choose(done, rows, _choose(unfinished, large,
                                       untruncated_rows(plain), width), width)

  # Params known while tracing (closed over by the caller's jit) compile
  # one route; otherwise every route's kernels run, skipping the rows of
  # other routes, rather than a cond on the batch (the FP64 path: a cond).
  if config.use_fp64_gumbel:
    routes = rowwise.cond(any_truncating, floored_fp64_batch,
                          untruncated_rows)
  else:
    routes = rowwise.cond(any_truncating, any_batch, untruncated_rows,
                          unknown=any_batch)
  result, result_mask = _with_mask(*routes, params, width)
  return (result, result_mask) if return_mask else result
