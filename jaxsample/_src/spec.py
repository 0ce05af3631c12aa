"""Speculative-decoding rejection sampling (pure-JAX reference).

``rejection_sample`` verifies ``k`` draft tokens per request against the target
model's logits and emits between 1 and ``k + 1`` tokens per request.  The XLA
function here is the definition; the fused Pallas kernels
(``jaxsample._src.pallas.spec``, ``implementation="pallas"``, or ``"auto"`` on a
GPU) match it, with the kept sets of truncating requests (top-k / top-p /
min-p) from the sorting-free threshold kernels.

Notation (request ``b``)
------------------------
``n = clip(num_draft_b, 0, k)`` drafts are real (slots ``>= n`` are padding),
``d_i = clip(draft_tokens_{b,i}, 0, V - 1)``, ``p = positions_b``.  Target row
``i`` (``0 <= i <= k``) and draft row ``i`` (``i < k``) are processed exactly
like plain sampling with the request's params (``reference.process``:
sanitize, temperature, min-p, top-k, top-p, in fp32 whatever the input dtype),
all ``2k + 1`` rows of a request in one batch, so equal target and draft rows
give equal bits; ``lt_i = log q_t,i`` and ``ld_i = log q_d,i`` are their
processed log-probabilities (``reference.log_probs``: ``(y - shift) -
log_sum`` on the kept set, -inf outside).  Without ``draft_logits``, and for a
draft row that is invalid (NaN, +inf, no finite entry, tempered overflow), the
draft is one-hot: ``ld_i(d_i) = 0`` and -inf elsewhere (n-gram drafters; the
theorem holds for any choice of ``d_i``).

Acceptance of slot ``i < n`` (``accept_i``):

* invalid target row ``i``: rejected, in every mode;
* greedy rows (T = 0): ``d_i == argmax(y_t,i)`` (smallest index on ties);
* sampled rows: ``log(u_i) < r_i`` in fp32 with ``r_i = lt_i(d_i) -
  ld_i(d_i)`` if ``ld_i(d_i) > -inf`` and ``r_i = -inf`` otherwise, i.e.
  accept iff ``u_i < q_t(d_i) / q_d(d_i)``; a token the draft distribution
  gives no mass is rejected (as vLLM does), and ``q_t == q_d`` always accepts
  (``r_i = 0 > log u_i``);
* synthetic mode (``synthetic_rates`` given), every valid row, greedy too:
  ``u_i < rate_i`` in fp32.  Everything else is computed as in the standard
  mode (so a kernel's run time matches).

``num_accepted = j``, the number of leading accepted slots (``0 <= j <= n``).
The token emitted at slot ``j`` is drawn from target row ``j`` with Gumbel
noise ``g`` of position ``p + j`` (see Randomness):

* ``j < n`` (rejection), sampled valid row: Gumbel-max on the residual
  ``res ∝ max(q_t,j - q_d,j, 0)``: ``token = argmax_v(w_v + g_v)`` with
  ``w_v = y_v + log1p(-exp(ld_v - lt_v))`` where ``ld_v < lt_v`` and -inf
  elsewhere (``residual_logits``; fp32, then widened to the noise dtype: with
  ``use_fp64_gumbel`` the sum with ``g`` is fp64 as in the reference).  ``w_v
  = log res_v + logsumexp_K(y)``, the residual's log-density up to a constant,
  so the argmax is the residual's Gumbel-max; for a one-hot draft ``w_v = y_v``
  exactly (``v != d_j``): the plain race with ``d_j`` left out, no normalizer
  needed.  If the residual has zero mass (every ``w_v = -inf``, e.g. ``q_t ==
  q_d`` and ``d_j`` outside the kept set) the draw falls back to the target
  distribution, as below.
* otherwise (``j == n``: the bonus token; greedy rows; invalid target row
  ``j``; zero residual): the plain reference sampler's token for target row
  ``j`` with that noise: ``argmax_{K}(y + g)``, ``argmax(y)`` for greedy and
  invalid rows.  This equals ``jaxsample.sample(target_logits[:, j], params,
  noise_keys, positions=p + j)`` (``noise_keys`` from ``stream_keys``).

Outputs: ``tokens[b] = [d_0 .. d_{j-1}, token, -1, ..]`` (``[B, k + 1]``
int32, ``j + 1`` tokens emitted); ``logprobs[b, i] = lt_i(tokens[b, i])`` for
``i <= j``, the log-probability under the processed target distribution (0 for
a greedy row's argmax, -inf for an invalid row, -inf for a synthetic-mode
accepted token outside the target's kept set) and 0 for the padding slots
``i > j`` (so ``logprobs.sum(-1)`` is the log-probability of the emitted
tokens).  With an invalid target row at ``j`` the request emits that row's
reference token (its first NaN/+inf index, or 0) with logprob -inf and stops;
invalid rows after the stop are never read.

With ``return_mask``, also a ``SamplingMask`` (``jaxsample._src.mask``) with a
leading token axis: fields ``[k + 1, B, ...]``, ``ids`` ``[k + 1, B, K_cap]``
(``K_cap = SamplerConfig.max_mask_ids``).  Slot ``i <= j`` of request ``b``
(an emitted token) holds the mask of target row ``i``, row ``b`` of
``extract_sampling_mask(target_logits[:, i], params, config=config)``: the
kept set ``tokens[b, i]`` was scored in, with the token listed
(``sampling_mask.with_token``: on overflow, in the last slot if not among
the first ``K_cap``).  A valid row's token lies in it, with ``logprobs[b, i]
= y_t - lse - logz`` at the token ``t`` (0 for greedy rows), except a
synthetic-mode accepted draft outside it (logprob -inf, not listed).
Slots ``i > j`` are blank, defined like an invalid row's mask: ``ids`` all
-1, ``count`` 0, ``truncated`` True, ``overflow`` False, ``logz = lse =
-inf``; ``to_json(num_tokens=num_accepted + 1)`` lists the emitted slots
alone.

Randomness
----------
Request keys: the ``b``-th of ``[B]`` per-request keys, or
``fold_in(key, b)`` for one batch key.  Each request key ``r_b`` gives two
purpose keys, ``noise_b = fold_in(r_b, 0)`` and ``accept_b = fold_in(r_b, 1)``
(``jax.random.fold_in`` on the key data wrapped as a threefry2x32 key, so typed
keys and their raw uint32 data agree; ``stream_keys`` returns both as raw
``[B, 2]`` uint32).  Both feed ``jaxsample._src.rng`` per-request streams with
``SamplerConfig.rng`` as generator (counter base ``(p + i) mod 2^32`` in the
high word):

* ``u_i = rng.uniform(bits)`` (fp32 in ``[2^-126, 1)``, also with
  ``use_fp64_gumbel``), ``bits`` = the 32 bits of vocab index 0 of the stream
  ``(accept_b, position p + i)`` (``rng.tile_bits(.., tile_start=0,
  lanes=0)``, first chunk), for ``0 <= i < k``;
* ``g = rng.gumbel_noise`` of the stream ``(noise_b, position p + j)`` over the
  vocabulary (only the emission slot ``j`` draws noise).

With per-request keys a request's outputs depend only on its own inputs, key
and position, never on the batch's size, order or other requests (XLA:CPU may
round reductions differently in the last ulp between compiled programs; the
tests compare logprobs across programs to 1e-5).

Bad input: shape / dtype errors raise ``ValueError`` (as do concrete
``num_draft`` outside ``[0, k]``, concrete draft tokens outside ``[0, V)``,
per-request keys without ``positions`` and concrete negative positions);
under ``jit`` ``num_draft`` and draft tokens are clamped as above.  ``B = 0`` returns empty outputs.
"""

