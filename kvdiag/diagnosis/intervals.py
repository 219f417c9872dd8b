"""Confidence intervals for the figures kvdiag measures on samples, and the verdict on a goal.

One definition, used by the report (how far a shadow figure can be trusted given how few steps
were sampled) and by the overhead benchmarks (is a 2% goal met, missed or not decided by the
data):

- :func:`cluster_bootstrap_mean`: the mean of values that come in clusters (the events of one
  sampled step are measured on the same KV and are not independent), with a 95% percentile
  bootstrap interval that resamples whole clusters;
- :func:`paired_ratio`: mean(a) / mean(b) of paired rounds (A and B measured back to back in
  each round), with a 95% bootstrap interval resampling rounds;
- :func:`paired_rate_ratio`: the same for rates, (sum of a's counts / sum of a's costs) over
  (the same for b), pairs resampled whole (blocks of engine steps of unequal size);
- :func:`goal_verdict`: ``met`` when the whole interval is on the goal's side, ``missed`` when it
  is wholly on the other side, else ``undecided``.

Resampling is seeded so that a figure does not change between two renderings of one log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000

Verdict = Literal["met", "missed", "undecided"]


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its 95% interval and the number of independent units behind it."""

    value: float
    lo: float
    hi: float
    n: int

    def __str__(self) -> str:
        return f"{self.value:.4g} [{self.lo:.4g}, {self.hi:.4g}] (n={self.n})"


def _percentiles(draws: np.ndarray) -> tuple[float, float]:
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(draws, [tail, 100 - tail])
    return float(lo), float(hi)


def cluster_bootstrap_mean(values, clusters, resamples: int = RESAMPLES, seed: int = 0) -> Estimate:
    """Mean of ``values`` with a 95% interval that resamples whole ``clusters`` (labels of the
    same length: e.g. the sampled step each value was measured on). ``n`` = clusters. NaNs are
    left out. With one cluster the interval is the point (nothing to resample)."""
    v = np.asarray(values, dtype=np.float64)
    c = np.asarray(clusters)
    keep = ~np.isnan(v)
    v, c = v[keep], c[keep]
    if len(v) == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    _, idx = np.unique(c, return_inverse=True)
    sums = np.bincount(idx, weights=v)
    counts = np.bincount(idx).astype(np.float64)
    value = float(sums.sum() / counts.sum())
    k = len(sums)
    if k < 2:
        return Estimate(value, value, value, k)
    pick = np.random.default_rng(seed).integers(0, k, size=(resamples, k))
    draws = sums[pick].sum(axis=1) / counts[pick].sum(axis=1)
    lo, hi = _percentiles(draws)
    return Estimate(value, lo, hi, k)


def paired_ratio(a, b, resamples: int = RESAMPLES, seed: int = 0) -> Estimate:
    """mean(a) / mean(b) over paired rounds (``a[i]`` and ``b[i]`` measured in round i), with a
    95% interval resampling rounds. ``n`` = rounds."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"paired_ratio needs two equal, non-empty 1-d samples, got {a.shape} and {b.shape}")
    value = float(a.mean() / b.mean())
    if len(a) < 2:
        return Estimate(value, value, value, len(a))
    pick = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
    lo, hi = _percentiles(a[pick].mean(axis=1) / b[pick].mean(axis=1))
    return Estimate(value, lo, hi, len(a))


def paired_rate_ratio(count_a, cost_a, count_b, cost_b, resamples: int = RESAMPLES, seed: int = 0) -> Estimate:
    """(sum(count_a) / sum(cost_a)) / (sum(count_b) / sum(cost_b)): e.g. tokens per CPU-second of
    condition a over condition b, where pair i holds a's and b's counts and costs measured side
    by side; 95% interval resampling pairs. ``n`` = pairs."""
    arrays = [np.asarray(v, dtype=np.float64) for v in (count_a, cost_a, count_b, cost_b)]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1 or len(arrays[0]) == 0:
        raise ValueError("paired_rate_ratio needs four equal, non-empty 1-d samples, got "
                         + ", ".join(str(a.shape) for a in arrays))

    def rate_ratio(na, ca, nb, cb, axis=None):
        return (na.sum(axis) / ca.sum(axis)) / (nb.sum(axis) / cb.sum(axis))

    value, n = float(rate_ratio(*arrays)), len(arrays[0])
    if n < 2:
        return Estimate(value, value, value, n)
    pick = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    lo, hi = _percentiles(rate_ratio(*(a[pick] for a in arrays), axis=1))
    return Estimate(value, lo, hi, n)


def goal_verdict(estimate: Estimate, goal: float, higher_is_better: bool = True) -> Verdict:
    """``met`` if the whole interval satisfies the goal, ``missed`` if none of it does."""
    lo, hi = (estimate.lo, estimate.hi) if higher_is_better else (-estimate.hi, -estimate.lo)
    g = goal if higher_is_better else -goal
    if lo >= g:
        return "met"
    if hi < g:
        return "missed"
    return "undecided"
