"""Build a report's sections from merged logs: one section per question users ask.

Everything here calls analyses and shapes their frames for display (units converted to MiB,
ms, %, time in seconds since the first event); nothing here plots.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis import compression as _compression  # aliases: sections of the same names
from kvdiag.diagnosis import delta_writes as _delta
from kvdiag.diagnosis import latency
from kvdiag.diagnosis import locality as _locality
from kvdiag.diagnosis import user_latency
from kvdiag.diagnosis.doctor import forecast_frame, run_rules
from kvdiag.diagnosis.engine_latency import engine_latency_frame
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.frames import Logs
from kvdiag.diagnosis.memory import allocator_fragmentation, breakdown, memory_over_time, pool_occupancy
from kvdiag.diagnosis.requests import request_table
from kvdiag.pool.hit_rate import counted, frame_hit_rate
from kvdiag.events.schema import (CollectorError, CollectorGap, CollectorStatus, EngineMetrics, KVPoolInfo,
                           ShadowBudget, ShadowCompression, ShadowDelta, ShadowLocality, ShadowLogits,
                           ShadowSharing)
from kvdiag.reports.hardware import kv_bandwidth_blocks, platform_section
from kvdiag.reports.document import Absent, Block, Chart, Report, Section, Table, Text


MAX_POINTS = 1500  # per series: charts stay light for million-event logs
MAX_REQUEST_ROWS = 200
MIB = 2 ** 20


def _secs(ts_ns, t0: int) -> np.ndarray:
    return (np.asarray(ts_ns, dtype="float64") - t0) / 1e9


def _thin(df: pd.DataFrame, by: Optional[str], y: str, n: int = MAX_POINTS) -> pd.DataFrame:
    """At most about ``n`` rows per ``by`` group: the group's rows in ``n / 2`` consecutive
    buckets, each bucket kept as its lowest and highest ``y`` (so peaks survive thinning)."""
    groups = [df] if by is None else [g for _, g in df.groupby(by, sort=False)]
    out = []
    for g in groups:
        if len(g) > n:
            g = g.reset_index(drop=True)
            bucket = (np.arange(len(g)) * (n // 2)) // len(g)
            yv = pd.Series(pd.to_numeric(g[y], errors="coerce").to_numpy(), index=g.index)
            keys = yv.groupby(bucket)
            keep = np.unique(np.r_[keys.idxmin().dropna().to_numpy(), keys.idxmax().dropna().to_numpy()]).astype(int)
            g = g.iloc[keep]
        out.append(g)
    return pd.concat(out, ignore_index=True) if out else df


def _hist(values: np.ndarray, bins: int = 50) -> tuple[np.ndarray, np.ndarray]:
    v = np.asarray(values, dtype="float64")
    v = v[np.isfinite(v)]
    counts, edges = np.histogram(v, bins=bins)
    return (edges[:-1] + edges[1:]) / 2, counts


def _fmt_ns(ns: Optional[int]) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + " UTC" if ns else "?"


def _status_order(f: Finding) -> int:
    return {"fail": 0, "warn": 1, "pass": 2, "n/a": 3}[f.status]


# ---------------------------------------------------------------- sections


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
                     "model": h.model, "events": n, "first event": _fmt_ns(first.get(node)),
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


def memory(logs: Logs, t0: int) -> Section:
    sec = Section("memory", "Memory over time",
                  "Why does memory keep growing, or why did we OOM: leak, fragmentation or demand?")
    mot = memory_over_time(logs)
    if mot.empty:
        sec.blocks.append(Absent("memory samples (NVML, torch allocator, KV pool, process RSS)",
                                 "record with `kvdiag demo` or `kvdiag attach PID`"))
        return sec
    multi = len(logs.nodes) > 1
    mot = mot.assign(series=(mot["node"] + ": " if multi else "") + mot["source"],
                     time_s=_secs(mot["ts_ns"], t0), MiB=mot["bytes"] / MIB)
    summary_tbl = mot.groupby(["node", "source"], sort=False)["MiB"].agg(
        first="first", last="last", peak="max").round(1).reset_index()
    sec.blocks.append(Chart("Memory by source", "line", _thin(mot, "series", "MiB"), "time_s", "MiB",
                            color="series", x_title="time (s)", y_title="MiB", table=summary_tbl))
    if not logs.has("nvml_sample"):
        sec.blocks.append(Absent("NVML (GPU) memory", "no GPU or no NVML where the log was recorded"))
    if not logs.has("allocator_sample"):
        sec.blocks.append(Absent("torch CUDA allocator statistics", "no CUDA device in the target"))
    for node in logs.nodes:
        bd = breakdown(logs, node)
        if bd.empty:
            continue
        bd = bd.assign(MiB=(bd["bytes"] / MIB).round(1))
        sec.blocks.append(Chart(f"Where memory goes ({node}, last sample)", "waterfall", bd,
                                "component", "MiB", y_title="MiB", options={"measure": "measure"},
                                table=bd[["component", "MiB", "measure"]]))
    return sec


def fragmentation(logs: Logs, t0: int, findings: list[Finding]) -> Section:
    sec = Section("fragmentation", "Block occupancy and fragmentation",
                  "How full are the KV blocks really (tokens, not just blocks)?")
    occ = pool_occupancy(logs)
    if occ.empty:
        sec.blocks.append(Absent("KV pool samples (KVPoolSample)", "the engine adapter emits them"))
    else:
        long = occ.melt(id_vars=["ts_ns", "node"],
                        value_vars=["block_occupancy", "token_occupancy", "fragmentation"],
                        var_name="measure", value_name="value").dropna(subset=["value"])
        long = long.assign(pct=long["value"] * 100, time_s=_secs(long["ts_ns"], t0),
                           series=(long["node"] + ": " if len(logs.nodes) > 1 else "") + long["measure"])
        tbl = long.groupby(["node", "measure"])["pct"].agg(mean="mean", max="max").round(1).reset_index()
        sec.blocks.append(Chart("KV pool occupancy (%)", "line", _thin(long, "series", "pct"), "time_s", "pct",
                                color="series", x_title="time (s)", y_title="%", table=tbl))
        sec.blocks.append(Text("block occupancy = blocks held by requests / pool blocks; token "
                               "occupancy = tokens held / (blocks held x block size); "
                               "fragmentation = 1 - token occupancy."))
    al = allocator_fragmentation(logs)
    if al.empty:
        sec.blocks.append(Absent("allocator fragmentation (torch CUDA allocator samples)",
                                 "no CUDA device in the target"))
    else:
        al = al.assign(pct=al["fragmentation"] * 100, time_s=_secs(al["ts_ns"], t0),
                       series=al["node"] + " gpu" + al["device"].astype(str))
        sec.blocks.append(Chart("Allocator: reserved but not allocated (%)", "line", _thin(al, "series", "pct"),
                                "time_s", "pct", color="series", x_title="time (s)", y_title="%",
                                table=al.groupby("series")["pct"].agg(mean="mean", max="max").round(1).reset_index()))
    frag = [f for f in findings if f.rule.startswith("fragmentation") or f.rule == "leak.fragmentation"]
    if frag:
        sec.blocks.append(Table("Fragmentation rules", pd.DataFrame(
            [{"status": f.status.upper(), "rule": f.rule, "measured": f.message} for f in frag])))
    return sec


def sharing(logs: Logs, t0: int, req: pd.DataFrame) -> Section:
    sec = Section("sharing", "Prefix sharing",
                  "How much does prefix sharing save on our traffic, and what would other sizes, "
                  "capacities and policies save?")
    done = counted(req[req["prompt_tokens"] > 0])
    if len(done):
        w = latency.quantiles_over_time(pd.DataFrame({"ts_ns": done["finished_ns"], "value_ns": 0.0}), 20)
        edges = np.r_[w["window_start_ns"].to_numpy(), w["window_end_ns"].to_numpy()[-1:]] if len(w) else []
        if len(edges):
            which = np.clip(np.searchsorted(edges, done["finished_ns"].to_numpy(), side="right") - 1, 0, len(w) - 1)
            g = done.assign(win=which).groupby("win")
            hr = pd.Series({win: 100 * frame_hit_rate(part) for win, part in g}, name="hit_rate_pct")
            hr = pd.DataFrame({"time_s": _secs(w["window_end_ns"].to_numpy()[hr.index], t0),
                               "hit_rate_pct": hr.to_numpy().round(1), "requests": g.size().to_numpy()})
            sec.blocks.append(Chart("Engine token hit rate over time (cached prompt tokens / prompt tokens)",
                                    "line", hr, "time_s", "hit_rate_pct", x_title="time (s)",
                                    y_title="%", table=hr))
        x, c = _hist(done["hit_rate"].to_numpy() * 100, 20)
        sec.blocks.append(Chart("Per-request hit rate", "histogram",
                                pd.DataFrame({"hit_rate_pct": x.round(1), "requests": c}),
                                "hit_rate_pct", "requests", x_title="hit rate (%)", y_title="requests",
                                table=pd.DataFrame({"hit_rate_pct": x.round(1), "requests": c})))
    else:
        sec.blocks.append(Absent("finished requests with prompt and cached token counts"))
    em = logs.frame(EngineMetrics)
    em = em.dropna(subset=["prefix_cache_queries_tokens", "prefix_cache_hits_tokens"]) if len(em) else em
    if len(em) > 1:
        d = em.groupby("node")[["prefix_cache_queries_tokens", "prefix_cache_hits_tokens"]].agg(lambda s: s.iloc[-1] - s.iloc[0])
        d["hit_rate_pct"] = (d["prefix_cache_hits_tokens"] / d["prefix_cache_queries_tokens"] * 100).round(1)
        sec.blocks.append(Table("Engine's own prefix-cache counters (/metrics, over the log)", d.reset_index()))
    sec.blocks += miss_causes_blocks(logs, t0)
    sh = logs.frame(ShadowSharing)
    if sh.empty:
        sec.blocks.append(Absent("what-if prefix sharing (ShadowSharing events)",
                                 "record with shadow sharing on, or run `kvdiag replay` on a trace"))
        return sec
    sh = sh.assign(capacity=sh["capacity_blocks"].map(lambda c: "unbounded" if c is None or (isinstance(c, float) and math.isnan(c)) else str(int(c))))
    sh["config"] = (sh["policy"].astype(str) + " / " + sh["block_size_tokens"].astype(str) + " tok / "
                    + sh["capacity"])
    ot = sh.assign(time_s=_secs(sh["ts_ns"], t0), token_hit_rate_pct=sh["token_hit_rate"] * 100)
    last = sh.groupby(["node", "config"], sort=False).tail(1)
    tbl = last[["node", "policy", "block_size_tokens", "capacity", "requests"]].assign(
        token_hit_rate_pct=(last["token_hit_rate"] * 100).round(1),
        block_hit_rate_pct=(last["block_hit_rate"] * 100).round(1),
        saved_MiB=(pd.to_numeric(last["bytes_saved"], errors="coerce") / MIB).round(1),
        engine_hit_rate_pct=(pd.to_numeric(last["engine_hit_rate"], errors="coerce") * 100).round(1))
    tbl["gap_pct_points"] = (tbl["token_hit_rate_pct"] - tbl["engine_hit_rate_pct"]).round(1)
    sec.blocks.append(Chart("What-if token hit rate over time, per configuration", "line",
                            _thin(ot, "config", "token_hit_rate_pct"), "time_s", "token_hit_rate_pct", color="config",
                            x_title="time (s)", y_title="%", table=tbl))
    bounded = last[last["capacity"] != "unbounded"].copy()
    if len(bounded):
        bounded["capacity_blocks"] = bounded["capacity"].astype(int)
        bounded["series"] = bounded["policy"].astype(str) + " / " + bounded["block_size_tokens"].astype(str) + " tok"
        bounded["token_hit_rate_pct"] = bounded["token_hit_rate"] * 100
        bounded = bounded.sort_values(["series", "capacity_blocks"])
        sec.blocks.append(Chart("Hit rate vs cache capacity, per policy and block size", "line", bounded,
                                "capacity_blocks", "token_hit_rate_pct", color="series",
                                x_title="capacity (blocks)", y_title="token hit rate (%)",
                                table=bounded[["series", "capacity_blocks", "token_hit_rate_pct"]].round(1)))
    saved = tbl.dropna(subset=["saved_MiB"])
    if len(saved):
        saved = saved.assign(config=saved["policy"].astype(str) + " / " + saved["block_size_tokens"].astype(str)
                             + " tok / " + saved["capacity"])
        sec.blocks.append(Chart("Memory saved by sharing (MiB)", "bar", saved, "config", "saved_MiB",
                                y_title="MiB", table=saved[["config", "saved_MiB"]]))
    if tbl["engine_hit_rate_pct"].notna().any():
        sec.blocks.append(Text("gap_pct_points = shadow token hit rate - the engine's own hit rate; a "
                               "large gap at the engine's block size and capacity means the engine "
                               "misses reuse its traffic allows."))
    return sec


def miss_causes_blocks(logs: Logs, t0: int, windows: int = 20) -> list[Block]:
    """Missed prompt tokens per window stacked by cause (:mod:`kvdiag.diagnosis.miss_causes`),
    about ``windows`` windows over the log, and the totals as a table."""
    from kvdiag.diagnosis.miss_causes import CAUSES, miss_causes_of_logs
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


def _with_curves(sec: Section, logs: Logs) -> Section:
    sec.blocks += capacity_curves(logs)
    return sec


def capacity_curves(logs: Logs, points: int = 24) -> list[Block]:
    """Hit rate vs capacity per node and tier (:mod:`kvdiag.simulation.capacity_curve`: the
    fold top and the exporter run, equal to ``kvdiag replay --curve``), from each node's log
    file; a dataset's frames lack the requests' stored blocks, so there a finished request
    adds only its prompt. A table gives the points at 0.5x..4x the pool."""
    from kvdiag.events import eventlog
    from kvdiag.simulation.capacity_curve import POOL_MULTIPLES, curve_of_events, curves_of_frames

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


def _vllm_recommendation(logs: Logs, tbl: pd.DataFrame) -> Optional[Block]:
    """The recommendation as vLLM's ``--kv-cache-dtype`` and the capacity it frees on the
    server's own pool (:func:`kvdiag.diagnosis.compression.engine_recommendation`), for the first
    vLLM log; None without one."""
    node = next((n for n, h in logs.headers.items() if h.engine == "vllm"), None)
    if node is None:
        return None
    info = logs.frame(KVPoolInfo)
    info = info[info["node"] == node]
    last = info.iloc[-1] if len(info) else None
    rec = _compression.engine_recommendation(
        tbl, "vllm", num_blocks=int(last["num_blocks"]) if last is not None else None,
        block_bytes=int(last["block_bytes"]) if last is not None else None,
        block_size_tokens=int(last["block_size_tokens"]) if last is not None else None)
    if rec.empty:
        return None
    rec = rec.assign(kv_MiB=pd.to_numeric(rec["kv_bytes"], errors="coerce") / MIB,
                     frees_MiB=pd.to_numeric(rec["frees_bytes"], errors="coerce") / MIB)
    return Table("In vLLM's terms: one --kv-cache-dtype for every layer, and the pool capacity it frees",
                 rec.drop(columns=["kv_bytes", "frees_bytes"]).round(4))


def compression(logs: Logs) -> Section:
    sec = Section("compression", "KV compression",
                  "Is KV compression safe for our model, layer by layer: what error, ratio, decode latency?")
    sc = logs.frame(ShadowCompression)
    if sc.empty:
        sec.blocks.append(Absent("shadow compression results (ShadowCompression events)",
                                 "record with shadow compression on (`kvdiag demo`)"))
        return sec
    sc = sc.copy()
    n_layers = int(sc["layer"].max()) + 1
    size = max(1, math.ceil(n_layers / 6))
    lo = (sc["layer"] // size) * size
    sc["layer_group"] = lo.astype(str) + "-" + np.minimum(lo + size - 1, n_layers - 1).astype(str)
    sc["error"] = pd.to_numeric(sc["attn_out_rel_error"], errors="coerce").fillna(
        sc[["k_rel_error", "v_rel_error"]].max(axis=1))
    sc["decode_us"] = pd.to_numeric(sc["decode_ns"], errors="coerce") / 1e3
    # optional fields that are null in every row arrive as objects
    tbl = _compression.compression_table(sc.drop(columns=["layer_group", "error", "decode_us"]).assign(
        **{c: pd.to_numeric(sc[c], errors="coerce") for c in
           ("attn_score_error", "attn_out_rel_error", "encode_ns", "decode_ns")}))
    rec = _compression.recommend(tbl)
    sampling = _compression.sampling_summary(logs.frame(ShadowBudget))
    if sampling:
        sec.blocks.append(Text(f"Sampling: {sampling}. Each figure below rests on the sampled steps "
                               "in its row (`steps`); attn_out_rel_error_lo/_hi bound its mean with a "
                               "95% interval resampling whole steps."))
    sec.blocks.append(Table("Per layer group and method (means)", tbl))
    pts = sc.groupby(["method", "layer"]).agg(ratio=("ratio", "mean"), error=("error", "mean")).reset_index()
    pts["error_pct"] = pts["error"] * 100
    sec.blocks.append(Chart("Error vs compression ratio (one point per method and layer)", "scatter",
                            pts, "ratio", "error_pct", color="method", x_title="ratio (x)",
                            y_title="relative error (%)",
                            table=pts.groupby("method")[["ratio", "error_pct"]].mean().round(3).reset_index()))
    sec.blocks.append(Table("Recommendation per layer group", rec))
    engine_rec = _vllm_recommendation(logs, tbl)
    if engine_rec is not None:
        sec.blocks.append(engine_rec)
    lg = logs.frame(ShadowLogits)
    if len(lg):
        g = lg.groupby("method")
        sec.blocks.append(Table("Whole model with compressed KV: next-token agreement (teacher forced)",
                                pd.DataFrame({"tokens": g["tokens"].sum(), "kl_divergence": g["kl_divergence"].mean(),
                                              "top1_agreement": g["top1_agreement"].mean()}).round(4).reset_index()))
    dec = sc.dropna(subset=["decode_us"])
    if len(dec):
        dec = dec.assign(seq=np.where(dec["seq_len_tokens"] > 512, "> 512 tokens", "<= 512 tokens"))
        sec.blocks.append(Table("Decode time by sequence length (median µs)",
                                dec.pivot_table(index="method", columns="seq", values="decode_us",
                                                aggfunc="median").round(1).reset_index()))
    return sec


def differential(logs: Logs) -> Section:
    sec = Section("differential", "Differential KV writes",
                  "How many bytes do KV blocks written out of the pool need: in full, deduplicated, "
                  "as a delta against a stored block or their previous version?")
    de = logs.frame(ShadowDelta)
    if de.empty:
        sec.blocks.append(Absent("differential write measurements (ShadowDelta events)",
                                 "record with `kvdiag shadow --delta --log FILE`"))
        return sec
    tbl = _delta.delta_table(de)
    bound = sorted({float(b) for b in de["error_bound"]})
    sec.blocks.append(Text(
        f"{len(de):,} block-layer writes; savings are fractions of the bytes written in full. Dedup is "
        f"lossless; delta and quantization-only keep every element within {', '.join(f'{b:g}' for b in bound)} "
        f"x the rms of its (K/V, head); quant_saving is quantization alone at that bound, and "
        f"delta_vs_quant_referenced what a stored reference saves beyond it where one was used."))
    sec.blocks.append(Table("Per layer group (1-based): savings, references used, errors, µs per block-layer",
                            tbl.round(4)))
    per = _delta.by_layer(de)
    long = per.melt(id_vars="layer", value_vars=["dedup_saving", "delta_saving", "quant_saving"],
                    var_name="encoding", value_name="saving")
    sec.blocks.append(Chart("Write-bandwidth saving per layer (0-based)", "line", long, "layer", "saving",
                            color="encoding", x_title="layer", y_title="fraction of full bytes saved",
                            table=per.round(4)))
    return sec


def locality(logs: Logs) -> Section:
    sec = Section("locality", "Attention locality",
                  "Where does attention go, head by head: recent window, sinks, heavy hitters?")
    lo = logs.frame(ShadowLocality)
    if lo.empty:
        sec.blocks.append(Absent("attention locality samples (ShadowLocality events)",
                                 "record with attention capture on (`kvdiag demo`)"))
        return sec
    for col, title in (("recent_mass", "Attention mass on the most recent 20% of positions"),
                       ("outside_share", "Each head's share of its layer's non-recent mass")):
        v = pd.to_numeric(lo[col], errors="coerce")
        if v.notna().any():
            m = lo.assign(v=v).pivot_table(index="layer", columns="head", values="v", aggfunc="mean")
            sec.blocks.append(Chart(title + " (layers x heads)", "heatmap", m, x_title="head",
                                    y_title="layer", table=m.round(3).reset_index()))
    per_layer = lo.groupby("layer")[["recent_mass", "sink_mass", "other_mass"]].mean()
    long = per_layer.reset_index().melt(id_vars="layer", var_name="mass", value_name="share")
    sec.blocks.append(Chart("Mean attention mass per layer", "line", long, "layer", "share", color="mass",
                            x_title="layer", y_title="share of attention", table=per_layer.round(3).reset_index()))
    sec.blocks.append(Table("Top-3 heads by share of the layer's non-recent attention",
                            _locality.top_heads(lo).astype({"top_heads": str})))
    prof = _locality.distance_profile(lo).set_index("layer")
    if prof.shape[1]:
        sec.blocks.append(Chart("Attention mass by distance (layers x distance bins, tokens)", "heatmap",
                                prof, x_title="distance", y_title="layer", table=prof.round(3).reset_index()))
    return sec


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
    long = long.assign(ms=long["s"] * 1e3, time_s=_secs(long["ts_ns"], t0), measure=long["measure"].map(ENGINE_LATENCY))
    long["series"] = (long["node"] + ": " if len(logs.nodes) > 1 else "") + long["measure"]
    tbl = long.groupby(["node", "measure"], sort=False)["ms"].agg(intervals="size", median="median", max="max")
    return [Chart("Engine-reported TTFT and inter-token latency, P50 / P99 per scrape interval (ms)", "line",
                  _thin(long, "series", "ms"), "time_s", "ms", color="series", x_title="time (s)", y_title="ms",
                  table=tbl.round(2).reset_index()),
            Text("From the engine's own /metrics histograms: the bucket increase between two scrapes, "
                 "interpolated within its bucket as PromQL's histogram_quantile does (a quantile past the "
                 "highest finite bucket shows as that bound); intervals without observations are left out.")]


def latency_section(logs: Logs, t0: int, lat: pd.DataFrame, comps: list[latency.Comparison],
                    baseline: Optional[Logs]) -> Section:
    sec = Section("latency", "Latency and P99 regressions",
                  "Why did P99 latency jump, and what changed?")
    any_data = False
    qrows = []
    for metric in latency.METRICS:
        s = latency.samples(logs, metric, lat)
        if s.empty:
            continue
        any_data = True
        label = latency.METRIC_LABELS[metric]
        parts = [("current" if baseline is not None else "all", s)]
        if baseline is not None:
            parts.append(("baseline", latency.samples(baseline, metric)))
        hist = []
        for name, p in parts:
            x, c = _hist(p["value_ns"].to_numpy() / 1e6, 40)
            hist.append(pd.DataFrame({"ms": x.round(3), "count": c, "log": name}))
        h = pd.concat(hist, ignore_index=True)
        sec.blocks.append(Chart(f"Distribution: {label} (ms)", "histogram", h, "ms", "count",
                                color="log" if baseline is not None else None, x_title="ms", y_title="count",
                                table=None))
        ot = latency.quantiles_over_time(s, 20)
        if len(ot):
            long = ot.melt(id_vars=["window_end_ns", "n"], value_vars=["p50_ns", "p95_ns", "p99_ns"],
                           var_name="quantile", value_name="ns")
            long = long.assign(time_s=_secs(long["window_end_ns"], t0), ms=long["ns"] / 1e6,
                               quantile=long["quantile"].str.replace("_ns", ""))
            sec.blocks.append(Chart(f"{label}: P50 / P95 / P99 over time (ms)", "line", long, "time_s", "ms",
                                    color="quantile", x_title="time (s)", y_title="ms",
                                    table=ot.assign(time_s=_secs(ot["window_end_ns"], t0).round(1),
                                                    p50_ms=ot["p50_ns"] / 1e6, p95_ms=ot["p95_ns"] / 1e6,
                                                    p99_ms=ot["p99_ns"] / 1e6)[["time_s", "n", "p50_ms", "p95_ms", "p99_ms"]].round(2)))
        groups = [("all", s)] + ([(n, g) for n, g in s.groupby("node")] if len(logs.nodes) > 1 else [])
        for node, g in groups:
            q = latency.quantiles_ci(g["value_ns"].to_numpy())
            for r in q.itertuples():
                qrows.append({"metric": metric, "node": node, "quantile": f"P{r.quantile * 100:g}",
                              "ms": round(r.value / 1e6, 2),
                              "95% CI": f"{r.ci_low / 1e6:.2f} .. {r.ci_high / 1e6:.2f}", "n": r.n})
    engine = engine_latency(logs, t0)
    sec.blocks += engine
    if not any_data and not engine:
        sec.blocks.append(Absent("latency samples (finished requests, engine steps, the engine's "
                                 "/metrics histograms)"))
        return sec
    if qrows:
        sec.blocks.insert(0, Table("Percentiles with bootstrap 95% confidence intervals", pd.DataFrame(qrows)))
    if comps:
        rows = [{"metric": c.metric, "flagged": "REGRESSION" if c.flagged else "no",
                 "compared": f"P{c.quantile * 100:g}, {c.method}",
                 "before_ms": round(c.q_baseline_ns / 1e6, 2), "after_ms": round(c.q_current_ns / 1e6, 2),
                 "change": f"{c.change:+.1%}", "90% CI": f"{c.ci_low:+.1%} .. {c.ci_high:+.1%}",
                 "threshold": f"{c.threshold:+.0%}", "Cliff's delta": round(c.cliffs_delta, 3),
                 "n before/after": f"{c.n_baseline}/{c.n_current}",
                 "split_at_s": round((c.current_window_ns[0] - t0) / 1e9, 1) if baseline is None else None}
                for c in comps]
        what = "against the baseline log" if baseline is not None else "inside the log"
        sec.blocks.append(Table(f"P99 comparison {what}", pd.DataFrame(rows),
                                note="P99 with >= 100 samples per side; with fewer, P90 or P50 between the "
                                     "log's halves, flagged only past the gross-shift limit (rules.py)"))
        causes = [{"metric": c.metric, "cause": k.cause, "supported": "YES" if k.supported else "no",
                   "evidence": k.message} for c in comps if c.flagged for k in c.causes]
        if causes:
            sec.blocks.append(Table("Candidate causes of the flagged regressions (supported first)",
                                    pd.DataFrame(causes)))
    return sec


def requests(req: pd.DataFrame) -> Section:
    sec = Section("requests", "Requests", "How much KV cache does each request hold, and how was it served?")
    if req.empty:
        sec.blocks.append(Absent("finished requests (RequestFinished events)"))
        return sec
    view = pd.DataFrame({
        "node": req["node"], "request_id": req["request_id"], "status": req["status"],
        "prompt_tokens": req["prompt_tokens"], "output_tokens": req["output_tokens"],
        "cached_tokens": req["cached_prompt_tokens"], "hit_rate_pct": (req["hit_rate"] * 100).round(1),
        "kv_MiB": (req["kv_bytes"] / MIB).round(2), "blocks": req["blocks_allocated"] + req["blocks_reused"],
        "block_MiB": (req["block_bytes_held"] / MIB).round(2), "preemptions": req["preemptions"],
        "ttft_ms": (req["ttft_ns"] / 1e6).round(1), "e2e_ms": (req["e2e_ns"] / 1e6).round(1),
        "per_token_ms": (req["per_token_ns"] / 1e6).round(2)})
    x, c = _hist(view["kv_MiB"].to_numpy(), 30)
    if np.isfinite(view["kv_MiB"].to_numpy(dtype="float64")).any():
        sec.blocks.append(Chart("KV bytes per request (MiB)", "histogram",
                                pd.DataFrame({"kv_MiB": x.round(2), "requests": c}), "kv_MiB", "requests",
                                x_title="MiB", y_title="requests"))
    sec.blocks.append(Chart("Prompt length vs time to first token", "scatter",
                            _thin(view, None, "ttft_ms"), "prompt_tokens", "ttft_ms", color="node" if view["node"].nunique() > 1 else None,
                            x_title="prompt tokens", y_title="TTFT (ms)",
                            table=view[["prompt_tokens", "ttft_ms"]].describe().round(1).reset_index()))
    top = view.sort_values("e2e_ms", ascending=False).head(MAX_REQUEST_ROWS)
    note = (f"{len(view)} requests; showing the {len(top)} slowest (end to end)"
            if len(view) > len(top) else f"{len(view)} requests, slowest first")
    sec.blocks.append(Table("Per-request KV and latency", top, note=note))
    return sec


def health(logs: Logs, problems: list[str]) -> Section:
    sec = Section("health", "Collector health", "Can these numbers be trusted: what was not observed?")
    st = logs.frame(CollectorStatus)
    if len(st):
        sec.blocks.append(Table("Collectors", st[["node", "collector", "available", "hint"]]
                                .drop_duplicates(["node", "collector"], keep="last")))
    gaps = logs.frame(CollectorGap)
    if len(gaps):
        g = gaps.assign(gap_s=(gaps["end_ns"] - gaps["start_ns"]) / 1e9).groupby(["node", "collector"]).agg(
            gaps=("gap_s", "size"), seconds=("gap_s", "sum"), dropped_events=("dropped_events", "sum"))
        sec.blocks.append(Table("Gaps (events dropped)", g.round(2).reset_index()))
    errs = logs.frame(CollectorError)
    if len(errs):
        e = errs.groupby(["node", "collector", "message"]).agg(count=("count", "sum")).reset_index()
        sec.blocks.append(Table("Errors caught in collectors and shadow tasks", e))
    if problems:
        sec.blocks.append(Table("Unreadable log lines (skipped)", pd.DataFrame({"problem": problems[:20]}),
                                note=f"{len(problems)} in all"))
    if not (len(st) or len(gaps) or len(errs) or problems):
        sec.blocks.append(Text("No collector reported its status, a gap or an error; every log line was read."))
    return sec


def forecast(logs: Logs, t0: int) -> Optional[Chart]:
    fc = forecast_frame(logs)
    if fc.empty:
        return None
    long = fc.melt(id_vars=["ts_ns", "node"], value_vars=["needed_blocks", "free_blocks"],
                   var_name="blocks", value_name="count")
    long = long.assign(time_s=_secs(long["ts_ns"], t0),
                       series=(long["node"] + ": " if len(logs.nodes) > 1 else "") + long["blocks"])
    return Chart("Forecast: blocks the active requests still need vs free blocks", "line",
                 _thin(long, "series", "count"), "time_s", "count", color="series", x_title="time (s)",
                 y_title="blocks", table=fc[["needed_blocks", "free_blocks", "need_ratio"]].describe().round(2).reset_index())


def build(logs: Logs, baseline: Optional[Logs] = None, problems: Optional[list[str]] = None,
          title: str = "kvdiag report", fleet: Optional[pd.DataFrame] = None
          ) -> tuple[Report, list[Finding]]:
    """The whole report, and the findings behind its summary; ``fleet``: the per-node table
    of ``diagnosis.fleet`` when the input holds Parquet datasets."""
    problems = problems or []
    findings, comps = run_rules(logs, baseline)
    t0 = logs.time_range_ns()[0]
    lat = latency.request_latency(logs)
    req = request_table(logs, lat)
    mem = memory(logs, t0)
    fc = forecast(logs, t0)
    if fc is not None:
        mem.blocks.append(fc)
    t_lo, t_hi = logs.time_range_ns()
    sub = (f"{len(logs.nodes)} node(s): {', '.join(logs.nodes)}; {logs.num_events():,} events from "
           f"{_fmt_ns(t_lo)} to {_fmt_ns(t_hi)}"
           + (f"; baseline: {', '.join(baseline.paths.values())}" if baseline is not None else ""))
    lat_sec = latency_section(logs, t0, lat, comps, baseline)
    lat_sec.blocks += kv_bandwidth_blocks(logs, t0, _thin)  # beside P99: the checklist's bandwidth item
    sections = [summary(logs, findings, problems, lat, fleet), mem, fragmentation(logs, t0, findings),
                _with_curves(sharing(logs, t0, req), logs), compression(logs), differential(logs),
                locality(logs), lat_sec, requests(req), health(logs, problems)]
    platforms = platform_section(logs, baseline)
    if platforms is not None:
        sections.insert(1, platforms)
    return Report(title, sub, sections), findings
