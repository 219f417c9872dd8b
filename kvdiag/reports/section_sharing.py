"""The report's prefix-sharing section: the engine's hit rate over time and per request, its own
counters, why prompt tokens missed, the shadow caches' what-if hit rates and memory saved, and
hit rate vs capacity."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from kvdiag.diagnosis import latency
from kvdiag.diagnosis.frames import Logs
from kvdiag.events.schema import EngineMetrics, ShadowSharing
from kvdiag.pool.hit_rate import counted, frame_hit_rate
from kvdiag.reports.document import Absent, Block, Chart, Section, Table, Text
from kvdiag.reports.shaping import MIB, hist, secs, thin


def sharing(logs: Logs, t0: int, req: pd.DataFrame) -> Section:
    """The engine's sharing as it happened, why tokens missed, then the shadow caches' what-if."""
    sec = Section("sharing", "Prefix sharing",
                  "How much does prefix sharing save on our traffic, and what would other sizes, "
                  "capacities and policies save?")
    sec.blocks += engine_hit_rate_blocks(req, t0)
    counters = engine_counters(logs)
    if counters is not None:
        sec.blocks.append(counters)
    sec.blocks += miss_causes_blocks(logs, t0)
    sec.blocks += what_if_blocks(logs, t0)
    return sec


def engine_hit_rate_blocks(req: pd.DataFrame, t0: int) -> list[Block]:
    """The engine's token hit rate (cached prompt tokens / prompt tokens) of the requests that
    finished in each of about 20 windows, and the histogram of per-request hit rates."""
    done = counted(req[req["prompt_tokens"] > 0])
    if not len(done):
        return [Absent("finished requests with prompt and cached token counts")]
    blocks: list[Block] = []
    w = latency.quantiles_over_time(pd.DataFrame({"ts_ns": done["finished_ns"], "value_ns": 0.0}), 20)
    edges = np.r_[w["window_start_ns"].to_numpy(), w["window_end_ns"].to_numpy()[-1:]] if len(w) else []
    if len(edges):
        which = np.clip(np.searchsorted(edges, done["finished_ns"].to_numpy(), side="right") - 1, 0, len(w) - 1)
        g = done.assign(win=which).groupby("win")
        hr = pd.Series({win: 100 * frame_hit_rate(part) for win, part in g}, name="hit_rate_pct")
        hr = pd.DataFrame({"time_s": secs(w["window_end_ns"].to_numpy()[hr.index], t0),
                           "hit_rate_pct": hr.to_numpy().round(1), "requests": g.size().to_numpy()})
        blocks.append(Chart("Engine token hit rate over time (cached prompt tokens / prompt tokens)",
                            "line", hr, "time_s", "hit_rate_pct", x_title="time (s)",
                            y_title="%", table=hr))
    x, c = hist(done["hit_rate"].to_numpy() * 100, 20)
    blocks.append(Chart("Per-request hit rate", "histogram",
                        pd.DataFrame({"hit_rate_pct": x.round(1), "requests": c}),
                        "hit_rate_pct", "requests", x_title="hit rate (%)", y_title="requests",
                        table=pd.DataFrame({"hit_rate_pct": x.round(1), "requests": c})))
    return blocks


def engine_counters(logs: Logs):
    """The engine's own prefix-cache counters (/metrics) increased over the log, per node, with
    their hit rate (hits / queries, tokens); None without two scrapes."""
    em = logs.frame(EngineMetrics)
    em = em.dropna(subset=["prefix_cache_queries_tokens", "prefix_cache_hits_tokens"]) if len(em) else em
    if len(em) <= 1:
        return None
    d = em.groupby("node")[["prefix_cache_queries_tokens", "prefix_cache_hits_tokens"]].agg(lambda s: s.iloc[-1] - s.iloc[0])
    d["hit_rate_pct"] = (d["prefix_cache_hits_tokens"] / d["prefix_cache_queries_tokens"] * 100).round(1)
    return Table("Engine's own prefix-cache counters (/metrics, over the log)", d.reset_index())


def what_if_blocks(logs: Logs, t0: int) -> list[Block]:
    """The shadow caches (ShadowSharing events): token hit rate over time per configuration
    (policy / block size / capacity) with the last figures and their gap to the engine's, hit rate
    vs capacity, and memory saved."""
    sh = logs.frame(ShadowSharing)
    if sh.empty:
        return [Absent("what-if prefix sharing (ShadowSharing events)",
                       "record with shadow sharing on, or run `kvdiag replay` on a trace")]
    blocks: list[Block] = []
    sh = sh.assign(capacity=sh["capacity_blocks"].map(lambda c: "unbounded" if c is None or (isinstance(c, float) and math.isnan(c)) else str(int(c))))
    sh["config"] = (sh["policy"].astype(str) + " / " + sh["block_size_tokens"].astype(str) + " tok / "
                    + sh["capacity"])
    ot = sh.assign(time_s=secs(sh["ts_ns"], t0), token_hit_rate_pct=sh["token_hit_rate"] * 100)
    last = sh.groupby(["node", "config"], sort=False).tail(1)
    tbl = last[["node", "policy", "block_size_tokens", "capacity", "requests"]].assign(
        token_hit_rate_pct=(last["token_hit_rate"] * 100).round(1),
        block_hit_rate_pct=(last["block_hit_rate"] * 100).round(1),
        saved_MiB=(pd.to_numeric(last["bytes_saved"], errors="coerce") / MIB).round(1),
        engine_hit_rate_pct=(pd.to_numeric(last["engine_hit_rate"], errors="coerce") * 100).round(1))
    tbl["gap_pct_points"] = (tbl["token_hit_rate_pct"] - tbl["engine_hit_rate_pct"]).round(1)
    blocks.append(Chart("What-if token hit rate over time, per configuration", "line",
                        thin(ot, "config", "token_hit_rate_pct"), "time_s", "token_hit_rate_pct", color="config",
                        x_title="time (s)", y_title="%", table=tbl))
    bounded = last[last["capacity"] != "unbounded"].copy()
    if len(bounded):
        blocks.append(_hit_rate_vs_capacity(bounded))
    saved = tbl.dropna(subset=["saved_MiB"])
    if len(saved):
        saved = saved.assign(config=saved["policy"].astype(str) + " / " + saved["block_size_tokens"].astype(str)
                             + " tok / " + saved["capacity"])
        blocks.append(Chart("Memory saved by sharing (MiB)", "bar", saved, "config", "saved_MiB",
                            y_title="MiB", table=saved[["config", "saved_MiB"]]))
    if tbl["engine_hit_rate_pct"].notna().any():
        blocks.append(Text("gap_pct_points = shadow token hit rate - the engine's own hit rate; a "
                           "large gap at the engine's block size and capacity means the engine "
                           "misses reuse its traffic allows."))
    return blocks


def _hit_rate_vs_capacity(bounded: pd.DataFrame) -> Chart:
    """The last token hit rate of each bounded shadow cache, one line per policy and block size."""
    bounded["capacity_blocks"] = bounded["capacity"].astype(int)
    bounded["series"] = bounded["policy"].astype(str) + " / " + bounded["block_size_tokens"].astype(str) + " tok"
    bounded["token_hit_rate_pct"] = bounded["token_hit_rate"] * 100
    bounded = bounded.sort_values(["series", "capacity_blocks"])
    return Chart("Hit rate vs cache capacity, per policy and block size", "line", bounded,
                 "capacity_blocks", "token_hit_rate_pct", color="series",
                 x_title="capacity (blocks)", y_title="token hit rate (%)",
                 table=bounded[["series", "capacity_blocks", "token_hit_rate_pct"]].round(1))


def miss_causes_blocks(logs: Logs, t0: int, windows: int = 20) -> list[Block]:
    """Missed prompt tokens per window stacked by cause (:mod:`kvdiag.diagnosis.miss_causes`),
    about ``windows`` windows over the log, and the totals as a table."""
    from kvdiag.diagnosis.miss_replay import miss_causes_of_logs
    from kvdiag.diagnosis.miss_tally import CAUSES
    lo, hi = logs.time_range_ns()
    window_s = max(1.0, math.ceil((hi - lo) / 1e9 / windows))
    per_node = miss_causes_of_logs(logs, window_s=window_s)
    if not per_node:
        return []
    rows, totals = [], []
    for node, m in per_node.items():
        label = f"{node}: " if len(per_node) > 1 else ""
        for w in m.windows:
            for cause, n in zip(CAUSES, w.tally.tokens):
                rows.append({"time_s": round((w.end_ns - t0) / 1e9, 1), "cause": label + cause, "tokens": n})
        d = m.to_dict()["total"]
        totals += [{"node": node, "cause": c, "tokens": n,
                    "share_pct": None if d["shares"][c] is None else round(d["shares"][c] * 100, 1)}
                   for c, n in d["tokens"].items()]
    data = pd.DataFrame(rows)
    return [Chart(f"Why prompt tokens missed the prefix cache, per {window_s:g} s window (stacked by cause; "
                  "they sum to the engine's missed tokens)", "bar", data, "time_s", "tokens", color="cause",
                  x_title="window end (s)", y_title="missed prompt tokens",
                  table=pd.DataFrame(totals), options={"barmode": "stack"})]


def with_curves(sec: Section, logs: Logs) -> Section:
    sec.blocks += capacity_curves(logs)
    return sec


def capacity_curves(logs: Logs, points: int = 24) -> list[Block]:
    """Hit rate vs capacity per node and tier (:mod:`kvdiag.simulation.capacity_curve`: the
    fold top and the exporter run, equal to ``kvdiag replay --curve``), from each node's log
    file; a dataset's frames lack the requests' stored blocks, so there a finished request
    adds only its prompt. A table gives the points at 0.5x..4x the pool."""
    from kvdiag.events import eventlog
    from kvdiag.simulation.capacity_curve import POOL_MULTIPLES
    from kvdiag.simulation.recorded_curves import curve_of_events, curves_of_frames

    lines, marks = [], []
    for node in logs.nodes:
        path = logs.paths.get(node)
        bs = logs.block_size_tokens(node)
        whole = logs.whole or logs
        try:
            if path is not None and Path(path).is_file():
                curves = curve_of_events(eventlog.iter_events(path), bs)
            else:
                curves = curves_of_frames({t: df[df["node"] == node] for t, df in whole.frames.items()}, bs)
        except Exception as exc:  # a curve never breaks the report
            lines.append(None)
            marks.append({"node": node, "tier": f"error: {exc}"})
            continue
        info = whole.frame("kv_pool_info")
        info = info[info["node"] == node]
        pool = int(info["num_blocks"].iloc[-1]) if len(info) else None
        for tier, c in curves.items():
            top = max(c.distinct_blocks, 1)
            caps = np.unique(np.round(np.geomspace(1, top, points)).astype(int))
            caps = np.unique(np.concatenate([[0], caps] + ([[int(m * pool) for m in POOL_MULTIPLES]] if pool else [])))
            f = c.frame(caps)
            lines.append(pd.DataFrame({"series": f"{node} / {tier}", "capacity_blocks": caps,
                                       "token_hit_rate_pct": (100 * f["token_hit_rate"]).round(2)}))
            for m in POOL_MULTIPLES if pool else ():
                marks.append({"node": node, "tier": tier, "multiple_of_pool": m,
                              "capacity_blocks": int(m * pool),
                              "token_hit_rate_pct": round(100 * c.at(int(m * pool))["token_hit_rate"], 1)})
    data = [d for d in lines if d is not None]
    if not data:
        return [Absent("hit rate vs capacity (request content or KV events)",
                       "record with content (the default: chunk hashes) or subscribe to KV events")]
    out: list[Block] = [Chart("LRU hit rate vs capacity per tier (one pass of reuse distances)", "line",
                              pd.concat(data, ignore_index=True), "capacity_blocks", "token_hit_rate_pct",
                              color="series", x_title="capacity (blocks)", y_title="token hit rate (%)",
                              table=pd.DataFrame(marks) if marks else None)]
    return out
