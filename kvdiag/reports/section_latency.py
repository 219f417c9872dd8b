"""The report's latency section: per metric its distribution (against a baseline's when given)
and P50 / P95 / P99 over time, percentiles with bootstrap confidence intervals, the engine's own
latency histograms, and the P99 comparisons with the candidate causes of a regression."""

from __future__ import annotations

from typing import Optional

import pandas as pd

from kvdiag.diagnosis import latency
from kvdiag.diagnosis.engine_latency import engine_latency_frame
from kvdiag.diagnosis.frames import Logs
from kvdiag.reports.document import Absent, Block, Chart, Section, Table, Text
from kvdiag.reports.shaping import hist, secs, thin

ENGINE_LATENCY = {"ttft_p50_s": "TTFT P50", "ttft_p99_s": "TTFT P99",
                  "inter_token_p50_s": "inter-token P50", "inter_token_p99_s": "inter-token P99"}


def engine_latency(logs: Logs, t0: int) -> list[Block]:
    """The engine's own TTFT and inter-token P50 / P99 per scrape interval (its /metrics
    histograms); nothing when the logs have none."""
    fr = engine_latency_frame(logs)
    if fr is None or fr.empty:
        return []
    long = fr.melt(id_vars=["ts_ns", "node"], value_vars=list(ENGINE_LATENCY), var_name="measure",
                   value_name="s").dropna(subset=["s"])
    if long.empty:
        return []
    long = long.assign(ms=long["s"] * 1e3, time_s=secs(long["ts_ns"], t0), measure=long["measure"].map(ENGINE_LATENCY))
    long["series"] = (long["node"] + ": " if len(logs.nodes) > 1 else "") + long["measure"]
    tbl = long.groupby(["node", "measure"], sort=False)["ms"].agg(intervals="size", median="median", max="max")
    return [Chart("Engine-reported TTFT and inter-token latency, P50 / P99 per scrape interval (ms)", "line",
                  thin(long, "series", "ms"), "time_s", "ms", color="series", x_title="time (s)", y_title="ms",
                  table=tbl.round(2).reset_index()),
            Text("From the engine's own /metrics histograms: the bucket increase between two scrapes, "
                 "interpolated within its bucket as PromQL's histogram_quantile does (a quantile past the "
                 "highest finite bucket shows as that bound); intervals without observations are left out.")]


def latency_section(logs: Logs, t0: int, lat: pd.DataFrame, comps: list[latency.Comparison],
                    baseline: Optional[Logs]) -> Section:
    """Per metric with samples its charts, then the engine's histograms; the percentile table
    first; the comparisons and their causes last."""
    sec = Section("latency", "Latency and P99 regressions",
                  "Why did P99 latency jump, and what changed?")
    any_data = False
    qrows = []
    for metric in latency.METRICS:
        s = latency.samples(logs, metric, lat)
        if s.empty:
            continue
        any_data = True
        sec.blocks += metric_charts(s, metric, t0, baseline)
        qrows += percentile_rows(s, metric, len(logs.nodes) > 1)
    engine = engine_latency(logs, t0)
    sec.blocks += engine
    if not any_data and not engine:
        sec.blocks.append(Absent("latency samples (finished requests, engine steps, the engine's "
                                 "/metrics histograms)"))
        return sec
    if qrows:
        sec.blocks.insert(0, Table("Percentiles with bootstrap 95% confidence intervals", pd.DataFrame(qrows)))
    if comps:
        sec.blocks += comparison_tables(comps, t0, baseline)
    return sec


