"""The article's two checklists and kvdiag's own checks as rules over events, each a
:class:`Finding`. Thresholds and verdicts come from :mod:`kvdiag.diagnosis.rules`; ``doctor``,
``report`` and ``top``'s alerts all call :func:`run_rules`.

Memory leak: ``leak.memory_growth`` (process memory grows without matching KV growth),
``leak.release_paths`` (finished requests whose blocks were never given back),
``leak.double_release``, ``leak.pool_growth`` (:mod:`kvdiag.diagnosis.leaks`),
``fragmentation.kv_pool`` / ``fragmentation.allocator`` (:mod:`kvdiag.diagnosis.pool_fragmentation`,
:mod:`kvdiag.diagnosis.fragmentation`),
``leak.oom`` (OOMs, allocator retries).
P99 spike: ``p99.regression`` (a P99 shift inside the log or against a baseline) and one
``p99.<cause>`` rule per candidate cause (:mod:`kvdiag.diagnosis.causes`); the article's four
questions (:data:`P99_CHECKLIST`) are answered by four of them.
Forecast: ``forecast.memory_pressure`` (KV the active requests still need vs free blocks).
Latency as users see it: ``latency.queueing`` (queue wait dominating TTFT, arrivals
outpacing completions: :mod:`kvdiag.diagnosis.user_latency`).
Sharing: ``sharing.consistency`` (the engine's prefix hit rate vs the content's, measured by
the shadow cache at the engine's settings). Pool: ``pool.preemptions``. Observation:
``kv_events.gaps`` (batches of the engine's KV event stream lost by the subscriber),
``kv_events.health`` (the stream's consistency: :mod:`kvdiag.pool.kv_stream_health`).
Engine numbers: ``engine.number_traps`` (the engine's own usage gauge and prefix counters
against kvdiag's recount: :mod:`kvdiag.diagnosis.engine_numbers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis import fragmentation as _allocator_fragmentation
from kvdiag.diagnosis import pool_fragmentation as _pool_fragmentation
from kvdiag.diagnosis import bandwidth, block_facts, engine_numbers, latency, latency_regression, user_latency
from kvdiag.pool import pressure
from kvdiag.pool.hit_rate import counted, frame_hit_rate
from kvdiag.diagnosis import leaks as _leaks
from kvdiag.diagnosis import rules
from kvdiag.diagnosis.findings import Finding
from kvdiag.simulation.live_sharing import headline_config, sharing_window
from kvdiag.diagnosis.frames import Logs
from kvdiag.diagnosis.memory import allocator_fragmentation, cum_at, growth, kv_pool_bytes
from kvdiag.pool.blockfacts import FACTS_TAG, KV_BATCHES_TAG, KV_HEALTH_COLUMNS, KV_HEALTH_TAG
from kvdiag.pool.prefix_cache import DUPLICATE_BATCH_MESSAGE, VLLM_KV_EVENTS_COLLECTOR
from kvdiag.events.schema import (AllocatorSample, BlockAllocated, BlockDeduplicated, BlockEvicted, CollectorError,
                           BlockReleased, CollectorGap, EngineMetrics, EngineStep, KVPoolInfo,
                           KVPoolSample, NvmlSample, PrefixHit, ProcessSample, RequestArrived, RequestFirstToken,
                           RequestFinished, RequestPreempted, RequestScheduled, ShadowSharing)

_NEVER_NS = 2 ** 62  # a time after any log (exact as a float, unlike int64 max)


def _process_memory(logs: Logs) -> tuple[str, Optional[pd.DataFrame]]:
    """The best measure of the process's memory: NVML per-process, NVML device, torch
    reserved, else host RSS summed over processes. Returns (label, frame ts_ns/node/key/bytes)."""
    nv = logs.frame(NvmlSample)
    for col, label in (("process_memory_bytes", "NVML process memory"),
                       ("memory_used_bytes", "NVML device memory")):
        if len(nv) and nv[col].notna().any():
            d = nv[nv[col].notna()]
            return label, pd.DataFrame({"ts_ns": d["ts_ns"], "node": d["node"],
                                        "key": d["device"], "bytes": d[col].astype("float64")})
    al = logs.frame(AllocatorSample)
    if len(al):
        return "torch reserved", pd.DataFrame({"ts_ns": al["ts_ns"], "node": al["node"],
                                               "key": al["device"], "bytes": al["reserved_bytes"]})
    ps = logs.frame(ProcessSample)
    if len(ps):
        return "host RSS", pd.DataFrame({"ts_ns": ps["ts_ns"], "node": ps["node"],
                                         "key": ps["pid"], "bytes": ps["rss_bytes"]})
    return "", None


def _serving_since_ns(logs: Logs) -> dict:
    """Per node, when serving began: the end of its first engine step (before it, memory grows
    by loading the model, allocating the KV pool and the first forward's one-time costs:
    weights paged in from a memory-mapped file, buffers: warm-up, not growth while serving);
    on a node without engine steps, its first finished request; without either, its first
    scrape of the engine's metrics (a client that joined an engine already serving). A node
    with none of these has not served yet (model load) and is absent."""
    since: dict = {}
    st = logs.frame(EngineStep)
    if len(st):
        since.update((st["ts_ns"] + st["duration_ns"]).groupby(st["node"]).min().to_dict())
    for cls in (RequestFinished, EngineMetrics):
        f = logs.frame(cls)
        if len(f):
            for node, ts in f.groupby("node")["ts_ns"].min().items():
                since.setdefault(node, ts)
    return since


def memory_growth(logs: Logs) -> Finding:
    """Growth of process memory (median of the last 10% of samples minus the first 10%,
    summed over devices/processes) minus the KV pool's growth (blocks held by requests and
    the prefix cache x block bytes) over the same span: per node, its serving window
    (:func:`_serving_since_ns`: model load and the first engine step are outside it; a node
    that has not served yet is not judged)."""
    title = "memory grows only with the KV cache"
    label, mem = _process_memory(logs)
    if mem is None or mem.empty:
        return Finding("leak.memory_growth", "n/a", title, "no memory samples (NVML, allocator, RSS)")
    since = _serving_since_ns(logs)
    mem = mem[mem["node"].isin(since) & (mem["ts_ns"] >= mem["node"].map(since))]
    if mem.empty:
        return Finding("leak.memory_growth", "n/a", title,
                       "no engine step yet: model load and warm-up are not judged as growth")
    mem_growth = start = 0.0
    measured = False
    for _, g in mem.groupby(["node", "key"]):
        gr = growth(g["ts_ns"].to_numpy(), g["bytes"].to_numpy())
        if gr is not None:
            measured = True
            mem_growth += gr
            start += float(np.median(g.sort_values("ts_ns")["bytes"].to_numpy()[:max(2, len(g) // 10)]))
    if not measured:
        most = int(mem.groupby(["node", "key"]).size().max())
        return Finding("leak.memory_growth", "n/a", title,
                       rules.too_few(most, rules.MIN_MEMORY_SAMPLES,
                                     f"{label} samples since serving began (first engine step)"),
                       {"samples": most, "needed": rules.MIN_MEMORY_SAMPLES})
    kv = kv_pool_bytes(logs)
    kv = kv[kv["node"].isin(since) & (kv["ts_ns"] >= kv["node"].map(since))]
    kv_growth = 0.0
    for _, g in kv.groupby("node"):
        kv_growth += growth(g["ts_ns"].to_numpy(), (g["used_bytes"] + g["cached_bytes"]).to_numpy()) or 0.0
    unexplained = mem_growth - max(kv_growth, 0.0)
    share = unexplained / start if start > 0 else 0.0
    status = rules.growth_status(share, unexplained)
    return Finding("leak.memory_growth", status, title,
                   f"{label} grew {mem_growth / 2**20:+.1f} MiB after warm-up, KV cache {kv_growth / 2**20:+.1f} MiB: "
                   f"{unexplained / 2**20:+.1f} MiB ({share:+.1%}) unexplained "
                   f"(fail at >= {rules.GROWTH_FAIL[0]:.0%} and {rules.GROWTH_FAIL[1] >> 20} MiB)",
                   {"source": label, "memory_growth_bytes": mem_growth, "kv_growth_bytes": kv_growth,
                    "unexplained_bytes": unexplained, "start_bytes": start, "share": share})


_LEDGER_EVENTS = (RequestArrived, RequestFinished, KVPoolInfo, BlockAllocated, PrefixHit,
                  BlockDeduplicated, BlockReleased, BlockEvicted)


def _events(logs: Logs, node: str, classes) -> list:
    """Events of ``node`` rebuilt from its frames, in time order (for analyses that replay
    events)."""
    out = []
    for cls in classes:
        df = logs.frame(cls)
        df = df[df["node"] == node].drop(columns="node")
        fields = list(df.columns)
        out += [(row[0], cls(**dict(zip(fields, row[1:])))) for row in
                zip(df["ts_ns"].to_numpy(), *(df[c].tolist() for c in fields))]
    return [ev for _, ev in sorted(out, key=lambda p: p[0])]


def _prefill_spans(logs: Logs, node: str):
    """:func:`kvdiag.diagnosis.leaks.prefill_spans` of ``node``'s requests."""
    def mine(cls) -> pd.DataFrame:
        f = logs.frame(cls)
        return f[f["node"] == node]
    return _leaks.prefill_spans(mine(RequestArrived), mine(RequestScheduled), mine(RequestFirstToken),
                                mine(RequestFinished))


