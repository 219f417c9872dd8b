"""Latency distributions, their percentiles with bootstrap intervals, and P99 regressions.

Three latencies are measured (all in nanoseconds):

- ``ttft``: time to first token of a request, first token - arrival (``ttft_ns``).
- ``per_token``: a request's mean inter-token time, ``(e2e_ns - ttft_ns) / (output_tokens - 1)``
  (requests with at least 2 output tokens).
- ``step``: the duration of one engine forward pass (``EngineStep.duration_ns``).

Quantiles use the inverse empirical CDF (numpy's ``inverted_cdf``): the q-quantile of n sorted
samples is the k-th smallest with ``k = ceil(q n)``. Its bootstrap distribution is sampled
exactly without resampling the data: in a resample of n draws the k-th smallest index is
``ceil(n U)`` with ``U ~ Beta(k, n + 1 - k)`` (the k-th order statistic of n uniforms).

A regression is the relative change of P99, ``P99_current / P99_baseline - 1``; it is flagged
when its confidence interval lies wholly above the threshold (default +10%): the interval is
the two-sided 90% bootstrap interval, so its lower end is a one-sided 95% lower bound (only
rises matter). A latency with too few samples for a P99 comparison
(:data:`kvdiag.diagnosis.rules.REGRESSION_MIN_SAMPLES`) is compared at P90, else P50, between
the halves of the log (or against the baseline) and flagged only past
:data:`kvdiag.diagnosis.rules.GROSS_SHIFT_THRESHOLD`; with fewer samples still it is reported as
skipped (:class:`Skipped`), never as a pass. Detecting a +20% shift this way needs samples in the thousands when latencies
are dispersed (``benchmarks/bench_regression_power.py`` prints the power by sample size). The effect size is Cliff's delta, P(current > baseline) - P(current < baseline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis.causes import Cause
from kvdiag.diagnosis.frames import Logs
from kvdiag.diagnosis.rules import P99_THRESHOLD, REGRESSION_MIN_SAMPLES
from kvdiag.events.schema import EngineStep, RequestArrived, RequestFinished, RequestFirstToken

Metric = Literal["ttft", "per_token", "step"]
METRICS: tuple[Metric, ...] = ("ttft", "per_token", "step")
METRIC_LABELS = {"ttft": "time to first token", "per_token": "time per output token",
                 "step": "engine step duration"}
QUANTILES = (0.5, 0.95, 0.99)
DEFAULT_THRESHOLD = P99_THRESHOLD  # kvdiag.diagnosis.rules
MIN_SAMPLES = 20  # fewer samples than this: no percentile is reported
MIN_P99_SAMPLES = REGRESSION_MIN_SAMPLES[0.99]  # below, the P99 is the sample maximum (rules.py)


def request_latency(logs: Logs) -> pd.DataFrame:
    """One row per finished request: node, request_id, arrived_ns, first_token_ns,
    finished_ns, ttft_ns, e2e_ns, prompt_tokens, output_tokens, cached_prompt_tokens,
    per_token_ns. A missing ``ttft_ns``/``e2e_ns`` is filled from the first-token event and
    from finished - arrived; what cannot be known stays NaN."""
    fin = logs.frame(RequestFinished)
    cols = ["node", "request_id", "arrived_ns", "first_token_ns", "finished_ns", "ttft_ns",
            "e2e_ns", "prompt_tokens", "output_tokens", "cached_prompt_tokens", "status",
            "per_token_ns"]
    if fin.empty:
        return pd.DataFrame(columns=cols)
    df = fin[["node", "request_id", "ts_ns", "prompt_tokens", "output_tokens",
              "cached_prompt_tokens", "status", "e2e_ns", "ttft_ns"]].rename(
        columns={"ts_ns": "finished_ns"})
    df = df.drop_duplicates(["node", "request_id"], keep="last")
    arr = logs.frame(RequestArrived)
    arr = arr[["node", "request_id", "ts_ns"]].drop_duplicates(["node", "request_id"])
    df = df.merge(arr.rename(columns={"ts_ns": "arrived_ns"}), on=["node", "request_id"],
                  how="left")
    ft = logs.frame(RequestFirstToken)
    ft = ft[["node", "request_id", "ts_ns", "ttft_ns"]].drop_duplicates(["node", "request_id"])
    df = df.merge(ft.rename(columns={"ts_ns": "first_token_ns", "ttft_ns": "ttft_ev_ns"}),
                  on=["node", "request_id"], how="left")
    for c in ("e2e_ns", "ttft_ns", "arrived_ns", "first_token_ns", "ttft_ev_ns"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    df["ttft_ns"] = df["ttft_ns"].fillna(df["ttft_ev_ns"])
    df["e2e_ns"] = df["e2e_ns"].fillna(df["finished_ns"] - df["arrived_ns"])
    df["arrived_ns"] = df["arrived_ns"].fillna(df["finished_ns"] - df["e2e_ns"])
    df["first_token_ns"] = df["first_token_ns"].fillna(df["arrived_ns"] + df["ttft_ns"])
    out_tok = df["output_tokens"].astype("float64")
    df["per_token_ns"] = np.where(out_tok >= 2, (df["e2e_ns"] - df["ttft_ns"]) / (out_tok - 1),
                                  np.nan)
    return df[cols].sort_values("finished_ns", ignore_index=True)


def samples(logs: Logs, metric: Metric, requests: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Latency samples of one metric in time order: node, ts_ns (when it was measured:
    first token, finish, or step), value_ns. Requests that did not finish normally are left
    out. ``requests``: a precomputed :func:`request_latency` frame."""
    if metric == "step":
        st = logs.frame(EngineStep)
        df = pd.DataFrame({"node": st["node"], "ts_ns": st["ts_ns"],
                           "value_ns": st["duration_ns"].astype("float64")})
    else:
        req = request_latency(logs) if requests is None else requests
        req = req[req["status"] == "finished"]
        ts = req["first_token_ns"] if metric == "ttft" else req["finished_ns"]
        value = req["ttft_ns"] if metric == "ttft" else req["per_token_ns"]
        df = pd.DataFrame({"node": req["node"], "ts_ns": ts, "value_ns": value})
    df = df[np.isfinite(df["value_ns"].to_numpy(dtype="float64"))]
    return df.sort_values("ts_ns", kind="stable", ignore_index=True)