from __future__ import annotations

import functools
from typing import Literal, overload

import jax
import jax.numpy as jnp

from jaxsample._src import (backends, dispatch, mask, rng, sampling,
                            spec_reference)
from jaxsample._src.parallel.batch import (explicit_axes, manual_rows,
                                           over_batch_shards)
from jaxsample._src.parallel.vocab import (rejection_sample_sharded,
                                           vocab_mesh_call)
from jaxsample._src.params import SamplerConfig, SamplingParams, as_config
from jaxsample._src.processors import LogitsProcessors, apply_to_slots
from jaxsample._src.sampling_mask import SamplingMask
from jaxsample._src.spec_reference import (SpecResult, check_inputs,
                                           request_keys, stream_keys,
                                           without_drafts)

__all__ = ["SpecResult", "check_inputs", "rejection_sample", "stream_keys"]


@overload
def rejection_sample(target_logits: jax.Array, draft_tokens: jax.Array,
                     num_draft: jax.Array, params: SamplingParams,
                     key: jax.Array, *, draft_logits: jax.Array | None = None,
                     synthetic_rates: jax.Array | None = None,
                     positions: jax.Array | None = None,
                     config: SamplerConfig | str | None = None,
                     return_mask: Literal[False] = False,
                     processors: LogitsProcessors | None = None) -> SpecResult:
  ...