def metric_charts(s: pd.DataFrame, metric: str, t0: int, baseline: Optional[Logs]) -> list[Block]:
    """One metric's samples ``s``: their distribution (beside the baseline's) and P50 / P95 / P99
    in about 20 windows over time."""
    label = latency.METRIC_LABELS[metric]
    parts = [("current" if baseline is not None else "all", s)]
    if baseline is not None:
        parts.append(("baseline", latency.samples(baseline, metric)))
    hists = []
    for name, p in parts:
        x, c = hist(p["value_ns"].to_numpy() / 1e6, 40)
        hists.append(pd.DataFrame({"ms": x.round(3), "count": c, "log": name}))
    h = pd.concat(hists, ignore_index=True)
    blocks: list[Block] = [Chart(f"Distribution: {label} (ms)", "histogram", h, "ms", "count",
                                 color="log" if baseline is not None else None, x_title="ms", y_title="count",
                                 table=None)]
    ot = latency.quantiles_over_time(s, 20)
    if len(ot):
        long = ot.melt(id_vars=["window_end_ns", "n"], value_vars=["p50_ns", "p95_ns", "p99_ns"],
                       var_name="quantile", value_name="ns")
        long = long.assign(time_s=secs(long["window_end_ns"], t0), ms=long["ns"] / 1e6,
                           quantile=long["quantile"].str.replace("_ns", ""))
        blocks.append(Chart(f"{label}: P50 / P95 / P99 over time (ms)", "line", long, "time_s", "ms",
                            color="quantile", x_title="time (s)", y_title="ms",
                            table=ot.assign(time_s=secs(ot["window_end_ns"], t0).round(1),
                                            p50_ms=ot["p50_ns"] / 1e6, p95_ms=ot["p95_ns"] / 1e6,
                                            p99_ms=ot["p99_ns"] / 1e6)[["time_s", "n", "p50_ms", "p95_ms", "p99_ms"]].round(2)))
    return blocks


def percentile_rows(s: pd.DataFrame, metric: str, per_node: bool) -> list[dict]:
    """Rows of the percentile table for one metric: each quantile with its bootstrap 95% interval,
    over all samples and, with several nodes, per node."""
    rows = []
    groups = [("all", s)] + ([(n, g) for n, g in s.groupby("node")] if per_node else [])
    for node, g in groups:
        q = latency.quantiles_ci(g["value_ns"].to_numpy())
        for r in q.itertuples():
            rows.append({"metric": metric, "node": node, "quantile": f"P{r.quantile * 100:g}",
                         "ms": round(r.value / 1e6, 2),
                         "95% CI": f"{r.ci_low / 1e6:.2f} .. {r.ci_high / 1e6:.2f}", "n": r.n})
    return rows


def comparison_tables(comps: list[latency.Comparison], t0: int, baseline: Optional[Logs]) -> list[Block]:
    """The P99 comparisons (against the baseline, or between the log's halves), and the candidate
    causes of the flagged ones."""
    rows = [{"metric": c.metric, "flagged": "REGRESSION" if c.flagged else "no",
             "compared": f"P{c.quantile * 100:g}, {c.method}",
             "before_ms": round(c.q_baseline_ns / 1e6, 2), "after_ms": round(c.q_current_ns / 1e6, 2),
             "change": f"{c.change:+.1%}", "90% CI": f"{c.ci_low:+.1%} .. {c.ci_high:+.1%}",
             "threshold": f"{c.threshold:+.0%}", "Cliff's delta": round(c.cliffs_delta, 3),
             "n before/after": f"{c.n_baseline}/{c.n_current}",
             "split_at_s": round((c.current_window_ns[0] - t0) / 1e9, 1) if baseline is None else None}
            for c in comps]
    what = "against the baseline log" if baseline is not None else "inside the log"
    blocks: list[Block] = [Table(f"P99 comparison {what}", pd.DataFrame(rows),
                                 note="P99 with >= 100 samples per side; with fewer, P90 or P50 between the "
                                      "log's halves, flagged only past the gross-shift limit (rules.py)")]
    causes = [{"metric": c.metric, "cause": k.cause, "supported": "YES" if k.supported else "no",
               "evidence": k.message} for c in comps if c.flagged for k in c.causes]
    if causes:
        blocks.append(Table("Candidate causes of the flagged regressions (supported first)",
                            pd.DataFrame(causes)))
    return blocks
