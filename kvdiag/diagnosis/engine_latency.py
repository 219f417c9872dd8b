"""Latency percentiles from the engine's own Prometheus histograms (``EngineMetrics.histograms``).

``histogram_quantile`` is PromQL's ``histogram_quantile`` over classic buckets (Prometheus
``promql/quantile.go``, ``bucketQuantile``): with cumulative counts ``c_i`` at upper bounds
``le_i`` (sorted, equal bounds merged, counts made non-decreasing, the last bound +Inf) and
``n = c_last``, the rank is ``r = q n`` and the bucket is the first ``i`` with ``c_i >= r``; the
quantile is ``le_(i-1) + (le_i - le_(i-1)) (r - c_(i-1)) / (c_i - c_(i-1))`` (linear within the
bucket, ``le_(-1) = 0`` and ``c_(-1) = 0``). Past the last finite bound it is that bound; in a
first bucket whose bound is <= 0 it is that bound; NaN without +Inf bucket, with fewer than two
buckets or no observations; -Inf for q < 0 and +Inf for q > 1.

``engine_latency_frame`` takes, for each node, the bucket increases between consecutive scrapes
(PromQL's ``increase`` without extrapolation) and their P50 and P99.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis.frames import Logs
from kvdiag.events.schema import EngineMetrics

LATENCIES = {"ttft": "ttft_s", "inter_token": "inter_token_s", "e2e": "e2e_s", "queue": "queue_s"}
"""Column prefix -> ``EngineMetrics.histograms`` key."""
QUANTILES = (0.5, 0.99)
REQUESTS_FROM = "e2e_s"  # a request is counted when it finishes


def _normalize(bounds: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bounds sorted and unique (``INF_LE`` read as +Inf), ``counts`` (rows x bounds) merged
    alike: equal bounds add up."""
    bounds = np.where(bounds >= EngineMetrics.INF_LE, np.inf, bounds.astype("float64"))
    order = np.argsort(bounds, kind="stable")
    bounds, counts = bounds[order], counts[:, order]
    first = np.r_[True, bounds[1:] != bounds[:-1]]
    starts = np.flatnonzero(first)
    return bounds[starts], np.add.reduceat(counts, starts, axis=1) if counts.shape[1] else counts


def _quantile_rows(q: float, bounds: np.ndarray, cum: np.ndarray) -> np.ndarray:
    """``histogram_quantile(q, ...)`` of each row of cumulative counts ``cum`` over normalized
    ``bounds``."""
    out = np.full(cum.shape[0], np.nan)
    if math.isnan(q):
        return out
    if q < 0 or q > 1:
        return np.full(cum.shape[0], -np.inf if q < 0 else np.inf)
    if len(bounds) < 2 or not np.isposinf(bounds[-1]):
        return out
    cum = np.maximum.accumulate(cum, axis=1)  # Prometheus's ensureMonotonic
    total = cum[:, -1]
    rank = q * total
    reached = cum[:, :-1] >= rank[:, None]
    b = np.where(reached.any(axis=1), reached.argmax(axis=1), len(bounds) - 1)
    rows, prev = np.arange(cum.shape[0]), np.maximum(b - 1, 0)
    below = np.where(b > 0, cum[rows, prev], 0.0)
    start = np.where(b > 0, bounds[prev], 0.0)
    end = bounds[np.minimum(b, len(bounds) - 2)]  # the +Inf bucket is replaced below
    with np.errstate(invalid="ignore", divide="ignore"):
        val = start + (end - start) * (rank - below) / (cum[rows, b] - below)
    val = np.where(b == len(bounds) - 1, bounds[-2], val)  # in the +Inf bucket
    val = np.where((b == 0) & (bounds[0] <= 0), bounds[0], val)
    return np.where(total > 0, val, np.nan)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """The q-quantile (0-1) of a classic Prometheus histogram given as cumulative ``(le, count)``
    buckets in any order, as PromQL's ``histogram_quantile`` computes it (module docstring).
    +Inf may be given as ``math.inf`` or ``EngineMetrics.INF_LE``."""
    pairs = list(buckets)
    if not pairs:
        return math.nan
    bounds = np.array([le for le, _ in pairs], dtype="float64")
    counts = np.array([[c for _, c in pairs]], dtype="float64")
    return float(_quantile_rows(q, *_normalize(bounds, counts))[0])


