"""Latency as users (SREs) see it: TTFT, TPOT, queue wait and end-to-end time of finished
requests, per node and overall, with the arrival rate beside the completion (service) rate.

Definitions (every duration over requests that finished normally, ``RequestFinished.status ==
"finished"``, in the window):

- ``ttft``: time to first token, first token - arrival (``RequestFirstToken``/``RequestFinished``
  ``ttft_ns``), as :func:`kvdiag.diagnosis.latency.request_latency` reads it.
- ``tpot``: time per output token after the first, ``(e2e - ttft) / (output_tokens - 1)``
  (requests with at least 2 output tokens): the inter-token time a streaming user sees
  (:mod:`kvdiag.diagnosis.latency`'s ``per_token``; top's TPOT is the same).
- ``queue``: queue wait, the request's first scheduling (``RequestScheduled``) - its arrival
  (``RequestArrived``; the event's own ``queue_ns`` when the arrival is not in the log). An
  engine that emits no scheduling events has no queue wait: ``n/a``, never a guess.
- ``e2e``: finished - arrival.

Percentiles are the inverse empirical CDF (:func:`kvdiag.diagnosis.latency.quantile`: the
``ceil(q n)``-th smallest; with ``n <= 100`` samples the P99 is the maximum).

Rates over the window: the arrival rate is ``(arrivals - 1) / (last arrival - first arrival)``
(``RequestArrived``), the completion (service) rate ``(finished - 1) / (last finish - first
finish)`` over finished requests: each is events per second of the span they cover, so a
sustainable load gives equal rates and an overload (requests arrive faster than the engine
completes them, and queue) an arrival rate above the completion rate. Fewer than two events:
no rate. Over several nodes the rates are the sum of the nodes' (they serve side by side; their
logs may come from different times), the percentiles pool every node's requests.

A latency that no request event carries (vLLM's plugin records no first token or scheduling)
comes from the engine's own /metrics histogram when the log has one (:data:`ENGINE_HISTOGRAMS`),
marked as such; otherwise it is ``n/a``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis import rules
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.latency import quantile, request_latency
from kvdiag.diagnosis.frames import Logs
from kvdiag.events.schema import EngineMetrics, RequestArrived, RequestFinished, RequestScheduled

METRICS = ("ttft", "tpot", "queue", "e2e")
LABELS = {"ttft": "TTFT", "tpot": "TPOT (inter-token)", "queue": "queue wait", "e2e": "end to end"}
NO_SCHEDULING = "n/a: the engine emits no scheduling events (RequestScheduled)"


@dataclass(frozen=True)
class Stat:
    """One latency over finished requests: ``count`` samples, P50 and P99 in seconds (None
    without samples); ``reason`` says why there is no number."""

    metric: str
    count: int
    p50_s: Optional[float]
    p99_s: Optional[float]
    reason: str = ""
    unit: str = "s"
    source: str = "requests"  # or "engine histogram": the engine's /metrics, see ENGINE_HISTOGRAMS


@dataclass(frozen=True)
class NodeLatency:
    """The latencies of one node (or ``"all"``: every node's requests pooled) and its rates."""

    node: str
    requests_finished: int
    requests_arrived: int
    stats: dict[str, Stat]
    arrival_rate_per_s: Optional[float]
    completion_rate_per_s: Optional[float]
    window_s: float  # first to last request event of the node
    scheduling_events: bool

    @property
    def rate_ratio(self) -> Optional[float]:
        """Arrival rate / completion rate (None without both)."""
        a, c = self.arrival_rate_per_s, self.completion_rate_per_s
        return a / c if a is not None and c else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stats"] = {m: asdict(s) for m, s in self.stats.items()}
        d["rate_ratio"] = self.rate_ratio
        return d


@dataclass(frozen=True)
class LatencySummary:
    """``overall`` pools every node's requests; ``nodes`` has one entry per node."""

    overall: NodeLatency
    nodes: list[NodeLatency] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"definitions": DEFINITIONS, "overall": self.overall.to_dict(),
                "nodes": [n.to_dict() for n in self.nodes]}


DEFINITIONS = {
    "ttft": "first token - arrival",
    "tpot": "(e2e - ttft) / (output tokens - 1), requests with >= 2 output tokens",
    "queue": "first RequestScheduled - arrival",
    "e2e": "finished - arrival",
    "population": "requests finished normally in the window",
    "percentile": "inverse empirical CDF (ceil(q n)-th smallest; P99 is the maximum for n <= 100)",
    "rates": "(events - 1) / (last - first event) of arrivals and of finished requests; summed over nodes",
    "engine histogram": "where no request event carries a latency: the engine's /metrics histogram, "
                        "first to last scrape, P50/P99 interpolated within buckets",
}


