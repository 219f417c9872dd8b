"""The summary of an attach session (or any log): memory by source, KV pool use, prefix hit
rate, fragmentation, phase breakdown and findings, as plain JSON-ready values.

Definitions: token hit rate = cached prompt tokens / prompt tokens over requests finished in
the window (``RequestFinished``); engine hit rate = increase of the engine's prefix-cache hit
counter / increase of its query counter between the first and last ``EngineMetrics``;
sharing = shadow and engine token hit rates over the same requests, those finished since the
first shadow result received (the agent sends its latest at join), and ``sharing.consistency``
on them; phase shares = py-spy samples per phase / all samples, pooled over windows; latency
(TTFT, TPOT, queue wait, e2e, arrival and completion rates): :mod:`kvdiag.diagnosis.user_latency`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Optional

import pandas as pd

from kvdiag.diagnosis import fragmentation, leaks, pool_fragmentation, user_latency
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.frames import merge
from kvdiag.events.log_frames import events_to_frames
from kvdiag.pool.hit_rate import engine_token_hit_rate, frame_hit_rate
from kvdiag.events.schema import SCHEMA_VERSION, Event, LogHeader


def _f(frames: dict, tag: str) -> pd.DataFrame:
    return frames.get(tag, pd.DataFrame())


def _num(x: Any) -> Any:
    if x is None or (isinstance(x, float) and x != x):
        return None
    if hasattr(x, "item"):
        x = x.item()
    return x


STALE_SAMPLE_NS = 5_000_000_000
"""A process not sampled for this long is taken to have exited (samples come every 0.5-1 s)."""


def tree_rss_over_time(proc: pd.DataFrame) -> pd.DataFrame:
    """Resident memory of the whole process tree at each sample time: every process's latest
    sample at that time (samples of one process come from several collectors at their own
    cadence: the attach's round over the tree, an agent's own process), leaving out processes
    not sampled for :data:`STALE_SAMPLE_NS`. Columns ``ts_ns``, ``rss_bytes``, ``processes``."""
    proc = proc.sort_values("ts_ns", kind="stable").assign(seen_ns=lambda f: f["ts_ns"])
    rss = proc.pivot_table(index="ts_ns", columns="pid", values="rss_bytes", aggfunc="last").ffill()
    seen = proc.pivot_table(index="ts_ns", columns="pid", values="seen_ns", aggfunc="last").ffill()
    fresh = seen.rsub(seen.index.to_numpy(), axis=0) <= STALE_SAMPLE_NS
    rss = rss.where(fresh)
    return pd.DataFrame({"ts_ns": rss.index.to_numpy(), "rss_bytes": rss.sum(axis=1).to_numpy(),
                         "processes": rss.notna().sum(axis=1).to_numpy()})


def _memory(frames: dict, block_bytes: Optional[int]) -> dict:
    out: dict[str, Any] = {}
    proc = _f(frames, "process_sample")
    if not proc.empty:
        tree = tree_rss_over_time(proc)
        out["process_rss_bytes"] = int(tree["rss_bytes"].iloc[-1])
        out["process_rss_peak_bytes"] = int(tree["rss_bytes"].max())
        out["processes"] = int(tree["processes"].iloc[-1])
    nv = _f(frames, "nvml_sample")
    if not nv.empty:
        last = nv[nv["ts_ns"] == nv["ts_ns"].max()]
        out["gpu_used_bytes"] = _num(last["memory_used_bytes"].sum(min_count=1))
        out["gpu_process_bytes"] = _num(last["process_memory_bytes"].sum(min_count=1))
    alloc = _f(frames, "allocator_sample")
    if not alloc.empty:
        last = alloc[alloc["ts_ns"] == alloc["ts_ns"].max()]
        out["allocator_reserved_bytes"] = int(last["reserved_bytes"].sum())
        out["allocator_allocated_bytes"] = int(last["allocated_bytes"].sum())
    pool = _f(frames, "kv_pool_sample")
    if not pool.empty and block_bytes:
        last = pool.iloc[-1]
        out["kv_pool_bytes"] = int(last["num_blocks"]) * block_bytes
        out["kv_used_bytes"] = int(last["blocks_used"]) * block_bytes
        out["kv_cached_bytes"] = int(last["blocks_cached"]) * block_bytes
    return out


def _kv(frames: dict, block_size: Optional[int], bytes_per_token: Optional[int]) -> tuple[dict, pd.DataFrame]:
    out: dict[str, Any] = {"block_size_tokens": block_size}
    pool_samples = _f(frames, "kv_pool_sample")
    pool = pd.DataFrame()
    if not pool_samples.empty:
        last = pool_samples.iloc[-1]
        out.update({k: int(last[k]) for k in ("num_blocks", "blocks_used", "blocks_cached", "blocks_free",
                                               "tokens_held", "running_requests", "waiting_requests")})
        out["samples"] = int(len(pool_samples))
        if block_size:
            pool = pool_fragmentation.kv_pool_frame(pool_samples, block_size, bytes_per_token)
            out["block_occupancy"] = _num(pool["block_occupancy"].iloc[-1])
            out["token_occupancy"] = _num(pool["token_occupancy"].iloc[-1])
            out["mean_block_occupancy"] = _num(pool["block_occupancy"].mean())
            out["mean_token_occupancy"] = _num(pool["token_occupancy"].mean())
    for tag, key in (("block_allocated", "blocks_allocated"), ("block_released", "blocks_released"),
                     ("block_evicted", "blocks_evicted"), ("block_stored", "blocks_stored"),
                     ("prefix_hit", "prefix_hits"), ("request_arrived", "requests_arrived"),
                     ("request_finished", "requests_finished")):
        out[key] = int(len(_f(frames, tag)))
    fin = _f(frames, "request_finished")
    out["prompt_tokens"] = int(fin["prompt_tokens"].sum()) if not fin.empty else 0
    out["cached_prompt_tokens"] = int(fin["cached_prompt_tokens"].sum()) if not fin.empty else 0
    out["output_tokens"] = int(fin["output_tokens"].sum()) if not fin.empty else 0
    return out, pool


def _hit_rate(frames: dict) -> dict:
    """The engine's token hit rate (:mod:`kvdiag.pool.hit_rate`) and, from its metric counters over
    the window, its own hit / query tokens."""
    out: dict[str, Any] = {"token_hit_rate": frame_hit_rate(_f(frames, "request_finished"))}
    em = _f(frames, "engine_metrics")
    if len(em) >= 2:
        dq = em["prefix_cache_queries_tokens"].iloc[-1] - em["prefix_cache_queries_tokens"].iloc[0]
        dh = em["prefix_cache_hits_tokens"].iloc[-1] - em["prefix_cache_hits_tokens"].iloc[0]
        rate = engine_token_hit_rate(0, 0, metrics_queries_tokens=dq if dq == dq else None,
                                     metrics_hits_tokens=dh)
        out["engine_hit_rate"] = None if rate is None else _num(rate)
    return out


def _sharing(frames: dict, header: LogHeader) -> tuple[dict, Finding]:
    """``sharing.consistency`` over this window (:func:`kvdiag.diagnosis.sharing_rules.sharing_consistency`:
    shadow and engine over the same requests, those finished since the first shadow result
    the client received, which the agent sends at join time) and that window."""
    from kvdiag.diagnosis.sharing_rules import sharing_consistency
    from kvdiag.diagnosis.frames import Logs

    node = header.node or header.host or "attach"
    logs = Logs(headers={node: header}, frames={t: f.assign(node=node) for t, f in frames.items()})
    finding = sharing_consistency(logs)
    ev = finding.evidence
    out = {k: ev.get(k) for k in ("engine_hit_rate", "shadow_hit_rate", "gap", "requests", "prompt_tokens",
                                  "engine_cached_tokens", "shadow_hit_tokens", "window_start_ns", "window_end_ns")}
    return out, finding


def _efficiency(kv: dict, frames: dict) -> dict:
    """Generated tokens per joule: output tokens of requests finished in the window / GPU
    energy used over the window (NVML energy counter, summed over devices)."""
    nv = _f(frames, "nvml_sample")
    if nv.empty or nv["energy_mj"].isna().all():
        return {"tokens_per_joule": None}
    per_dev = nv.dropna(subset=["energy_mj"]).groupby("device")["energy_mj"]
    joules = float((per_dev.max() - per_dev.min()).sum()) / 1000.0
    return {"tokens_per_joule": kv["output_tokens"] / joules if joules > 0 else None, "energy_j": joules}


def _phases(frames: dict) -> dict:
    prof = _f(frames, "phase_profile")
    if prof.empty:
        return {"samples": 0, "shares": {}, "top_functions": []}
    counts: Counter = Counter()
    hot: Counter = Counter()
    total = 0
    for n, shares, top in zip(prof["num_samples"], prof["shares"], prof["top_functions"]):
        total += int(n)
        for phase, s in (shares or {}).items():
            counts[phase] += s * n
        for fn, s in (top or []):
            hot[fn] += s * n
    return {"samples": total,
            "shares": {p: c / total for p, c in counts.most_common()} if total else {},
            "top_functions": [[fn, c / total] for fn, c in hot.most_common(10)] if total else []}


def summarize(events: Iterable[Event], header: Optional[LogHeader] = None,
              grace_s: float = leaks.DEFAULT_GRACE_S) -> dict[str, Any]:
    """Everything ``kvdiag attach`` prints, from one time-ordered event sequence."""
    events = sorted(events, key=lambda e: e.ts_ns)
    frames = events_to_frames(events)
    header = header or LogHeader(schema_version=SCHEMA_VERSION)
    info = _f(frames, "kv_pool_info")
    block_size = header.block_size_tokens or (int(info["block_size_tokens"].iloc[-1]) if not info.empty else None)
    block_bytes = int(info["block_bytes"].iloc[-1]) if not info.empty else (
        block_size * header.bytes_per_token if block_size and header.bytes_per_token else None)
    kv, pool = _kv(frames, block_size, header.bytes_per_token)
    pool_samples = _f(frames, "kv_pool_sample")
    prefill = leaks.prefill_spans(*(_f(frames, t) for t in ("request_arrived", "request_scheduled",
                                                            "request_first_token", "request_finished")))
    findings = leaks.leak_findings(events, None if pool_samples.empty else pool_samples, grace_s=grace_s,
                                   prefill=prefill)
    findings.append(pool_fragmentation.kv_pool_fragmentation_finding(
        pool if not pool.empty else pd.DataFrame(columns=pool_fragmentation.KV_POOL_COLUMNS)))
    alloc = _f(frames, "allocator_sample")
    findings.append(fragmentation.allocator_fragmentation_finding(samples=alloc if not alloc.empty else None))
    kv_frag = next(f for f in findings if f.rule == "fragmentation.kv_pool")
    free_list = pool_fragmentation.replay_free_list(events)  # needs KVPoolInfo: recorded from pool creation
    if free_list is not None:
        kv["free_list"] = {"free_blocks": free_list.free_blocks, "cached_blocks": free_list.cached_blocks,
                           "used_blocks": free_list.used_blocks,
                           "longest_free_run_blocks": free_list.longest_free_run_blocks,
                           "free_list_fragmentation": free_list.free_list_fragmentation}
    lat = user_latency.summarize(merge([(header, frames, "attach")]))
    sharing, sharing_finding = _sharing(frames, header)
    findings.append(sharing_finding)
    status = _f(frames, "collector_status")
    # the recording's own start: an agent tells a late client what it set up earlier (the pool)
    start = header.start_ns or (events[0].ts_ns if events else 0)
    end = events[-1].ts_ns if events else header.start_ns
    return {
        "target_pid": header.pid,
        "window": {"start_ns": start, "end_ns": end, "duration_s": (end - start) / 1e9},
        "events": len(events),
        "latency": lat.to_dict(),  # first in the printed summary: what users of the server felt
        "memory": _memory(frames, block_bytes),
        "kv": kv,
        "hit_rate": _hit_rate(frames),
        "sharing": sharing,
        "efficiency": _efficiency(kv, frames),
        "fragmentation": {"kv_empty_slot_share": kv_frag.evidence.get("value"),
                          "allocator": next(f for f in findings if f.rule == "fragmentation.allocator").evidence.get("value")},
        "phases": _phases(frames),
        "collectors": [] if status.empty else [
            {"collector": c, "available": bool(a), "hint": h}
            for c, a, h in zip(status["collector"], status["available"], status["hint"])],
        "findings": [f.to_dict() for f in findings],
    }
