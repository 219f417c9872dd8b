"""The report's summary section: what needs attention (latency as users saw it, the doctor's
findings worst first, the logs, per node and fleet tables)."""

from __future__ import annotations

from typing import Optional

import pandas as pd

from kvdiag.diagnosis import latency
from kvdiag.diagnosis import user_latency
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.frames import Logs
from kvdiag.diagnosis.memory import pool_occupancy
from kvdiag.pool.hit_rate import frame_hit_rate
from kvdiag.reports.document import Block, Section, Table, Text
from kvdiag.reports.shaping import fmt_ns


def _status_order(f: Finding) -> int:
    return {"fail": 0, "warn": 1, "pass": 2, "n/a": 3}[f.status]


def per_node(logs: Logs, lat: pd.DataFrame) -> pd.DataFrame:
    """One row per node: requests, token hit rate, TTFT and per-token P50/P99, peak pool
    occupancy, preemptions."""
    occ = pool_occupancy(logs)
    pre = logs.frame("request_preempted")
    rows = []
    for node in logs.nodes:
        r = lat[(lat["node"] == node) & (lat["status"] == "finished")]
        o = occ[occ["node"] == node]
        row = {"node": node, "requests": len(r),
               "hit_rate_pct": round(100 * (frame_hit_rate(r) or 0.0), 1)}
        for col, name in (("ttft_ns", "ttft"), ("per_token_ns", "per_token")):
            v = r[col].dropna().to_numpy()
            for q in (0.5, 0.99):
                row[f"{name}_p{q * 100:g}_ms"] = round(latency.quantile(v, q) / 1e6, 2) if len(v) else None
        row["peak_block_occupancy_pct"] = round(100 * o["block_occupancy"].max(), 1) if len(o) else None
        row["preemptions"] = int((pre["node"] == node).sum())
        rows.append(row)
    return pd.DataFrame(rows)


def latency_summary(logs: Logs, findings: list[Finding]) -> list[Block]:
    """The report's first blocks: TTFT, TPOT, queue wait and e2e of finished requests (count,
    P50, P99), the arrival and completion rates and the ``latency.queueing`` verdict
    (:mod:`kvdiag.diagnosis.user_latency`, the same figures ``kvdiag doctor`` prints first)."""
    summ = user_latency.summarize(logs)
    shown = pd.DataFrame(user_latency.rows(summ)).rename(columns={"metric": "latency"})
    if shown["node"].nunique() <= 1:
        shown = shown.drop(columns="node")
    rates = [user_latency.rates_line(n) for n in ([summ.overall] if len(summ.nodes) > 1 else []) + summ.nodes]
    q = next((f for f in findings if f.rule == "latency.queueing"), None)
    return [Table("Latency of finished requests (as users saw it)", shown,
                  note="TTFT = first token - arrival; TPOT = (e2e - TTFT) / (output tokens - 1); queue wait = "
                       "first scheduling - arrival; e2e = finished - arrival"),
            Text("Rates: " + "; ".join(rates) + "."),
            *([Text(f"{q.status.upper()} latency.queueing: {q.message}.")] if q is not None else [])]


def summary(logs: Logs, findings: list[Finding], problems: list[str], lat: pd.DataFrame,
            fleet: Optional[pd.DataFrame] = None) -> Section:
    rows = []
    last, first = logs.last_ts_ns(), logs.first_ts_ns()
    for node in logs.nodes:
        h = logs.headers[node]
        n = sum(int((df["node"] == node).sum()) for df in logs.frames.values())
        rows.append({"node": node, "log": logs.paths.get(node, ""), "engine": h.engine,
                     "model": h.model, "events": n, "first event": fmt_ns(first.get(node)),
                     "duration_s": round((last[node] - first[node]) / 1e9, 1) if node in last else None,
                     "block_size_tokens": logs.block_size_tokens(node),
                     "kv_bytes_per_token": logs.bytes_per_token(node)})
    counts = {s: sum(f.status == s for f in findings) for s in ("fail", "warn", "pass", "n/a")}
    ftable = pd.DataFrame([{"status": f.status.upper(), "rule": f.rule, "check": f.title,
                            "measured": f.message} for f in sorted(findings, key=_status_order)])
    blocks = [*latency_summary(logs, findings),
              Text(f"{counts['fail']} failing, {counts['warn']} warning, {counts['pass']} passing "
                   f"checks ({counts['n/a']} without data)."),
              Table("Findings (kvdiag doctor's rules)", ftable),
              Table("Logs", pd.DataFrame(rows))]
    if len(logs.nodes) > 1:
        blocks.append(Table("Per node", per_node(logs, lat)))
    if fleet is not None:
        blocks.append(Table("Fleet: nodes of the Parquet datasets, worst first (DuckDB)", fleet.round(2),
                            note="KV pressure: peak blocks used / pool blocks; hit rate: cached / "
                                 "prompt tokens of finished requests; TTFT of finished requests"))
    if problems:
        blocks.append(Text(f"{len(problems)} unreadable lines were skipped; first: {problems[0]}"))
    return Section("summary", "Summary", "What needs attention?", blocks)