def request_timings(logs: Logs) -> pd.DataFrame:
    """One row per request finished normally: node, request_id, arrived_ns, scheduled_ns
    (first scheduling; NaN without one), finished_ns and the four latencies ``ttft_ns``,
    ``tpot_ns``, ``queue_ns``, ``e2e_ns`` (NaN where unknown)."""
    req = request_latency(logs)
    req = req[req["status"] == "finished"]
    sch = logs.frame(RequestScheduled)
    first = (sch.sort_values("ts_ns", kind="stable").drop_duplicates(["node", "request_id"])
             [["node", "request_id", "ts_ns", "queue_ns"]]
             .rename(columns={"ts_ns": "scheduled_ns", "queue_ns": "queue_ev_ns"}))
    arr = (logs.frame(RequestArrived).drop_duplicates(["node", "request_id"])[["node", "request_id", "ts_ns"]]
           .rename(columns={"ts_ns": "arrived_int_ns"}))
    df = req.merge(first, on=["node", "request_id"], how="left").merge(arr, on=["node", "request_id"], how="left")
    arrived = pd.to_numeric(df["arrived_ns"], errors="coerce").astype("float64")
    scheduled = pd.to_numeric(df["scheduled_ns"], errors="coerce").astype("float64")
    # in integers: float64 timestamps of ~1.8e18 ns are only exact to 256 ns
    queue = (df["scheduled_ns"].astype("Int64") - df["arrived_int_ns"].astype("Int64")).astype("Float64")
    queue = queue.fillna(pd.to_numeric(df["queue_ev_ns"], errors="coerce")).astype("float64")
    return pd.DataFrame({
        "node": df["node"], "request_id": df["request_id"], "arrived_ns": arrived,
        "scheduled_ns": scheduled, "finished_ns": df["finished_ns"].astype("float64"),
        "ttft_ns": df["ttft_ns"], "tpot_ns": df["per_token_ns"], "queue_ns": queue,
        "e2e_ns": df["e2e_ns"]})


def queue_waits_ns(logs: Logs) -> np.ndarray:
    """Queue waits (first scheduling - arrival, as in :func:`request_timings`) of the requests
    first scheduled inside ``logs``' window, finished or not; for a window, the first
    scheduling and the arrival are looked up in the whole log it was cut from."""
    whole = logs.whole or logs
    sch = whole.frame(RequestScheduled)
    if sch.empty:
        return np.array([], dtype="float64")
    first = sch.sort_values("ts_ns", kind="stable").drop_duplicates(["node", "request_id"])
    lo, hi = logs.time_range_ns()
    first = first[(first["ts_ns"] >= lo) & (first["ts_ns"] <= hi)]
    arr = whole.frame(RequestArrived).drop_duplicates(["node", "request_id"])[["node", "request_id", "ts_ns"]]
    df = first.merge(arr.rename(columns={"ts_ns": "arrived_ns"}), on=["node", "request_id"], how="left")
    q = (df["ts_ns"].astype("Int64") - df["arrived_ns"].astype("Int64")).astype("Float64")  # exact: integers
    q = q.fillna(pd.to_numeric(df["queue_ns"], errors="coerce")).astype("float64").to_numpy(dtype="float64")
    return q[np.isfinite(q)]


def _stat(metric: str, values: np.ndarray, reason: str = "") -> Stat:
    v = np.asarray(values, dtype="float64")
    if not reason and not np.isfinite(v).any():
        reason = ("no finished requests" if not len(v) else
                  "n/a: no request with >= 2 output tokens and a TTFT" if metric == "tpot" else
                  f"n/a: not recorded for the {len(v)} finished requests")
    v = v[np.isfinite(v)]
    if reason:
        return Stat(metric, int(len(v)), None, None, reason)
    return Stat(metric, int(len(v)), quantile(v, 0.5) / 1e9, quantile(v, 0.99) / 1e9)


def _rate(ts_ns: np.ndarray) -> Optional[float]:
    t = np.asarray(ts_ns, dtype="float64")
    t = t[np.isfinite(t)]
    if len(t) < 2 or t.max() <= t.min():
        return None
    return (len(t) - 1) / ((t.max() - t.min()) / 1e9)


ENGINE_HISTOGRAMS = {"ttft": "ttft_s", "tpot": "inter_token_s", "queue": "queue_s", "e2e": "e2e_s"}
"""A latency the request events do not carry is read from the engine's own /metrics histogram
of it (``EngineMetrics.histograms``; vLLM's time_to_first_token, inter_token_latency,
request_queue_time, e2e_request_latency): the bucket increase between the node's first and
last scrape, its P50/P99 interpolated within buckets as PromQL's ``histogram_quantile`` does
(:mod:`kvdiag.diagnosis.engine_latency`), so they are estimates to a bucket's width. vLLM's
TPOT histogram counts every inter-token interval, not one mean per request."""