# ---------------------------------------------------------------- percentiles


def quantile(x: np.ndarray, q: float) -> float:
    """Inverse empirical CDF at q: the ceil(q n)-th smallest sample."""
    xs = np.sort(np.asarray(x, dtype="float64"))
    return float(xs[order_rank(len(xs), q) - 1])


def order_rank(n: int, q: float) -> int:
    return min(max(int(np.ceil(q * n - 1e-9)), 1), n)


def bootstrap_quantile(x_sorted: np.ndarray, q: float, n_boot: int,
                       rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` draws of the q-quantile of a bootstrap resample of ``x_sorted`` (ascending),
    sampled exactly through the order statistic of uniforms (module docstring)."""
    n = len(x_sorted)
    k = order_rank(n, q)
    u = rng.beta(k, n + 1 - k, size=n_boot)
    idx = np.clip(np.ceil(u * n).astype(np.int64) - 1, 0, n - 1)
    return x_sorted[idx]


def quantiles_ci(x: np.ndarray, qs: tuple[float, ...] = QUANTILES, conf: float = 0.95,
                 n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """P50/P95/P99 (``qs``) of ``x`` with percentile-bootstrap confidence intervals:
    columns quantile, value, ci_low, ci_high, n. Empty when fewer than MIN_SAMPLES."""
    x = np.asarray(x, dtype="float64")
    x = np.sort(x[np.isfinite(x)])
    if len(x) < MIN_SAMPLES:
        return pd.DataFrame(columns=["quantile", "value", "ci_low", "ci_high", "n"])
    rng = np.random.default_rng(seed)
    alpha = (1 - conf) / 2
    rows = []
    for q in qs:
        draws = bootstrap_quantile(x, q, n_boot, rng)
        lo, hi = np.quantile(draws, [alpha, 1 - alpha])
        rows.append((q, float(x[order_rank(len(x), q) - 1]), float(lo), float(hi), len(x)))
    return pd.DataFrame(rows, columns=["quantile", "value", "ci_low", "ci_high", "n"])


def cliffs_delta(baseline: np.ndarray, current: np.ndarray) -> float:
    """P(current > baseline) - P(current < baseline) over all pairs (ties count zero)."""
    b = np.sort(np.asarray(baseline, dtype="float64"))
    c = np.asarray(current, dtype="float64")
    below = np.searchsorted(b, c, side="left").sum()  # pairs with baseline < current
    above = (len(b) - np.searchsorted(b, c, side="right")).sum()  # baseline > current
    return float((below - above) / (len(b) * len(c)))


@dataclass
class Comparison:
    """The ``quantile`` (P99, or P90/P50 with too few samples for P99) of ``current`` against
    ``baseline``: ``change`` = Q_cur / Q_base - 1 with its two-sided ``conf`` bootstrap
    interval [ci_low, ci_high]; ``flagged`` when ci_low > threshold. ``q_*_ns`` are the compared
    quantiles; ``p99_*_ns`` the sample P99s (the maximum below 100 samples), shown either way.
    ``method``: what was compared: "baseline" (the baseline log), "change point" (after the
    metric's change point vs before), or "halves" (the second half of the samples vs the first)."""

    metric: str
    n_baseline: int
    n_current: int
    p99_baseline_ns: float
    p99_current_ns: float
    change: float
    ci_low: float
    ci_high: float
    threshold: float
    flagged: bool
    cliffs_delta: float
    p50_change: float
    p95_change: float
    baseline_window_ns: tuple[int, int] = (0, 0)
    current_window_ns: tuple[int, int] = (0, 0)
    causes: list[Cause] = field(default_factory=list)
    quantile: float = 0.99
    q_baseline_ns: float = float("nan")
    q_current_ns: float = float("nan")
    method: str = ""

    def describe(self) -> str:
        """What was compared and what came out, as one clause (ms, or s from 1 s on)."""
        q = f"P{self.quantile * 100:g}"
        secs = max(self.q_baseline_ns, self.q_current_ns) >= 1e9
        scale, unit = (1e9, "s") if secs else (1e6, "ms")
        return (f"{self.metric} {q} {self.q_baseline_ns / scale:.{2 if secs else 1}f} -> "
                f"{self.q_current_ns / scale:.{2 if secs else 1}f} {unit} "
                f"({self.change:+.1%}, 90% CI {self.ci_low:+.1%}..{self.ci_high:+.1%}, limit "
                f"{self.threshold:+.0%}; {self.method}, n {self.n_baseline}/{self.n_current})")

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "causes"}
        d["causes"] = [c.to_dict() for c in self.causes]
        return d


@dataclass(frozen=True)
class Skipped:
    """A latency the regression rule could not compare: ``n`` samples where ``needed`` are
    (per side, or in all for a split log)."""

    metric: str
    n: int
    needed: int

    def describe(self) -> str:
        return f"{self.metric} n/a ({self.n} of {self.needed} needed)"

    def to_dict(self) -> dict:
        return {"metric": self.metric, "n": self.n, "needed": self.needed}


def compare(baseline: np.ndarray, current: np.ndarray, metric: str = "",
            threshold: float = DEFAULT_THRESHOLD, conf: float = 0.90, n_boot: int = 4000,
            seed: int = 0, q: float = 0.99) -> Optional[Comparison]:
    """Compare the ``q``-quantile (default P99) of two independent samples (None when either
    has fewer than ``rules.REGRESSION_MIN_SAMPLES[q]``: with fewer, the P99 is the maximum and
    bootstrap intervals of a maximum are too narrow, which measured 6-7 false alarms in 100 at
    n = 50-60)."""
    b = np.sort(np.asarray(baseline, dtype="float64"))
    c = np.sort(np.asarray(current, dtype="float64"))
    b, c = b[np.isfinite(b)], c[np.isfinite(c)]
    need = REGRESSION_MIN_SAMPLES[q]
    if len(b) < need or len(c) < need:
        return None
    rng = np.random.default_rng(seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = bootstrap_quantile(c, q, n_boot, rng) / bootstrap_quantile(b, q, n_boot, rng)
    alpha = (1 - conf) / 2
    lo, hi = np.quantile(ratio - 1, [alpha, 1 - alpha])
    qb = {x: b[order_rank(len(b), x) - 1] for x in (*QUANTILES, q)}
    qc = {x: c[order_rank(len(c), x) - 1] for x in (*QUANTILES, q)}
    with np.errstate(divide="ignore", invalid="ignore"):
        return Comparison(
            metric=metric, n_baseline=len(b), n_current=len(c),
            p99_baseline_ns=float(qb[0.99]), p99_current_ns=float(qc[0.99]),
            change=float(qc[q] / qb[q] - 1), ci_low=float(lo), ci_high=float(hi),
            threshold=threshold, flagged=bool(lo > threshold), cliffs_delta=cliffs_delta(b, c),
            p50_change=float(qc[0.5] / qb[0.5] - 1), p95_change=float(qc[0.95] / qb[0.95] - 1),
            quantile=q, q_baseline_ns=float(qb[q]), q_current_ns=float(qc[q]),
        )


def fallback_quantile(n_per_side: int) -> Optional[float]:
    """The highest quantile whose minimum count (``rules.REGRESSION_MIN_SAMPLES``) ``n_per_side``
    samples meet, None when none is met."""
    met = [q for q, need in REGRESSION_MIN_SAMPLES.items() if n_per_side >= need]
    return max(met) if met else None


# ---------------------------------------------------------------- over time, change points


def quantiles_over_time(s: pd.DataFrame, n_windows: int = 20) -> pd.DataFrame:
    """P50/P95/P99 of ``value_ns`` in ``n_windows`` equal time windows of a :func:`samples`
    frame: columns window_start_ns, window_end_ns, n, p50_ns, p95_ns, p99_ns (windows with
    no samples are left out)."""
    cols = ["window_start_ns", "window_end_ns", "n", "p50_ns", "p95_ns", "p99_ns"]
    if s.empty:
        return pd.DataFrame(columns=cols)
    t = s["ts_ns"].to_numpy(dtype="int64")
    v = s["value_ns"].to_numpy(dtype="float64")
    edges = np.linspace(t.min(), t.max() + 1, n_windows + 1).astype("int64")
    which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, n_windows - 1)
    rows = []
    for w in range(n_windows):
        x = np.sort(v[which == w])
        if len(x):
            rows.append((int(edges[w]), int(edges[w + 1]), len(x),
                         *(float(x[order_rank(len(x), q) - 1]) for q in QUANTILES)))
    return pd.DataFrame(rows, columns=cols)


def change_point(values: np.ndarray, min_size: int = MIN_SAMPLES) -> Optional[int]:
    """Pettitt's change point of time-ordered ``values``: the split i maximising
    |U_i| = |2 * (sum of the ranks of the first i values) - i (n + 1)|, i.e. where the values
    before and after differ most by the Mann-Whitney statistic (a shift of any part of the
    distribution). None if either side would hold fewer than ``min_size`` samples."""
    v = np.asarray(values, dtype="float64")
    n = len(v)
    if n < 2 * min_size:
        return None
    ranks = pd.Series(v).rank(method="average").to_numpy()
    csum = np.cumsum(ranks)
    i = np.arange(min_size, n - min_size + 1)
    u = np.abs(2 * csum[i - 1] - i * (n + 1))
    return int(i[int(np.argmax(u))])
