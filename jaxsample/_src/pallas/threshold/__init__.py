"""Sorting-free truncated sampling: exact top-k / top-p / min-p kept sets.

Design (the pass count is bounded: two passes over each truncating row and
one small selection over a bounded candidate buffer; rows whose kept set
does not fit the buffer are reported ``complete = False`` and finished by
``sample_large``: window searches, then at most ``_PIVOT_PASSES`` passes of
the pivot search per threshold no window holds; no sort anywhere):

1. ``stats`` pass (grid ``(B, S)``): per vocab split, the max of the
   sanitized logits ``x``, ``sum exp(y - max)`` (``y = x / T``), the count of
   finite entries and *segment maxima*: the max of ``x`` over each segment of
   contiguous ids (about ``_SEGMENTS_PER_ROW`` per row, ``segment_size``).
   The segment maxima are actual row elements, so every bound computed from
   them is conservative: the ``k``-th largest segment maximum is ``<=`` the
   row's ``k``-th largest value, and a value whose segment-maxima mass already
   reaches ``p * Z`` is ``<=`` the top-p threshold.  Rows that may keep a
   large set also write their *sample*, every ``SAMPLE_STRIDE``-th ``x``,
   from the same loads.
2. ``bound`` select (grid ``(B,)``) combines the splits' stats (row max,
   mass, ``t1``) and, on the segment maxima, gives a per-row lower bound
   ``L <= max(t1, t2, t3)`` of the kept set's threshold, so the kept set is
   contained in the *candidates* ``{y >= L}``: one bit-by-bit search over
   the order keys of the segment maxima, for ``t2`` when top-k is on, else
   for ``t3``, stopped after 20 bits (the bound rounds down).  It also lists
   the segments whose maximum reaches ``L``: every candidate lies in one.
3. ``compact`` pass (grid ``(B, S)``): every candidate is written with its
   vocab id to the split's slice of a candidate buffer, in vocab order (a
   cheap filter admits a few elements just below ``L``, dropped afterwards).
   A row with at most ``_LIST_CAP`` listed segments reads only those (a few
   percent of the row for top-k 50) when its outside mass is not needed: top-k
   on, ``L = t1``, or min-p off (outside mass = the row's mass less the
   candidates').  Other rows read the whole row and also sum the mass of the
   min-p survivors below ``L`` (top-p's normalizer when top-k is off).  The
   candidates' Gumbel noise is then drawn for their ids alone
   (``rng.bits_at``), so no RNG runs over the row.
4. ``select`` on the candidates (final mode) finds the exact thresholds by
   comparing each candidate with every min-p survivor among the ``n`` filled
   slots (no sort, no search; ``n x pow2ceil(n)`` comparisons): the ``k``-th
   largest survivor (``t2``) and the largest value whose upper mass reaches
   ``p`` times the survivors' mass (``t3``), then the kept count and mass;
   the same counts give each kept id its position in descending order (the
   sampling mask).  The token is the largest race value among kept
   candidates (smallest id on ties: the buffer is in vocab order).

Large kept sets (rows with ``k > C / 2``, and rows without top-k whose
sample, every ``SAMPLE_STRIDE``-th logit written by the stats pass, puts
more than ``C / 2`` candidates above ``L``; ``sample_large``): min-p alone keeps
``{y >= t1}``.  Top-k and top-p thresholds each come from a window search:
``threshold_window`` places a window ``[lower, upper)`` of sample ranks
around the threshold estimated from the sample; the compact pass, windowed,
writes the window's elements and sums the count and mass above and the mass
below it; a bound-mode search over the window finds the exact threshold
bit by bit, from the high key bits the window's ends share (top-k first;
top-p then searches above ``max(t1, t2)``).  Then
the Gumbel kernel with a ``floor`` races the kept set and counts it.  Three
passes over the row (stats, windowed compact, Gumbel), four with top-k and
top-p both on; a window that missed the threshold or overflowed its buffer
(rows whose ties span the window, and the rare rows whose sample misleads
the estimate by more than 5 standard deviations) leaves the threshold to
``pivot_threshold``: at most ``_PIVOT_PASSES`` passes, each splitting the
order-key interval that holds it at ``_PIVOTS`` pivots, in one kernel (one
program per row; rows without a miss skip it, so no ``lax.cond`` guards
any of these searches).  The window search
also measures the kept mass (the spec sampler's normalizer).  The sampling
mask of a large kept set (``large_kept_ids``) rides on launches the row
runs anyway: a mask of ``K_cap <= C / 2`` ids on the narrow pass, which
takes large rows as top-k = ``K_cap`` rows (the bound select searches their
``K_cap``-th largest segment maximum and writes the pass's param table), so
its candidate buffer lists their ``K_cap`` largest values by rank; a wider
mask on the row's first window search: its window kernel also places a
listing window by count (the ``K_cap``-th largest value's, with no upper
end) and its compact pass also fills the listing's buffer, from the same loads; a search by count in
that buffer finds the ``K_cap``-th largest value and the ids are sorted as
``[B, K_cap]`` pairs.  No pass or window kernel of its own.

Every partial result is a max, a sum or a list of candidates in vocab order,
so the vocab-parallel sampler combines shards exactly as it combines splits:
a max/sum of the stats, one candidate buffer per shard concatenated in shard
order.

Arithmetic: ``y`` and the race are the reference's bit for bit (XLA's division,
the same noise), so ``t1``, ``t2``, ties and tokens match exactly.  Masses are
fp32 sums in a different order than the reference's sorted cumsum: a row whose
top-p crossing lies within fp32 rounding of ``p`` times its mass may keep an
adjacent threshold (tests treat such rows with the oracle's admissible sets).

Modules, by stage: ``base`` (the pass plan, the param table, constants the
stages share), ``search`` (the key-bit searches over a small buffer),
``stats`` (pass 1 and the bound select), ``select`` (the exact threshold
over a candidate buffer), ``window`` (large kept sets: the window from the
sample), ``candidates`` (pass 2: compact and pack), ``pivot`` (the
fixed-pass search) and ``route`` (the sampler and the kept sets: the stages
in order).
"""

from __future__ import annotations

from jaxsample._src.pallas.threshold.stats import (RowBounds, StatsPartials,
                                              row_bounds)
from jaxsample._src.pallas.threshold.select import select_threshold
from jaxsample._src.pallas.threshold.window import threshold_window
from jaxsample._src.pallas.threshold.candidates import (Candidates, Listing,
                                                   Segments, collect_candidates)
from jaxsample._src.pallas.threshold.pivot import pivot_threshold
from jaxsample._src.pallas.threshold.route import (KeptSets, Truncation,
                                              floored_race, large_kept_ids,
                                              large_thresholds, listing_width,
                                              sample_large, sample_truncated,
                                              untruncated_sets)

__all__ = [
    "StatsPartials",
    "RowBounds",
    "row_bounds",
    "select_threshold",
    "threshold_window",
    "Segments",
    "Candidates",
    "Listing",
    "collect_candidates",
    "pivot_threshold",
    "Truncation",
    "sample_truncated",
    "KeptSets",
    "untruncated_sets",
    "large_thresholds",
    "listing_width",
    "sample_large",
    "floored_race",
    "large_kept_ids",
]