def _engine_stat(metric: str, em: pd.DataFrame) -> Optional[Stat]:
    """:data:`ENGINE_HISTOGRAMS`' reading of one latency on one node's scrapes (None without
    a histogram that grew in the window, or whose buckets changed or fell: a restart)."""
    from kvdiag.diagnosis.engine_latency import histogram_quantile
    key = ENGINE_HISTOGRAMS[metric]
    hists = [h[key] for h in em.sort_values("ts_ns", kind="stable").get("histograms", pd.Series(dtype=object))
             if isinstance(h, dict) and h.get(key)]
    if len(hists) < 2:
        return None
    first, last = hists[0], hists[-1]
    if [le for le, _ in first] != [le for le, _ in last]:
        return None
    inc = [(le, c1 - c0) for (le, c0), (_, c1) in zip(first, last)]
    if any(c < 0 for _, c in inc) or not max(c for _, c in inc) > 0:
        return None
    count = int(max(c for _, c in inc))
    return Stat(metric, count, histogram_quantile(0.5, inc), histogram_quantile(0.99, inc),
                "from the engine's /metrics histogram (interpolated within buckets)", source="engine histogram")


def _node(name: str, timings: pd.DataFrame, arrivals: pd.DataFrame, finished: pd.DataFrame,
          scheduling: bool, metrics: Optional[pd.DataFrame] = None) -> NodeLatency:
    stats = {m: _stat(m, timings[f"{m}_ns"].to_numpy(),
                      NO_SCHEDULING if m == "queue" and not scheduling and len(timings) else "") for m in METRICS}
    if metrics is not None and len(metrics):
        for m, st in stats.items():
            if st.p50_s is None:
                stats[m] = _engine_stat(m, metrics) or st
    arr_t = arrivals.drop_duplicates(["node", "request_id"])["ts_ns"].to_numpy(dtype="float64")
    fin_t = finished["ts_ns"].to_numpy(dtype="float64")
    both = np.r_[arr_t, fin_t]
    return NodeLatency(name, len(timings), len(arr_t), stats, _rate(arr_t), _rate(fin_t),
                       float((both.max() - both.min()) / 1e9) if len(both) else 0.0, scheduling)


def summarize(logs: Logs, timings: Optional[pd.DataFrame] = None) -> LatencySummary:
    """:class:`LatencySummary` of ``logs`` (module docstring for every definition);
    ``timings``: a precomputed :func:`request_timings` frame."""
    timings = request_timings(logs) if timings is None else timings
    arr = logs.frame(RequestArrived)
    fin = logs.frame(RequestFinished)
    fin = fin[fin["status"] == "finished"].drop_duplicates(["node", "request_id"], keep="last")
    sch_nodes = set(logs.frame(RequestScheduled)["node"])
    em = logs.frame(EngineMetrics)
    nodes = [_node(n, timings[timings["node"] == n], arr[arr["node"] == n], fin[fin["node"] == n],
                   n in sch_nodes, em[em["node"] == n]) for n in logs.nodes]
    overall = _node("all", timings, arr, fin, bool(sch_nodes))
    if len(nodes) == 1:
        overall = replace(nodes[0], node="all")
    elif nodes:  # nodes serve side by side (their logs may be from different times): rates add up
        def total(rates):
            known = [r for r in rates if r is not None]
            return float(sum(known)) if known else None
        overall = replace(overall, arrival_rate_per_s=total(n.arrival_rate_per_s for n in nodes),
                          completion_rate_per_s=total(n.completion_rate_per_s for n in nodes),
                          window_s=max(n.window_s for n in nodes))
    if len(nodes) > 1 and not all(n.scheduling_events for n in nodes) and sch_nodes:
        # pooled queue wait over only some nodes would misstate the whole: say which
        q = overall.stats["queue"]
        overall.stats["queue"] = Stat("queue", q.count, q.p50_s, q.p99_s,
                                      f"over nodes with scheduling events only ({', '.join(sorted(sch_nodes))})"
                                      if q.count else q.reason)
    return LatencySummary(overall, nodes)


# ---------------------------------------------------------------- the queueing rule

QUEUEING_TITLE = "requests are not held in a queue (queue wait vs TTFT, arrivals vs completions)"