def release_paths(logs: Logs) -> list[Finding]:
    """Every finished request gave back every block it held, no block was released twice, and
    occupancy does not grow at constant load: :func:`kvdiag.diagnosis.leaks.leak_findings` per
    node, judged at the node's last event (not at its last block event). Without block events
    (a log of an engine that reports none, or ``kvdiag top``, whose own ledger decides the
    first two), only ``leak.pool_growth`` is judged."""
    kp, last = logs.frame(KVPoolSample), logs.last_ts_ns()
    if not logs.has(BlockAllocated) and not logs.has(PrefixHit):
        return [Finding("leak.release_paths", "n/a", "release paths fire for finished requests",
                        "no block events in the log"),
                *(_leaks.pool_growth_finding(kp[kp["node"] == node], prefill=_prefill_spans(logs, node))
                  for node in logs.nodes)]
    found = [f for node in logs.nodes for f in _leaks.leak_findings(
        _events(logs, node, _LEDGER_EVENTS), pool_samples=kp[kp["node"] == node], now_ns=last[node],
        prefill=_prefill_spans(logs, node))]
    # the checklist's rule keeps its id (top's alerts and scripts key on it)
    return [replace(f, rule="leak.release_paths") if f.rule == "leak.finished_holding" else f
            for f in found]