@overload
def rejection_sample(target_logits: jax.Array, draft_tokens: jax.Array,
                     num_draft: jax.Array, params: SamplingParams,
                     key: jax.Array, *, draft_logits: jax.Array | None = None,
                     synthetic_rates: jax.Array | None = None,
                     positions: jax.Array | None = None,
                     config: SamplerConfig | str | None = None,
                     return_mask: Literal[True],
                     processors: LogitsProcessors | None = None
                     ) -> tuple[SpecResult, SamplingMask]:
  ...


def rejection_sample(target_logits: jax.Array,
                     draft_tokens: jax.Array,
                     num_draft: jax.Array,
                     params: SamplingParams,
                     key: jax.Array,
                     *,
                     draft_logits: jax.Array | None = None,
                     synthetic_rates: jax.Array | None = None,
                     positions: jax.Array | None = None,
                     config: SamplerConfig | str | None = None,
                     return_mask: bool = False,
                     processors: LogitsProcessors | None = None
                     ) -> SpecResult | tuple[SpecResult, SamplingMask]:
  """Verifies draft tokens against the target model (module doc: exact math).

  Args:
    target_logits: ``[B, k + 1, V]`` fp32/bf16/fp16 target logits; row ``i``
      scores the token at sequence position ``positions + i``.
    draft_tokens: ``[B, k]`` integer draft tokens in ``[0, V)`` (padding
      slots too; ``ValueError`` when concrete, clamped under ``jit``).
    num_draft: ``[B]`` integer count of real drafts per request (``[0, k]``;
      clamped under ``jit``, ``ValueError`` when concrete).
    params: per-request ``SamplingParams`` (canonicalized), used for both the
      target and the draft distributions.
    key: one key for the batch (request ``b`` uses ``fold_in(key, b)``) or
      ``[B]`` per-request keys; typed keys or raw uint32 key data.
    draft_logits: ``[B, k, V]`` draft-model logits, or None for one-hot drafts.
    synthetic_rates: ``[k]`` per-slot conditional acceptance probabilities
      (benchmarking), or None for real verification.
    positions: ``[B]`` integer sequence position of the first draft token;
      it sets the random stream's counters.  Required with per-request keys
      (a decode loop advances it by ``num_accepted + 1``); default 0 with
      one batch key (then pass a fresh key every step).  Concrete negative
      positions raise; traced ones count modulo 2^32.
    config: static ``SamplerConfig`` (or an implementation name, as
      ``jaxsample.sample``); ``rng`` picks the generator and
      ``use_fp64_gumbel`` the fp64 Gumbel race.  ``implementation``: "xla"
      runs this reference, "pallas" the fused kernels (interpret mode off
      GPU), after the threshold kernels' kept sets in a batch where some
      sampled request truncates (a ``lax.cond`` with traced params; none
      where the caller's ``jit`` closes over them), "xla_search" this
      reference with the kept sets found without a sort
      (``xla_search.process``), "auto" the kernels on GPU and
      "xla_search" elsewhere.
      ``config.tuning``'s ``spec_stats`` and ``spec_emit`` launch the two
      kernel passes (``jaxsample._src.tuning``).
    return_mask: static; also return the ``SamplingMask`` of every slot
      (module doc, Outputs; ``[k + 1, B, ...]``, ``config.max_mask_ids``
      wide): target row ``i``'s mask for the emitted slots ``i <=
      num_accepted``, blank past them.  The XLA path builds it from the
      processing it verifies with; the kernel path from the kept sets its
      threshold kernels found (``backends.pallas.kept_floors``, which also orders the
      target rows' kept ids and measures every target kept set), with the
      Gumbel kernel over the target rows without one
      (``backends.pallas.kept_set_masks``).

    processors: per-request ``LogitsProcessors``, applied to every target
      and draft row first (``processors.apply_to_slots``: slot ``i``'s
      history includes drafts ``0 .. i - 1``).

  Returns:
    ``SpecResult``; with ``return_mask``, the pair ``(SpecResult,
    SamplingMask)``.
  """
  config = as_config(config)
  arrays = [jnp.asarray(a) if a is not None else None
            for a in (target_logits, draft_tokens, num_draft, draft_logits,
                      synthetic_rates, positions)]
  target_logits, draft_tokens, num_draft, draft_logits, synthetic_rates, \
      positions = arrays
  check_inputs(target_logits, draft_tokens, num_draft, params, draft_logits,
               synthetic_rates, positions)
  if explicit_axes(target_logits, 2):  # vocab-sharded under jit
    return vocab_mesh_call(
        functools.partial(rejection_sample_sharded, config=config,
                          return_mask=return_mask),
        split=dict(target_logits=target_logits, draft_logits=draft_logits),
        rows=dict(draft_tokens=draft_tokens, num_draft=num_draft,
                  params=SamplingParams.rows(params, target_logits.shape[0])),
        keys=dict(key=key, positions=positions),
        whole=dict(synthetic_rates=synthetic_rates), processors=processors,
        out_batch_dims=(0, 1) if return_mask else 0)
  target_logits, draft_logits = apply_to_slots(processors, target_logits,
                                               draft_tokens, draft_logits)
  batch, k1, vocab = target_logits.shape
  params = SamplingParams.rows(params, batch)
  if rng.key_words(key).ndim == 2 or positions is not None:
    positions = rng.check_positions(positions, batch)
  if batch == 0:
    stream_keys(key, 0)  # validates the key
    result = SpecResult(jnp.zeros((0, k1), jnp.int32),
                        jnp.zeros((0,), jnp.int32),
                        jnp.zeros((0, k1), jnp.float32))
    if not return_mask:
      return result
    rows = mask.extract_sampling_mask(target_logits.reshape(0, vocab), params,
                                      config=config)
    return result, spec_reference.slot_masks(rows, result.num_accepted, k1)
  if positions is None:
    positions = jnp.zeros((batch,), jnp.int32)
  n = jnp.clip(num_draft, 0, k1 - 1).astype(jnp.int32)
  with jax.ensure_compile_time_eval():  # concrete params stay concrete
    params = params.canonical(vocab)
  # Per-request keys from here on: a batch shard's requests keep theirs.
  key = request_keys(key, batch, manual_rows(target_logits, batch)[1])
  if k1 == 1:
    return without_drafts(functools.partial(sampling.sample, config=config),
                          target_logits, params, key, positions, return_mask)
  with dispatch.x64_scope(config.use_fp64_gumbel, target_logits, key,
                          positions, *jax.tree.leaves(params)):
    result, rows = over_batch_shards(
        backends.backend(config).verify_rows,
        (target_logits, draft_tokens, n, params, key, positions,
         draft_logits), (synthetic_rates,), config=config,
        static=(return_mask,))
  if not return_mask:
    return result
  return result, spec_reference.emitted_masks(result, rows)

