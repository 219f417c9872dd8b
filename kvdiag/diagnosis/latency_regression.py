"""P99 regressions of the latency series, on their sketches: per latency (TTFT, TPOT, engine
step), the buckets after its change point against those before, or the log against a baseline
log, compared by :func:`compare_sketches` (the bootstrap of
:func:`kvdiag.diagnosis.latency.compare` on sketch quantiles, within
:data:`kvdiag.diagnosis.sketch.ALPHA` relative of the exact ones). A flagged comparison carries
its candidate causes (:func:`kvdiag.diagnosis.causes.attribute`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from kvdiag.diagnosis.causes import attribute
from kvdiag.diagnosis.frames import Logs
from kvdiag.diagnosis.latency import (DEFAULT_THRESHOLD, METRICS, MIN_P99_SAMPLES, MIN_SAMPLES, QUANTILES,
                                      Comparison, Metric, Skipped, order_rank, fallback_quantile)
from kvdiag.diagnosis.rules import GROSS_SHIFT_THRESHOLD, REGRESSION_MIN_SAMPLES
from kvdiag.diagnosis.sketch import Sketch, SketchSeries

_P50_NEED = REGRESSION_MIN_SAMPLES[min(REGRESSION_MIN_SAMPLES)]  # the fewest any quantile needs


def detect(logs: Logs, baseline: Optional[Logs] = None, threshold: float = DEFAULT_THRESHOLD,
           metrics: tuple[Metric, ...] = METRICS, seed: int = 0) -> list[Comparison]:
    """The comparisons of :func:`detect_all` (metrics it had to skip are left out)."""
    return detect_all(logs, baseline, threshold, metrics, seed)[0]


def change_point_series(series: SketchSeries, min_size: int = MIN_SAMPLES) -> Optional[int]:
    """Pettitt's change point (:func:`kvdiag.diagnosis.latency.change_point`) of a latency series, on its bucket
    boundaries: the start time (ns) of the first bucket after the split that maximises
    |U| = |#(before > after) - #(before < after)| over pairs of samples (values in one sketch
    bin count as ties). None if no boundary leaves ``min_size`` samples on both sides."""
    starts, _, m = series.matrix()
    if len(starts) < 2:
        return None
    prefix = np.cumsum(m, axis=0)[:-1]  # before each boundary
    after = m.sum(axis=0)[None, :] - prefix
    n_before = prefix.sum(axis=1)
    n = int(m.sum())
    below = np.cumsum(after, axis=1) - after  # samples after the boundary in lower bins
    above = after.sum(axis=1)[:, None] - below - after
    u = np.abs((prefix * below).sum(axis=1) - (prefix * above).sum(axis=1)).astype("float64")
    ok = (n_before >= min_size) & (n - n_before >= min_size)
    if not ok.any():
        return None
    j = int(np.argmax(np.where(ok, u, -1.0)))
    return int(starts[j + 1])


def middle_split(series: SketchSeries) -> Optional[int]:
    """The bucket boundary nearest the middle sample (the halves of a series on bucket
    boundaries): the start time (ns) of the first bucket after it; None with one bucket."""
    keys = sorted(series.buckets)
    if len(keys) < 2:
        return None
    counts = np.cumsum([series.buckets[k].count for k in keys])[:-1]
    j = int(np.argmin(np.abs(counts - counts[-1] / 2 - series.buckets[keys[-1]].count / 2)))
    return int(keys[j + 1] * series.width_ns)


def cliffs_delta_sketch(baseline: Sketch, current: Sketch) -> float:
    """:func:`kvdiag.diagnosis.latency.cliffs_delta` over two sketches' bins (values in one bin count as ties)."""
    vb, cb = baseline.bins()
    vc, cc = current.bins()
    cum = np.r_[0, np.cumsum(cb)]
    below = cum[np.searchsorted(vb, vc, side="left")]
    above = cum[-1] - cum[np.searchsorted(vb, vc, side="right")]
    return float(((cc * below).sum() - (cc * above).sum()) / (baseline.count * current.count))


def compare_sketches(baseline: Sketch, current: Sketch, metric: str = "",
                     threshold: float = DEFAULT_THRESHOLD, conf: float = 0.90, n_boot: int = 4000,
                     seed: int = 0, q: float = 0.99) -> Optional[Comparison]:
    """:func:`kvdiag.diagnosis.latency.compare` on sketches: every quantile (the bootstrap's order statistics too) is the
    sketch's, within :data:`kvdiag.diagnosis.sketch.ALPHA` relative of the exact one."""
    need = REGRESSION_MIN_SAMPLES[q]
    if baseline.count < need or current.count < need:
        return None
    rng = np.random.default_rng(seed)

    def boot(sk: Sketch) -> np.ndarray:
        n = sk.count
        k = order_rank(n, q)
        u = rng.beta(k, n + 1 - k, size=n_boot)
        return sk.at_ranks(np.clip(np.ceil(u * n).astype(np.int64), 1, n))

    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = boot(current) / boot(baseline)
    alpha = (1 - conf) / 2
    lo, hi = np.quantile(ratio - 1, [alpha, 1 - alpha])
    qb = {x: baseline.quantile(x) for x in (*QUANTILES, q)}
    qc = {x: current.quantile(x) for x in (*QUANTILES, q)}
    with np.errstate(divide="ignore", invalid="ignore"):
        return Comparison(
            metric=metric, n_baseline=baseline.count, n_current=current.count,
            p99_baseline_ns=float(qb[0.99]), p99_current_ns=float(qc[0.99]),
            change=float(np.float64(qc[q]) / qb[q] - 1), ci_low=float(lo), ci_high=float(hi),
            threshold=threshold, flagged=bool(lo > threshold),
            cliffs_delta=cliffs_delta_sketch(baseline, current),
            p50_change=float(np.float64(qc[0.5]) / qb[0.5] - 1),
            p95_change=float(np.float64(qc[0.95]) / qb[0.95] - 1),
            quantile=q, q_baseline_ns=float(qb[q]), q_current_ns=float(qc[q]),
        )