def fragmentation(logs: Logs) -> list[Finding]:
    """Pool fragmentation (empty token slots / token slots of used blocks, over all samples)
    and the allocator's, against :data:`kvdiag.diagnosis.rules.FRAGMENTATION_LIMIT`."""
    out = []
    kp, al = logs.frame(KVPoolSample), logs.frame(AllocatorSample)
    for node in logs.nodes:
        bs = logs.block_size_tokens(node)
        if bs and (kp["node"] == node).any():
            pool = _pool_fragmentation.kv_pool_frame(kp[kp["node"] == node], bs, logs.bytes_per_token(node))
            out.append(_pool_fragmentation.kv_pool_fragmentation_finding(pool))
        if (al["node"] == node).any():
            out.append(_allocator_fragmentation.allocator_fragmentation_finding(samples=al[al["node"] == node]))
    return out or [_pool_fragmentation.kv_pool_fragmentation_finding(_pool_fragmentation.kv_pool_frame(None, 0))]


def ooms(logs: Logs) -> Finding:
    """No out-of-memory errors and no allocator retries (cudaMalloc failed, cache flushed)."""
    title = "no OOMs or allocator retries"
    al = allocator_fragmentation(logs)
    failed = logs.frame(RequestFinished)
    failed = failed[failed["status"] == "failed"]
    if al.empty:
        msg = "no allocator samples (no CUDA allocator)"
        if len(failed):
            return Finding("leak.oom", rules.oom_status(0, 0, len(failed)), title, f"{msg}; {len(failed)} requests failed",
                           {"failed_requests": failed["request_id"].tolist()[:100]})
        return Finding("leak.oom", "n/a", title, msg)
    g = al.groupby(["node", "device"])
    n_oom = int((g["num_ooms"].max() - g["num_ooms"].min()).sum())
    n_retry = int((g["alloc_retries"].max() - g["alloc_retries"].min()).sum())
    status = rules.oom_status(n_oom, n_retry, len(failed))
    first = al[al["num_ooms"] > al.groupby(["node", "device"])["num_ooms"].transform("min")]
    return Finding("leak.oom", status, title,
                   f"{n_oom} OOMs, {n_retry} allocator retries, {len(failed)} failed requests",
                   {"ooms": n_oom, "alloc_retries": n_retry, "failed_requests": len(failed),
                    "first_oom_ts_ns": int(first["ts_ns"].min()) if len(first) else None})


def p99(logs: Logs, baseline: Optional[Logs] = None,
        threshold: float = rules.P99_THRESHOLD) -> tuple[list[Finding], list[latency.Comparison]]:
    """``p99.regression``: fail when any latency (TTFT, TPOT, engine step) regressed past
    ``threshold`` at P99, or, with too few samples for P99, grossly at P90/P50 (module
    :mod:`kvdiag.diagnosis.latency_regression`, :func:`~kvdiag.diagnosis.latency_regression.detect_all`); the message
    says what each comparison compared and which latencies had too few samples (``n/a (N of M
    needed)``). One ``p99.<cause>`` per candidate cause: warn when it is supported for a
    flagged regression, pass otherwise."""
    comps, skipped = latency_regression.detect_all(logs, baseline, threshold)
    title = f"P99 latency stable (no rise beyond {threshold:+.0%}; TTFT, TPOT, engine steps)"
    gaps = "; ".join(s.describe() for s in skipped)
    if not comps:
        return [Finding("p99.regression", "n/a", title, gaps or "no latency samples",
                        {"skipped": [s.to_dict() for s in skipped]}),
                *(Finding(f"p99.{name}", "n/a", _CAUSE_TITLES[name],
                          f"no P99 comparison; over the log: {_over_log(logs, name)}")
                  for name, _ in P99_CHECKLIST)], comps
    flagged = [c for c in comps if c.flagged]
    desc = "; ".join([c.describe() for c in comps] + ([gaps] if gaps else []))
    out = [Finding("p99.regression", rules.p99_regression_status(len(flagged)), title, desc,
                   {"comparisons": [c.to_dict() for c in comps], "skipped": [s.to_dict() for s in skipped]})]
    supported: dict[str, list] = {}
    titles: dict[str, str] = {}
    measured_causes: dict[str, str] = {}  # what an unsupported cause measured, first flagged metric
    for c in flagged:
        for cause in c.causes:
            titles[cause.cause] = cause.title
            if cause.supported:
                supported.setdefault(cause.cause, []).append((c.metric, cause))
            else:
                measured_causes.setdefault(cause.cause, f"{c.metric}: {cause.message}")
    measured = bandwidth.summarize(logs)
    for name, ttl in _CAUSE_TITLES.items():
        hits = supported.get(name, [])
        if hits:
            out.append(Finding(f"p99.{name}", "warn", ttl,
                               "; ".join(f"{m}: {c.message}" for m, c in hits),
                               {m: c.evidence for m, c in hits}))
        elif name == "kv_bandwidth" and not measured.steps:
            out.append(Finding(f"p99.{name}", "n/a", ttl, "no engine steps with KV blocks to measure"))
        else:
            msg = (f"not behind the regression ({measured_causes[name]})" if name in measured_causes
                   else "not behind the regression" if flagged else "no P99 regression to explain")
            if name == "kv_bandwidth":  # the checklist asks how busy it is: say so either way
                out.append(Finding(f"p99.{name}", "pass", ttl, f"{msg}; over the log: {bandwidth.describe(measured)}",
                                   {"log": measured.to_dict()}))
            else:
                out.append(Finding(f"p99.{name}", "pass", ttl, msg))
    return out, comps