def _interval_quantiles(hists: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """For one histogram over consecutive scrapes: per interval k (scrape k to k + 1), the
    ``QUANTILES`` of its bucket increases (rows x quantiles) and its count increase. Unknown
    (NaN) when the histogram is missing from either scrape. Counts that fell at any bound, or
    changed bounds, mean the engine restarted: the interval counts from zero (its increase is
    the later scrape's counts), never negative."""
    n = len(hists) - 1
    qs, count = np.full((n, len(QUANTILES)), np.nan), np.full(n, np.nan)
    layouts = [tuple(le for le, _ in h.get(key, ())) for h in hists]  # () where absent
    for layout in set(layouts) - {()}:
        rows = np.flatnonzero([lay == layout for lay in layouts])
        bounds, cum = _normalize(np.array(layout, dtype="float64"),
                                 np.array([[c for _, c in hists[r][key]] for r in rows], dtype="float64"))
        later = rows >= 1
        ends, cur = rows[later], cum[later]
        known = np.array([layouts[r - 1] != () for r in ends], dtype=bool)
        pos = np.searchsorted(rows, ends - 1)
        same = (pos < len(rows)) & (rows[np.minimum(pos, len(rows) - 1)] == ends - 1)
        diff = cur - cum[np.minimum(pos, len(rows) - 1)]
        steady = same & np.all(diff >= 0, axis=1)
        inc = np.where(steady[:, None], diff, cur)
        ends, inc = ends[known], inc[known]
        for j, q in enumerate(QUANTILES):
            qs[ends - 1, j] = _quantile_rows(q, bounds, inc)
        if len(bounds) and np.isposinf(bounds[-1]):
            count[ends - 1] = inc[:, -1]
    return qs, count


def engine_latency_frame(logs: Logs) -> Optional[pd.DataFrame]:
    """Engine-reported latency per scrape interval and node: ``start_ns``, ``ts_ns`` (the
    interval's scrapes), ``node``, ``requests`` (requests finished in the interval: the
    increase of the end-to-end histogram's count) and ``<latency>_p50_s``, ``<latency>_p99_s``
    for ttft, inter_token, e2e and queue: :func:`histogram_quantile` of the interval's bucket
    increases, NaN when the interval has no observation of it. None when the log holds no
    engine histograms."""
    em = logs.frame(EngineMetrics)
    if em.empty or "histograms" not in em.columns:
        return None
    has = em["histograms"].map(lambda h: isinstance(h, dict) and bool(h))
    if not has.any():
        return None
    em = em[has].sort_values("ts_ns", kind="stable")
    cols = ["start_ns", "ts_ns", "node", "requests"] + [
        f"{name}_p{q * 100:g}_s" for name in LATENCIES for q in QUANTILES]
    parts = []
    for node, g in em.groupby("node", sort=False):
        if len(g) < 2:
            continue
        ts = g["ts_ns"].to_numpy(dtype="int64")
        hists = list(g["histograms"])
        df = pd.DataFrame({"start_ns": ts[:-1], "ts_ns": ts[1:], "node": node, "requests": np.nan})
        for name, key in LATENCIES.items():
            qs, count = _interval_quantiles(hists, key)
            for j, q in enumerate(QUANTILES):
                df[f"{name}_p{q * 100:g}_s"] = qs[:, j]
            if key == REQUESTS_FROM:
                df["requests"] = count
        parts.append(df[cols])
    if not parts:
        return pd.DataFrame(columns=cols)
    return pd.concat(parts, ignore_index=True).sort_values("ts_ns", kind="stable", ignore_index=True)
