"""Fused rejection sampling for speculative decoding: one pass over the
target logits for one-hot drafts, two with draft logits.

Implements ``jaxsample._src.spec.rejection_sample`` (its module doc is the spec).
Everything stays on the device: no host sync, no sort, no full softmax in
HBM.

Truncation: in a batch where some sampled request has a filter on, the
threshold kernels first find the kept set ``{y >= floor}`` of every target
row at a slot ``<= n_b`` and draft row at a slot ``< n_b``
(``backends.pallas.kept_floors``: the threshold kernels, two to four
passes over each such row, more for rows whose ties fill the candidate buffer); the passes
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
(``spec_reference.accepted_count``) and picks slot ``j``'s race.  Reads:
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

from jaxsample._src.pallas.spec.stats import (SlotStats, combine_stats,
                                         log_probs_at, stats_partials,
                                         stats_plan)
from jaxsample._src.pallas.spec.emit import (EmitRequest, GREEDY, RACE, RESIDUAL,
                                        SKIP, emit_partials)
from jaxsample._src.pallas.spec.reject import KeptFloors, reject

__all__ = [
    "SlotStats",
    "stats_plan",
    "stats_partials",
    "combine_stats",
    "log_probs_at",
    "SKIP",
    "GREEDY",
    "RACE",
    "RESIDUAL",
    "EmitRequest",
    "emit_partials",
    "KeptFloors",
    "reject",
]