P99_CHECKLIST = (
    ("compression", "Was the compression/decompression path triggered?"),
    ("kv_bandwidth", "How busy is the memory bandwidth?"),
    ("prefix_hit_rate", "Does the cache hit rate fluctuate?"),
    ("long_sequences", "Did abnormally long sequences arrive?"),
)
"""The article's checklist for a P99 spike, in its order: the item and the ``p99.<item>`` rule
that answers it."""


def _over_log(logs: Logs, item: str) -> str:
    """What the log shows for one checklist item when no comparison can judge it."""
    if item == "kv_bandwidth":
        return bandwidth.describe(bandwidth.summarize(logs))
    if item == "compression":
        return f"{len(logs.frame('shadow_compression'))} compression runs"
    fin = logs.frame(RequestFinished)
    if fin.empty:
        return "no finished requests"
    if item == "prefix_hit_rate":
        rate, n = frame_hit_rate(fin), len(counted(fin))
        return ("token hit rate N/A (no request finished normally)" if rate is None else
                f"token hit rate {rate:.1%} over {n} requests that finished normally")
    p = fin["prompt_tokens"].to_numpy(dtype="float64")
    return f"prompts P50 {np.median(p):.0f}, P90 {np.quantile(p, 0.9):.0f}, longest {p.max():.0f} tokens"


def p99_checklist(findings: list[Finding]) -> list[tuple[str, Finding]]:
    """The article's four P99 questions, each with the finding that answers it (status n/a
    where the P99 rules did not run)."""
    by_rule = {f.rule: f for f in findings}
    return [(question, by_rule.get(f"p99.{item}") or Finding(f"p99.{item}", "n/a", question, "not evaluated"))
            for item, question in P99_CHECKLIST]


_CAUSE_TITLES = {
    "compression": "compression path not behind a P99 rise",
    "kv_bandwidth": "KV bandwidth utilisation steady",
    "prefix_hit_rate": "prefix hit rate steady",
    "long_sequences": "no burst of abnormally long sequences",
    "memory_pressure": "no rise in memory pressure, preemptions or evictions",
    "fragmentation": "no rise in fragmentation",
    "queueing": "no rise in queue wait",
}