def detect_all(logs: Logs, baseline: Optional[Logs] = None, threshold: float = DEFAULT_THRESHOLD,
               metrics: tuple[Metric, ...] = METRICS, seed: int = 0
               ) -> tuple[list[Comparison], list[Skipped]]:
    """One comparison per metric, over the latency series (:func:`kvdiag.diagnosis.latency_facts.series`:
    per-time-bucket sketches, the same fold in ``kvdiag top`` and the doctor): ``logs``
    against ``baseline`` when given, otherwise the buckets after the metric's change point
    (:func:`change_point_series`, on bucket boundaries) against those before (P99, at least
    ``MIN_P99_SAMPLES`` per side). With too few samples for P99 the comparison falls back to
    the highest quantile the counts allow (:func:`kvdiag.diagnosis.latency.fallback_quantile`) against
    ``rules.GROSS_SHIFT_THRESHOLD``, between the halves of the series (:func:`middle_split`)
    when there is no baseline; a metric with fewer still is returned as :class:`Skipped`.
    Quantiles are the sketches' (within ALPHA = 1% relative of the exact ones). Flagged
    comparisons carry their attributed causes."""
    from kvdiag.diagnosis.latency_facts import series as latency_series

    cur_all = latency_series(logs)
    base_all = latency_series(baseline) if baseline is not None else None
    out, skipped = [], []
    for metric in metrics:
        cur = cur_all[metric]
        w = (_against_baseline(metric, base_all[metric], cur, baseline, logs) if base_all is not None
             else _within_log(metric, cur, logs))
        if not isinstance(w, _Windows):
            skipped += [w] if w is not None else []
            continue
        cmp = compare_sketches(w.baseline, w.current, metric,
                               threshold=threshold if w.q == 0.99 else max(threshold, GROSS_SHIFT_THRESHOLD),
                               seed=seed, q=w.q)
        if cmp is None:
            skipped.append(Skipped(metric, min(w.baseline.count, w.current.count), REGRESSION_MIN_SAMPLES[w.q]))
            continue
        cmp.baseline_window_ns, cmp.current_window_ns = w.baseline_ns, w.current_ns
        cmp.method = w.method
        if cmp.flagged:
            if base_all is not None:
                cmp.causes = attribute(baseline, logs)
            else:  # cut only for a flagged comparison's causes
                cmp.causes = attribute(logs.window(*w.baseline_ns), logs.window(*w.current_ns))
        out.append(cmp)
    return out, skipped


@dataclass(frozen=True)
class _Windows:
    """What one metric's comparison compares: the two sketches, at quantile ``q``, over the
    windows ``baseline_ns`` and ``current_ns`` (``method`` says how they were chosen)."""

    baseline: Sketch
    current: Sketch
    q: float
    method: str
    baseline_ns: tuple
    current_ns: tuple


def _against_baseline(metric: str, base: SketchSeries, cur: SketchSeries, baseline: Logs,
                      logs: Logs) -> Union[_Windows, Skipped]:
    """The whole log against the whole baseline, at the highest quantile both sides' counts
    allow (:func:`kvdiag.diagnosis.latency.fallback_quantile`); :class:`Skipped` when they allow none."""
    b, c = base.total(), cur.total()
    q = fallback_quantile(min(b.count, c.count))
    if q is None:
        return Skipped(metric, min(b.count, c.count), _P50_NEED)
    return _Windows(b, c, q, "against the baseline", baseline.time_range_ns(), logs.time_range_ns())


def _within_log(metric: str, cur: SketchSeries, logs: Logs) -> Union[_Windows, Skipped, None]:
    """The buckets after the metric's change point against those before (P99, at least
    ``MIN_P99_SAMPLES`` per side), else the second half against the first at the highest
    quantile the halves allow; :class:`Skipped` when they allow none, None without samples."""
    split_ns = change_point_series(cur, MIN_P99_SAMPLES)
    q, method = 0.99, "after the change point vs before"
    if split_ns is not None:
        b, c = cur.total(end_ns=split_ns), cur.total(start_ns=split_ns)
    else:  # too few for P99 on both sides of a change point: halves
        split_ns, method = middle_split(cur), "second half vs first half"
        n = cur.count
        if split_ns is None:
            q = None
        else:
            b, c = cur.total(end_ns=split_ns), cur.total(start_ns=split_ns)
            q = fallback_quantile(min(b.count, c.count))
        if q is None:
            return Skipped(metric, n, 2 * _P50_NEED) if n else None
    t0, t1 = logs.time_range_ns()
    return _Windows(b, c, q, method, (t0, split_ns), (split_ns, t1 + 1))
