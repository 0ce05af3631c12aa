"""Numpy float64 oracle of the kept set (reference.py docstring, step 4): an
independent re-implementation of the documented semantics (the
``jaxsample._src.reference`` and ``jaxsample._src.params`` docstrings); it never
calls the code under test."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


FP32_EPS = float(np.finfo(np.float32).eps)


@dataclasses.dataclass
class OracleKeep:
  """Oracle result for one row.

  kept: the kept set under exact float64 arithmetic.
  admissible: every kept set reachable when the min-p threshold or the top-p
    target ``p * sum e`` moves within the fp32 rounding margin (always
    contains ``kept``).  More than one entry means the row lies on a rounding boundary
    and fp32 arithmetic may legitimately land on an adjacent threshold.
  """

  kept: np.ndarray
  admissible: "UpwardSets"

  @property
  def near_boundary(self) -> bool:
    return len(self.admissible) > 1

  def admits(self, kept) -> bool:
    """Whether ``kept`` is one of the admissible sets."""
    return self.admissible.holds(np.asarray(kept, bool))

  def probs(self, y) -> np.ndarray:
    """The processed distribution: softmax of ``y`` on ``kept`` (float64)."""
    y = np.asarray(y, np.float64)
    z = np.where(self.kept, y, -np.inf)
    z = np.exp(z - z.max())
    return z / z.sum()


def _oracle_thresholds(ys_desc, finite_desc, k, p, t1, rtol):
  """Thresholds for sorted-descending float64 ``ys``: ``(exact, candidates)``.

  ``candidates`` are the thresholds whose top-p crossing mass lies within
  ``rtol * total`` of the target ``p * total`` (the exact one included).
  """
  ymax = ys_desc[0]
  surv1 = finite_desc & (ys_desc >= t1)
  n1 = int(surv1.sum())
  # top-k among min-p survivors: the k-th largest survivor (ties kept).
  kk = min(k, n1) if k > 0 else n1
  t2 = ys_desc[max(kk - 1, 0)]
  surv = finite_desc & (ys_desc >= t1) & (ys_desc >= t2)
  if p >= 1:
    t = max(t1, t2)
    return t, {t}
  e = np.where(surv, np.exp(ys_desc - ymax), 0.0)
  cum = np.cumsum(e)
  total = cum[-1]
  last = int(surv.sum()) - 1  # survivors are a prefix of the sorted row

  def crossing(target):
    reached = cum >= target
    # Past the total (only with a positive rounding shift): keep all survivors.
    return int(np.argmax(reached)) if reached.any() else last

  j = crossing(p * total)
  j_lo, j_hi = crossing((p - rtol) * total), crossing((p + rtol) * total)
  exact = max(t1, t2, ys_desc[j])
  return exact, {max(t1, t2, ys_desc[i]) for i in range(j_lo, j_hi + 1)}


def top_p_rtol(vocab: int) -> float:
  """The oracle's default top-p margin: ``FP32_EPS * (4 + log2(V) / 8)``
  relative to the survivors' mass (4.5 eps at V = 16, 5.2 at 1007, 6.2 at
  151936; ``oracle_keep`` says why)."""
  return FP32_EPS * (4 + math.log2(max(vocab, 2)) / 8)


def oracle_keep(y, top_k: int, top_p: float, min_p: float, *,
                rtol: float | None = None) -> OracleKeep:
  """Kept set of one row of tempered logits ``y`` per the documented rule.

  min-p (``y >= max + log(min_p)``), then top-k among the survivors (ties at
  the k-th value kept), then top-p on the distribution renormalised over the
  survivors (the crossing token kept), all in float64 on a sort.  Parameters
  take their documented "off" values: ``top_k <= 0`` or ``>= V``, ``top_p >=
  1``, ``min_p <= 0``; ``top_p <= 0`` and ``min_p > 1`` follow the canonical
  rules.  ``top_p`` and ``min_p`` are rounded to fp32 first (the sampler's
  parameter dtype).  ``rtol`` is the relative fp32 rounding margin of the
  top-p mass comparison: a row whose crossing mass lies within ``rtol *
  total`` of ``p * total`` is near a boundary and every threshold in that
  window is admissible.

  The default margin, ``top_p_rtol(V) = FP32_EPS * (4 + log2(V) / 8)``, is
  what the sampler's fp32 comparison ``mass(v) >= p * total`` can be off by,
  relative to ``total`` (all terms are positive, so every error is relative
  to it).  The XLA reference (``reference.keep_threshold``) compares a
  cumulative sum of the sorted ``exp(y - max)`` (XLA's ``reduce_window``
  scan) with ``p`` times its last entry; the kernels
  (``pallas/threshold.py``) compare per-candidate masses summed in slot
  order with a normalizer made of the stats pass's lane-wise sums (a tree
  over lanes and splits) and the candidates' sum (top-k rows: the
  candidates' alone; large kept sets: the window pass's sums, searched bit
  by bit).  The error has a part
  independent of ``V`` (the terms' ``exp``, 1-2 ulp each, the GPU's
  ``ex2.approx`` within 2^-22; the fp32 rounding of the two compared sums
  and of ``p * total``: about 2 eps together) and a summation part that grows
  with the depth of the sums, about ``log2(V)`` levels of which each adds
  rounding of random sign.  A worst-case bound (``log2(V) * eps`` for a
  tree, ``n * eps / 2`` for a sequential sum of ``n`` terms) exceeds ``1 -
  p`` for p = 0.999999 (8.5 eps) from V = 256 on, and would leave that p
  unchecked; measured errors are far smaller.  Measured (CPU, jax 0.11.2)
  in eps of the total: the reference's error at the crossing, over 4096 rows
  per kind (random, wide, unit normal, zipf, near-flat) and p in {0.5, 0.9,
  0.999999}: at most 3.0 at V = 16, 5.1 at 1007 (a wide row at p = 0.9,
  where a flip needs a boundary within that distance: no flip seen), 3.9 at
  151936 (160 rows per kind); crossings actually moved (the smallest
  ``rtol`` admitting the set kept) on thousands of rows whose ``p`` lies
  within 40 fp32 ulps of a boundary: reference at most 2.2 (V = 16, 1007,
  151936), kernels 2.2 (V = 16), 2.5 (1007), 2.4 (20000, window search),
  1.3 (151936); on ``oracle_grid`` at most 2.0.  The default is 2x the
  largest moved crossing and above every error seen at a crossing but one
  (5.1 at V = 1007 against 5.2), and below ``1 - p = 8.5 eps`` for p =
  0.999999, so rows whose crossing lies further than ``rtol`` from every
  boundary are checked exactly there too (``test_threshold``'s
  ``tail_rows``).  On a V = 151936 row of many small tokens a window of a
  few eps still spans several of them: such rows are near a boundary.
  """
  y = np.asarray(y, np.float64)
  vocab = y.size
  rtol = top_p_rtol(vocab) if rtol is None else rtol
  k = int(top_k) if 0 < int(top_k) < vocab else 0
  p = float(np.float32(top_p))
  m = float(np.float32(min_p))
  p = 1.0 if (math.isnan(p) or p >= 1) else max(p, 0.0)
  m = 0.0 if (math.isnan(m) or m <= 0) else min(m, 1.0)
  order = np.argsort(-y, kind="stable")
  ys = y[order]
  finite = ys > -np.inf
  ymax = ys[0]
  assert np.isfinite(ymax), "oracle_keep needs a valid row"
  t1 = ymax + math.log(m) if m > 0 else -np.inf
  # fp32 rounding of max + log(min_p): a few ulps of the operands.
  d1 = 0.0 if m in (0.0, 1.0) else 4 * FP32_EPS * (abs(ymax) + abs(math.log(m)))
  exact, _ = _oracle_thresholds(ys, finite, k, p, t1, rtol)
  thresholds = set()
  for s1 in (0.0, -d1, d1):
    thresholds |= _oracle_thresholds(ys, finite, k, p, t1 + s1, rtol)[1]
  kept = (y >= exact) & (y > -np.inf)
  # {y >= t} is fixed by its size: one set per distinct count (sets are built
  # on demand: a window near p = 1 may hold thousands).
  n_finite = int(finite.sum())
  counts = np.minimum(np.searchsorted(-ys, -np.fromiter(thresholds, float),
                                      side="right"), n_finite)
  first = int(kept.sum())
  others = sorted(set(counts.tolist()) - {first})
  return OracleKeep(kept, UpwardSets(y, ys, [first] + others))


class UpwardSets:
  """The upward-closed sets ``{y >= ys[n - 1]}`` (``ys`` = ``y`` sorted
  descending) for each kept count ``n`` of ``counts``, as a lazy sequence of
  boolean masks."""

  def __init__(self, y, ys, counts):
    self.y, self.ys, self.counts = y, ys, counts

  def __len__(self):
    return len(self.counts)

  def __getitem__(self, i):
    n = self.counts[i]
    if n == 0:
      return np.zeros(self.y.shape, bool)
    return (self.y >= self.ys[n - 1]) & (self.y > -np.inf)

  def __iter__(self):
    return (self[i] for i in range(len(self)))

  def holds(self, kept) -> bool:
    n = int(kept.sum())
    return n in self.counts and np.array_equal(
        kept, self[self.counts.index(n)])