def forecast_frame(logs: Logs, window_ns: int = 10_000_000_000) -> pd.DataFrame:
    """Per KVPoolSample: the blocks the active requests will still need, against free blocks.

    Active requests at t: admitted <= t < finished. Active, expected, needed and free blocks and their
    ratio are defined in :mod:`kvdiag.pool.pressure` (the exporter evaluates the same
    functions live): prefix hits count from the moment they happen, and requests without
    max_new_tokens are assumed to produce the P90 output length of the log's finished requests. ``growth_blocks_per_s`` = decode
    tokens per second over the last ``window_ns`` / block size; ``time_to_full_s`` =
    free / growth when the need exceeds the free blocks, else inf."""
    cols = ["ts_ns", "node", "active_requests", "needed_blocks", "free_blocks",
            "growth_blocks_per_s", "need_ratio", "time_to_full_s"]
    kp = logs.frame(KVPoolSample)
    arr, fin = logs.frame(RequestArrived), logs.frame(RequestFinished)
    out = []
    for node in logs.nodes:
        s = kp[kp["node"] == node]
        bs = logs.block_size_tokens(node)
        a = arr[arr["node"] == node].drop_duplicates("request_id")
        if s.empty or not bs or a.empty:
            continue
        f = fin[fin["node"] == node].drop_duplicates("request_id", keep="last")
        exp_out = pd.to_numeric(a["max_new_tokens"], errors="coerce").fillna(
            pressure.fallback_output_tokens(f["output_tokens"]))
        a = _admitted(a, logs.frame(RequestScheduled), node)
        # expected blocks before any prefix hit; the hits are subtracted as they happen (a
        # forecast at t knows only the hits up to t, as the live exporter does)
        a = a.assign(expected=pressure.expected_blocks(a["prompt_tokens"], exp_out, 0, bs))
        a = a.merge(f[["request_id", "ts_ns"]].rename(columns={"ts_ns": "fin_ns"}),
                    on="request_id", how="left")
        a["fin_ns"] = a["fin_ns"].fillna(_NEVER_NS).astype("int64")  # not finished in the log
        t = s["ts_ns"].to_numpy(dtype="int64")
        # blocks the active requests already hold: their allocations and prefix hits so far
        # (the block facts, folded live by top as here)
        hits_active, held = _active_blocks(logs, node, t)
        # expected blocks of active requests: + at arrival, - at finish
        ev_t = np.concatenate([a["start_ns"].to_numpy(dtype="int64"), a["fin_ns"].to_numpy(dtype="int64")])
        ev_v = np.concatenate([a["expected"].to_numpy(), -a["expected"].to_numpy()])
        expected = cum_at(ev_t, ev_v, t) - hits_active
        active = cum_at(ev_t, np.concatenate([np.ones(len(a)), -np.ones(len(a))]), t)
        needed = pressure.needed_blocks(expected, held)
        free = (s["blocks_free"] + s["blocks_cached"]).to_numpy(dtype="float64")
        st = logs.frame(EngineStep)
        st = st[st["node"] == node]
        dec = cum_at(st["ts_ns"].to_numpy(dtype="int64"),
                      (st["decode_tokens"] if st["decode_tokens"].sum() else st["num_tokens"]).to_numpy(dtype="float64"), t)
        dec_before = cum_at(st["ts_ns"].to_numpy(dtype="int64"),
                             (st["decode_tokens"] if st["decode_tokens"].sum() else st["num_tokens"]).to_numpy(dtype="float64"),
                             t - window_ns)
        rate = (dec - dec_before) / (window_ns / 1e9) / bs
        ratio = pressure.need_ratio(needed, free)
        with np.errstate(divide="ignore", invalid="ignore"):
            ttf = np.where((needed >= free) & (rate > 0), free / rate, np.inf)
        out.append(pd.DataFrame({"ts_ns": t, "node": node, "active_requests": active,
                                 "needed_blocks": needed, "free_blocks": free,
                                 "growth_blocks_per_s": rate, "need_ratio": ratio,
                                 "time_to_full_s": ttf}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=cols)


def _active_blocks(logs: Logs, node: str, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prefix hits and allocations, at each pool sample time of ``t``, of the requests that
    arrived and had not finished (:mod:`kvdiag.pool.blockfacts`' ``active_hits`` and
    ``active_allocated`` at the last pool-sample row at or before it)."""
    facts = block_facts.frame(logs, FACTS_TAG)
    facts = facts[(facts["node"] == node) & (facts["kind"] == "pool")]
    order = np.argsort(facts["ts_ns"].to_numpy(dtype="int64"), kind="stable")
    ft = facts["ts_ns"].to_numpy(dtype="int64")[order]
    idx = np.searchsorted(ft, t, side="right") - 1

    def at(col: str) -> np.ndarray:
        v = facts[col].to_numpy(dtype="float64")[order]
        return np.where(idx >= 0, v[np.maximum(idx, 0)] if len(v) else 0.0, 0.0)
    return at("active_hits"), at("active_allocated")


def _admitted(arrivals: pd.DataFrame, scheduled: pd.DataFrame, node: str) -> pd.DataFrame:
    """The arrivals with ``start_ns``: their first scheduling, or (a log without scheduling
    events) their arrival; requests never scheduled are left out."""
    mine = scheduled[scheduled["node"] == node]
    if mine.empty:
        return arrivals.assign(start_ns=arrivals["ts_ns"])
    first = mine.sort_values("ts_ns", kind="stable").drop_duplicates("request_id").set_index("request_id")["ts_ns"]
    start = arrivals["request_id"].map(first)
    return arrivals[start.notna()].assign(start_ns=start[start.notna()].astype("int64"))


def memory_pressure(logs: Logs) -> Finding:
    """Worst moment of :func:`forecast_frame`: fail when the active requests needed more
    blocks than were free (preemption or OOM ahead), warn above 80%."""
    title = "KV demand of active requests fits the free blocks"
    fc = forecast_frame(logs)
    if fc.empty:
        return Finding("forecast.memory_pressure", "n/a", title,
                       "needs KV pool samples, request arrivals and the block size")
    known = fc[fc["need_ratio"].notna()]  # a sample without free or expected blocks judges nothing
    if known.empty:
        return Finding("forecast.memory_pressure", "n/a", title,
                       f"no KV pool sample with both free and needed blocks known (of {len(fc)} samples)")
    fc = known
    worst = fc.loc[fc["need_ratio"].idxmax()]
    last = fc.iloc[-1]
    r = float(worst["need_ratio"])
    status = rules.pressure_status(r)
    ttf = float(fc["time_to_full_s"].min())
    return Finding("forecast.memory_pressure", status, title,
                   f"peak need {worst['needed_blocks']:.0f} blocks vs {worst['free_blocks']:.0f} free "
                   f"({r:.0%}) with {worst['active_requests']:.0f} active requests; "
                   + (f"time to full {ttf:.1f} s" if np.isfinite(ttf) else "the pool never fills")
                   + f"; at the end: {last['needed_blocks']:.0f} needed, {last['free_blocks']:.0f} free",
                   {"peak_need_ratio": r, "peak_ts_ns": int(worst["ts_ns"]),
                    "peak_needed_blocks": float(worst["needed_blocks"]),
                    "peak_free_blocks": float(worst["free_blocks"]),
                    "min_time_to_full_s": ttf if np.isfinite(ttf) else None,
                    "last_needed_blocks": float(last["needed_blocks"]),
                    "last_free_blocks": float(last["free_blocks"]),
                    "last_active_requests": float(last["active_requests"])})


def _config_key(r) -> tuple:
    return (r.policy, int(r.block_size_tokens), None if pd.isna(r.capacity_blocks) else int(r.capacity_blocks))


def _as_event(r) -> ShadowSharing:
    def opt(v):
        return None if v is None or (isinstance(v, float) and np.isnan(v)) else v
    return ShadowSharing(ts_ns=int(r.ts_ns), policy=r.policy, block_size_tokens=int(r.block_size_tokens),
                         capacity_blocks=_config_key(r)[2], requests=int(r.requests),
                         block_hit_rate=float(r.block_hit_rate), token_hit_rate=float(r.token_hit_rate),
                         engine_hit_rate=opt(r.engine_hit_rate),
                         **{f: None if opt(getattr(r, f, None)) is None else int(getattr(r, f))
                            for f in ("finished_requests", "finished_prompt_tokens", "finished_hit_tokens",
                                      "finished_engine_cached_tokens")})


def _same_requests(mine: pd.DataFrame, key: tuple, fin: pd.DataFrame) -> Optional[dict]:
    """Engine and shadow over the same requests, for one configuration's events of one node:
    the window between its first and last event (:func:`kvdiag.simulation.live_sharing.sharing_window`);
    for a log without the ``finished_*`` counters (schema < 1.6), the latest event taken when
    every request the shadow had counted had finished (its ``requests`` equal to the requests
    finished by then), whose shadow and engine rates cover the same requests."""
    rows = [r for r in mine.sort_values("ts_ns", kind="stable").itertuples() if _config_key(r) == key]
    first, last = _as_event(rows[0]), _as_event(rows[-1])
    window = sharing_window(first, last)
    if window is not None:
        return {"shadow_hit_rate": window.shadow_hit_rate, "engine_hit_rate": window.engine_hit_rate,
                "requests": window.requests, "window_start_ns": window.start_ns, "window_end_ns": window.end_ns,
                "prompt_tokens": window.prompt_tokens, "shadow_hit_tokens": window.shadow_hit_tokens,
                "engine_cached_tokens": window.engine_cached_tokens}
    done = np.sort(fin["ts_ns"].to_numpy(dtype="int64"))
    for r in reversed(rows):
        if r.requests and np.searchsorted(done, r.ts_ns, side="right") == r.requests and pd.notna(r.engine_hit_rate):
            return {"shadow_hit_rate": float(r.token_hit_rate), "engine_hit_rate": float(r.engine_hit_rate),
                    "requests": int(r.requests), "window_start_ns": None, "window_end_ns": int(r.ts_ns)}
    return None


def sharing_consistency(logs: Logs) -> Finding:
    """``sharing.consistency``: the content's hit rate (the shadow cache configured closest
    to the engine: :func:`kvdiag.simulation.live_sharing.headline_config`) minus the engine's
    own, over the same requests (:func:`_same_requests`: those that finished between the
    node's first and last shadow results; a log cut mid-run or joined mid-stream judges only
    them); n/a with fewer than :data:`kvdiag.diagnosis.rules.MIN_SHARING_REQUESTS` of them. The
    node with the largest gap decides."""
    title = "engine prefix hit rate matches the content's"
    sh = logs.frame(ShadowSharing)
    if sh.empty:
        return Finding("sharing.consistency", "n/a", title, "no shadow sharing events (the agent records them)")
    info = logs.frame(KVPoolInfo)
    fin_all = logs.frame(RequestFinished)
    worst: Optional[dict] = None
    fewest: Optional[dict] = None  # the largest window with too few requests
    for node in logs.nodes:
        mine = sh[sh["node"] == node]
        if mine.empty:
            continue
        keys = {_config_key(r) for r in mine.itertuples()}
        pool = info[info["node"] == node]
        last_info = pool.iloc[-1] if len(pool) else None
        key = headline_config(keys, None if last_info is None else int(last_info["block_size_tokens"]),
                              None if last_info is None else int(last_info["num_blocks"]))
        same = _same_requests(mine, key, fin_all[fin_all["node"] == node])
        if same is None or same["engine_hit_rate"] is None:
            continue
        if same["requests"] < rules.MIN_SHARING_REQUESTS:
            if fewest is None or same["requests"] > fewest["requests"]:
                fewest = {"node": node, **same}
            continue
        gap = float(same["shadow_hit_rate"]) - float(same["engine_hit_rate"])
        if worst is None or abs(gap) > abs(worst["gap"]):
            worst = {"node": node, "gap": gap, **same, "policy": key[0],
                     "block_size_tokens": int(key[1]), "capacity_blocks": key[2],
                     "limit": rules.SHARING_GAP_LIMIT}
    if worst is None:
        if fewest is not None:
            return Finding("sharing.consistency", "n/a", title,
                           rules.too_few(fewest["requests"], rules.MIN_SHARING_REQUESTS,
                                         "finished requests counted by both the shadow and the engine"),
                           {**fewest, "needed": rules.MIN_SHARING_REQUESTS})
        return Finding("sharing.consistency", "n/a", title,
                       "no engine hit rate over the same requests as the shadow's (shadow results "
                       "older than schema 1.6 compare only when no request was in flight)")
    return Finding("sharing.consistency", rules.sharing_gap_status(worst["gap"]), title,
                   f"shadow {worst['shadow_hit_rate']:.1%} vs engine {worst['engine_hit_rate']:.1%} "
                   f"over the same {worst['requests']} finished requests "
                   f"(gap {worst['gap']:+.1%}, limit ±{rules.SHARING_GAP_LIMIT:.0%})", worst)


def preemptions(logs: Logs) -> Finding:
    """``pool.preemptions``: requests the engine preempted for lack of KV blocks (warn on any)."""
    title = "no request preempted for lack of KV blocks"
    pre = logs.frame(RequestPreempted)
    if not logs.has(RequestFinished) and pre.empty:
        return Finding("pool.preemptions", "n/a", title, "no request events")
    if pre.empty:
        return Finding("pool.preemptions", rules.preemption_status(0), title, "0 preemptions recorded",
                       {"preemptions": 0})
    return Finding("pool.preemptions", rules.preemption_status(len(pre)), title, f"{len(pre)} preemptions",
                   {"preemptions": int(len(pre)), "requests": pre["request_id"].astype(str).unique().tolist()[:20]})


def kv_event_gaps(logs: Logs) -> Finding:
    """``kv_events.gaps``: batches of the engine's KV event stream that the subscriber lost
    and could not replay (its ``CollectorGap`` events; ``dropped_events`` counts batches),
    beside the batches received (distinct node, seq and timestamp of ``prefix_cache_*``
    events: the block facts' batch rows, :mod:`kvdiag.pool.blockfacts`). Verdict: :func:`kvdiag.diagnosis.rules.kv_event_gaps_status`."""
    title = "engine KV event stream complete (no lost batches)"
    gaps = logs.frame(CollectorGap)
    gaps = gaps[gaps["collector"] == VLLM_KV_EVENTS_COLLECTOR]
    batches = block_facts.frame(logs, KV_BATCHES_TAG)
    n_events = int(batches["events"].sum()) if len(batches) else 0
    received = len(batches[["node", "seq", "ts_ns"]].drop_duplicates()) if n_events else 0
    status = rules.kv_event_gaps_status(n_events, len(gaps))
    if status == "n/a":
        return Finding("kv_events.gaps", status, title, "no engine KV cache events in the log")
    lost = int(gaps["dropped_events"].sum())
    evidence = {"batches_received": received, "kv_events": n_events, "gaps": int(len(gaps)),
                "lost_batches": lost}
    if len(gaps):
        first = gaps.sort_values("ts_ns", kind="stable").iloc[0]
        evidence["first_gap_ns"] = [int(first["start_ns"]), int(first["end_ns"])]
        return Finding("kv_events.gaps", status, title,
                       f"{len(gaps)} gaps: {lost} batches lost (not replayed) beside {received} "
                       "received; stored/removed keys derived from the stream miss them", evidence)
    return Finding("kv_events.gaps", status, title,
                   f"{received} batches, {n_events} events, no sequence gap", evidence)


def kv_stream_health(logs: Logs) -> list[Finding]:
    """``kv_events.health``, per node: the KV-event stream's health as
    :class:`kvdiag.pool.kv_stream_health.StreamHealth` folds it (the block facts' health row,
    :mod:`kvdiag.pool.blockfacts`), duplicate batches the subscriber dropped (its ``CollectorError``
    events) added. Verdict: :func:`kvdiag.diagnosis.rules.kv_stream_health_status`."""
    title = "engine KV event stream consistent (stores before removals, balance within the pool)"
    health = block_facts.frame(logs, KV_HEALTH_TAG)
    errors = logs.frame(CollectorError)
    dropped_dups = errors[(errors["collector"] == VLLM_KV_EVENTS_COLLECTOR)
                          & errors["message"].astype(str).str.startswith(DUPLICATE_BATCH_MESSAGE)] \
        if len(errors) else errors
    if health.empty:
        status = rules.kv_stream_health_status(0, 0, 0, 0, 0)
        return [Finding("kv_events.health", status, title, "no engine KV cache events in the log")]
    out = []
    for _, row in health.iterrows():
        ev = {k: (None if pd.isna(row[k]) else int(row[k])) for k in KV_HEALTH_COLUMNS}
        node_dups = dropped_dups[dropped_dups["node"] == row["node"]] if len(dropped_dups) else dropped_dups
        ev["duplicate_batches"] += int(node_dups["count"].sum()) if len(node_dups) else 0
        status = rules.kv_stream_health_status(ev["events"], ev["removed_before_stored"],
                                               ev["duplicate_batches"], ev["clear_storms"],
                                               ev["over_pool_batches"])
        problems = [f"{ev[k]} {label}" for k, label in (
            ("removed_before_stored", "keys removed before any store on a complete stream"),
            ("duplicate_batches", "duplicate batches"),
            ("clear_storms", "AllBlocksCleared storms"),
            ("over_pool_batches", f"batches holding more keys than the pool's {ev['pool_blocks']} blocks"))
            if ev[k]]
        join = f"joined at seq {ev['first_seq']}; " if ev["first_seq"] else ""
        msg = (join + ("; ".join(problems) if problems else
                       f"{ev['batches']} batches: {ev['stored_blocks']} keys stored, "
                       f"{ev['removed_blocks']} removed, {ev['duplicate_stores']} duplicate stores, "
                       f"peak {ev['max_device_held_blocks']} held in the device tier"))
        ev["node"] = str(row["node"])
        ev.update(_reuse_coverage(logs, row["node"], ev["duplicate_stores"]))
        out.append(Finding("kv_events.health", status, title, msg, ev))
    return out


def _reuse_coverage(logs: Logs, node, duplicate_stores: int) -> dict:
    """Coverage of reused blocks, where the log allows: a publisher that re-announces the
    blocks a request reused as stores (vLLM with ``kv_cache_report_mode="full"``) makes each
    hit block a duplicate store, so ``reuse_coverage`` = duplicate stores / the blocks the
    engine's own counter says were hit (``prefix_cache_hits_tokens`` from its first to its last
    scrape, over ``block_size_tokens``). Evidence only, no verdict: requests in the default
    incremental mode announce nothing, concurrent computes of one content add duplicates, and
    stores outside the scrapes' span count too. Empty without two scrapes and a block size."""
    em = logs.frame(EngineMetrics)
    if em.empty or "prefix_cache_hits_tokens" not in em:
        return {}
    em = em[(em["node"] == node) & em["prefix_cache_hits_tokens"].notna()].sort_values("ts_ns", kind="stable")
    sizes = em["block_size_tokens"].dropna() if "block_size_tokens" in em else em.iloc[0:0]
    bs = int(sizes.iloc[-1]) if len(sizes) else logs.block_size_tokens(node)
    if len(em) < 2 or not bs:
        return {}
    hit_blocks = int(em["prefix_cache_hits_tokens"].iloc[-1] - em["prefix_cache_hits_tokens"].iloc[0]) // bs
    return {"engine_hit_blocks": hit_blocks,
            "reuse_coverage": duplicate_stores / hit_blocks if hit_blocks > 0 else None}


@dataclass
class RuleContext:
    """What every registered rule is evaluated on: the logs, the baseline (``--baseline``) and
    where the P99 rules leave the latency comparisons behind them (for reports)."""

    logs: Logs
    baseline: Optional[Logs] = None
    comparisons: list = field(default_factory=list)


@dataclass(frozen=True)
class RegisteredRule:
    """One entry of :data:`REGISTRY`: the rule ids an evaluator reports and the evaluator."""

    rule_ids: tuple[str, ...]
    evaluate: Callable[[RuleContext], list[Finding]]


def _p99_rules(ctx: RuleContext) -> list[Finding]:
    found, ctx.comparisons = p99(ctx.logs, ctx.baseline)
    return found


def _one(fn: Callable[[Logs], Finding]) -> Callable[[RuleContext], list[Finding]]:
    return lambda ctx: [fn(ctx.logs)]


def _many(fn: Callable[[Logs], list[Finding]]) -> Callable[[RuleContext], list[Finding]]:
    return lambda ctx: fn(ctx.logs)


REGISTRY: tuple[RegisteredRule, ...] = (
    RegisteredRule(("leak.memory_growth",), _one(memory_growth)),
    RegisteredRule(("leak.release_paths", "leak.double_release", "leak.pool_growth"), _many(release_paths)),
    RegisteredRule(("fragmentation.kv_pool", "fragmentation.allocator"), _many(fragmentation)),
    RegisteredRule(("leak.oom",), _one(ooms)),
    RegisteredRule(("latency.queueing",), _one(user_latency.queueing)),
    RegisteredRule(("p99.regression", *(f"p99.{name}" for name in _CAUSE_TITLES)), _p99_rules),
    RegisteredRule(("forecast.memory_pressure",), _one(memory_pressure)),
    RegisteredRule(("sharing.consistency",), _one(sharing_consistency)),
    RegisteredRule(("pool.preemptions",), _one(preemptions)),
    RegisteredRule(("kv_events.gaps",), _one(kv_event_gaps)),
    RegisteredRule(("kv_events.health",), _many(kv_stream_health)),
    RegisteredRule((engine_numbers.RULE_ID,), _one(engine_numbers.number_traps)),
)
"""Every rule the doctor evaluates, in the order it reports them: each evaluator with the ids
of the findings it returns. Its ids are :data:`kvdiag.diagnosis.rules.RULE_IDS` (tested), and
every verdict an evaluator gives comes from a function of :mod:`kvdiag.diagnosis.rules`."""


def run_rules(logs: Logs, baseline: Optional[Logs] = None) -> tuple[list[Finding], list[latency.Comparison]]:
    """Every rule of :data:`REGISTRY` over ``logs`` (a finding per rule and node where a rule
    judges nodes apart); also the latency comparisons behind the P99 rules (for reports)."""
    ctx = RuleContext(logs, baseline)
    findings = [f for entry in REGISTRY for f in entry.evaluate(ctx)]
    return findings, ctx.comparisons