def _queueing_node(nl: NodeLatency, timings: pd.DataFrame) -> tuple[str, str, dict]:
    """(status, message, evidence) of ``latency.queueing`` for one node."""
    q = timings["queue_ns"].to_numpy(dtype="float64")
    t = timings["ttft_ns"].to_numpy(dtype="float64")
    both = np.isfinite(q) & np.isfinite(t) & (t > 0)
    n, need = int(both.sum()), rules.QUEUE_MIN_REQUESTS
    ratio = nl.rate_ratio
    rates = (f"arrivals {nl.arrival_rate_per_s:.2f}/s vs completions {nl.completion_rate_per_s:.2f}/s "
             f"({ratio:.2f}x)" if ratio is not None else "arrival/completion rates n/a")
    ev = {"node": nl.node, "requests": n, "needed": need, "arrival_rate_per_s": nl.arrival_rate_per_s,
          "completion_rate_per_s": nl.completion_rate_per_s, "rate_ratio": ratio,
          "share_limit": rules.QUEUE_SHARE_LIMIT, "overload_ratio": rules.OVERLOAD_RATIO}
    if not nl.scheduling_events:
        if nl.requests_finished < need or ratio is None:
            return "n/a", (f"per-request queue wait n/a (no scheduling events); n/a ({nl.requests_finished} "
                           f"of {need} needed)"), ev
        status = rules.queueing_status(float("nan"), float("nan"), ratio)
        return status, f"per-request queue wait n/a (the engine emits no scheduling events); {rates}", ev
    if n < need:
        return "n/a", f"n/a ({n} of {need} needed: finished requests with a queue wait and a TTFT)", ev
    share = float(np.median(q[both] / t[both]))
    qs = nl.stats["queue"]
    p50_ns = quantile(q[both], 0.5)
    status = rules.queueing_status(share, p50_ns, ratio if ratio is not None else float("nan"))
    ev.update({"queue_p50_s": qs.p50_s, "queue_p99_s": qs.p99_s, "ttft_p50_s": nl.stats["ttft"].p50_s,
               "queue_share_of_ttft_p50": share})
    return status, (f"queue wait P50 {fmt_s(qs.p50_s)}, P99 {fmt_s(qs.p99_s)}: {share:.0%} of TTFT at the median "
                    f"(TTFT P50 {fmt_s(nl.stats['ttft'].p50_s)}; limit {rules.QUEUE_SHARE_LIMIT:.0%}); {rates} "
                    f"(limit {rules.OVERLOAD_RATIO:g}x)"), ev


def queueing(logs: Logs, summary: Optional[LatencySummary] = None) -> Finding:
    """``latency.queueing``: per node, the median share of TTFT spent queued (queue wait / TTFT
    per finished request) and the arrival rate against the completion rate
    (:func:`summarize`); verdict :func:`kvdiag.diagnosis.rules.queueing_status`, the worst node
    decides. Fewer than :data:`kvdiag.diagnosis.rules.QUEUE_MIN_REQUESTS` requests: n/a."""
    timings = request_timings(logs)
    summary = summary or summarize(logs, timings)
    order = {"fail": 0, "warn": 1, "pass": 2, "n/a": 3}
    judged = sorted((_queueing_node(nl, timings[timings["node"] == nl.node]) for nl in summary.nodes),
                    key=lambda r: order[r[0]])
    if not judged:
        return Finding("latency.queueing", "n/a", QUEUEING_TITLE, "no request events")
    status, msg, ev = judged[0]
    if len(summary.nodes) > 1:
        msg = f"{ev['node']}: {msg}"
    return Finding("latency.queueing", status, QUEUEING_TITLE, msg, ev)


# ---------------------------------------------------------------- formatting (plain text)


def fmt_s(x: Optional[float]) -> str:
    """A duration in seconds as text: ms below 1 s, s above; "n/a" for None."""
    if x is None:
        return "n/a"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def rows(summary: LatencySummary) -> list[dict]:
    """One display row per (node, metric): node, metric, n, P50, P99 (text with units), note.
    The overall rows only when there are several nodes, else the node's."""
    out = []
    for nl in ([summary.overall] + summary.nodes if len(summary.nodes) > 1 else summary.nodes or [summary.overall]):
        for m in METRICS:
            s = nl.stats[m]
            note = s.reason or ("P99 = max (n <= 100)" if 0 < s.count <= 100 else "")
            if s.source != "requests":
                note = "engine /metrics histogram, interpolated within buckets"
            out.append({"node": nl.node, "metric": LABELS[m], "n": s.count, "P50": fmt_s(s.p50_s),
                        "P99": fmt_s(s.p99_s), "note": note})
    return out


def rates_line(nl: NodeLatency) -> str:
    """Arrival vs completion rate of one node (or all) as a sentence."""
    def r(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x:.2f}/s"
    ratio = nl.rate_ratio
    return (f"{'' if nl.node == 'all' else nl.node + ': '}arrivals {r(nl.arrival_rate_per_s)} "
            f"({nl.requests_arrived} requests), completions {r(nl.completion_rate_per_s)} "
            f"({nl.requests_finished} finished) over {nl.window_s:.1f} s"
            + (f"; arrival / completion {ratio:.2f}" if ratio is not None else ""))
