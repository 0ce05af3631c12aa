"""Chi-square goodness-of-fit checks of sampled tokens, and the shared
statistical settings."""

from __future__ import annotations

import math
import statistics

import numpy as np


def chi2_critical(df: int, alpha: float) -> float:
  """Upper ``alpha`` critical value of chi-square(df), Wilson-Hilferty."""
  if df < 1:
    raise ValueError(f"df must be >= 1; got {df}")
  z = statistics.NormalDist().inv_cdf(1.0 - alpha)
  h = 2.0 / (9.0 * df)
  return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2_statistic(counts, probs, *, min_expected: float = 5.0):
  """Pearson chi-square of ``counts`` against ``probs`` (zero-prob bins must be
  empty), pooling bins with expected count below ``min_expected``.

  Returns ``(statistic, degrees_of_freedom)``.
  """
  counts = np.asarray(counts, np.float64)
  probs = np.asarray(probs, np.float64)
  n = counts.sum()
  support = probs > 0
  assert counts[~support].sum() == 0, "samples outside the support"
  counts, expected = counts[support], n * probs[support]
  # Pool the smallest bins together until the pooled bin expects enough.
  order = np.argsort(expected)
  counts, expected = counts[order], expected[order]
  if expected[0] < min_expected:
    cut = int(np.searchsorted(np.cumsum(expected), min_expected)) + 1
    cut = min(cut, len(expected))
    counts = np.append(counts[:cut].sum(), counts[cut:])
    expected = np.append(expected[:cut].sum(), expected[cut:])
  stat = float(np.sum((counts - expected) ** 2 / expected))
  return stat, len(expected) - 1


def assert_chi2_fits(tokens, probs, *, alpha: float = 1e-3):
  """Asserts sampled ``tokens`` fit ``probs`` by a chi-square test at ``alpha``."""
  tokens = np.asarray(tokens)
  probs = np.asarray(probs, np.float64)
  counts = np.bincount(tokens, minlength=probs.size)
  stat, df = chi2_statistic(counts, probs)
  if df == 0:  # a point mass: every sample must be that token
    assert np.all(probs[tokens] == 1.0)
    return
  crit = chi2_critical(df, alpha)
  assert stat <= crit, (f"chi-square {stat:.2f} > critical {crit:.2f} "
                        f"(df={df}, alpha={alpha}, n={tokens.size}); counts "
                        f"{counts.tolist()} vs expected "
                        f"{np.round(probs * tokens.size, 1).tolist()}")


def assert_binned_chi2_fits(tokens, probs, *, bins: int = 16,
                            alpha: float = 1e-3):
  """``assert_chi2_fits`` with the tokens grouped by descending probability
  into ``bins`` groups of about equal mass: for large supports, where most
  tokens expect a few draws, a distortion that moves mass between likely
  and unlikely tokens (a wrong temperature, a wrong normalizer) shows at far
  fewer draws than on the pooled per-token bins."""
  tokens = np.asarray(tokens)
  probs = np.asarray(probs, np.float64)
  assert probs[tokens].min() > 0, "samples outside the support"
  order = np.argsort(-probs, kind="stable")
  group = np.empty(probs.size, np.int64)
  group[order] = np.minimum((np.cumsum(probs[order]) - probs[order]) * bins,
                            bins - 1).astype(np.int64)
  assert_chi2_fits(group[tokens], np.bincount(group, probs, minlength=bins),
                   alpha=alpha)


# Shared statistical settings: one row of STAT_VOCAB tokens drawn STAT_DRAWS
# times per configuration (chi-square against the exact distribution).
STAT_VOCAB = 16
STAT_DRAWS = 4096
STAT_CONFIGS = {
    "plain": dict(temperature=1.0),
    "cold": dict(temperature=0.6),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.15),
    "combined": dict(temperature=1.4, top_k=10, top_p=0.9, min_p=0.02),
}
