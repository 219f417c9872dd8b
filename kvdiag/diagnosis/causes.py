"""Candidate causes of a P99 latency regression, with the evidence for each.

The article's checklist for P99 spikes, each compared between a baseline window and the
window where latency regressed (rates are per second of the window):

- ``compression``: the compression/decompression path was active (ShadowCompression events).
- ``kv_bandwidth``: the KV bytes attention must read per second of engine steps rose, or the
  measured copy bandwidth was saturated while each step read more KV
  (:mod:`kvdiag.diagnosis.bandwidth`).
- ``prefix_hit_rate``: the prefix hit rate (cached prompt tokens / prompt tokens of finished
  requests) dropped, or fluctuated (std of the hit rate over sub-windows).
- ``long_sequences``: abnormally long prompts arrived: the share of prompts longer than the
  baseline's P90 at least doubled and reached 5%.
- ``memory_pressure``: preemptions, prefix-cache evictions, pool usage or allocator retries rose.
- ``fragmentation``: the pool's internal fragmentation (or the allocator's) rose.
- ``queueing``: requests waited longer to be scheduled: the median queue wait (first
  ``RequestScheduled`` - arrival, :func:`kvdiag.diagnosis.user_latency.queue_waits_ns`, of the
  requests first scheduled in each window) rose (:func:`kvdiag.diagnosis.rules.queue_wait_rose`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvdiag.diagnosis import bandwidth, block_facts
from kvdiag.diagnosis.frames import Logs
from kvdiag.pool.hit_rate import counted, frame_hit_rate
from kvdiag.diagnosis.memory import allocator_fragmentation, pool_occupancy
from kvdiag.diagnosis.rules import (EVICTION_RISE, QUEUE_WAIT_RISE, fragmentation_rose, hit_rate_moved,
                                   kv_bandwidth_rose, long_sequences_rose, occupancy_crossed, queue_wait_rose,
                                   rose)
from kvdiag.pool.blockfacts import FACTS_TAG
from kvdiag.events.schema import (EngineMetrics, RequestArrived, RequestFinished,
                           RequestPreempted, ShadowCompression)



@dataclass
class Cause:
    """``supported``: the evidence meets the cause's rule; ``score``: its strength for
    ranking (the factor or change by which the cause's measure moved)."""

    cause: str
    title: str
    supported: bool
    message: str
    score: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "title": self.title, "supported": self.supported,
                "message": self.message, "score": self.score, "evidence": self.evidence}


def _duration_s(logs: Logs) -> float:
    t0, t1 = logs.time_range_ns()
    return max((t1 - t0) / 1e9, 1e-9)


def _hit_rates(logs: Logs, n_sub: int = 8) -> tuple[float, float, int]:
    """Engine token hit rate (:mod:`kvdiag.pool.hit_rate`: requests that finished normally), its
    std over ``n_sub`` sub-windows (by finish time, at least 3 requests each; a window without
    prompt tokens counts 0), and the number of those requests."""
    fin = counted(logs.frame(RequestFinished))
    rate = frame_hit_rate(fin)
    if rate is None:
        return float("nan"), float("nan"), len(fin)
    parts = np.array_split(np.arange(len(fin)), min(n_sub, max(len(fin) // 3, 1)))
    sub = [frame_hit_rate(fin.iloc[p]) or 0.0 for p in parts if len(p)]
    return float(rate), float(np.std(sub)) if len(sub) > 1 else 0.0, len(fin)


def _prompt_lengths(logs: Logs) -> np.ndarray:
    arr = logs.frame(RequestArrived)
    src = arr if len(arr) else logs.frame(RequestFinished)
    return src["prompt_tokens"].to_numpy(dtype="float64")


def _counter_delta(logs: Logs, col: str) -> float:
    em = logs.frame(EngineMetrics)
    if col not in em or em[col].dropna().empty:
        return 0.0
    return float(sum(g[col].dropna().iloc[-1] - g[col].dropna().iloc[0]
                     for _, g in em.groupby("node") if g[col].notna().any()))


def _pressure(logs: Logs) -> dict[str, float]:
    occ = pool_occupancy(logs)
    preempt = max(len(logs.frame(RequestPreempted)), _counter_delta(logs, "num_preemptions"))
    al = allocator_fragmentation(logs)
    retries = float(sum(g["alloc_retries"].max() - g["alloc_retries"].min()
                        for _, g in al.groupby(["node", "device"]))) if len(al) else 0.0
    d = _duration_s(logs)
    # evictions counted at the engine step or pool sample that follows them (the block facts)
    evictions = float(pd.to_numeric(block_facts.frame(logs, FACTS_TAG)["evictions"]).sum())
    return {
        "preemptions": float(preempt), "preemptions_per_s": preempt / d,
        "evictions": evictions, "evictions_per_s": evictions / d,
        "peak_block_occupancy": float(occ["block_occupancy"].max()) if len(occ) else float("nan"),
        "mean_waiting_requests": float(occ["waiting_requests"].mean()) if len(occ) else float("nan"),
        "alloc_retries": retries,
    }


def _fragmentation(logs: Logs) -> tuple[float, float]:
    occ = pool_occupancy(logs)
    al = allocator_fragmentation(logs)
    pool = float(occ["fragmentation"].mean()) if occ["fragmentation"].notna().any() else float("nan")
    alloc = float(al["fragmentation"].mean()) if al["fragmentation"].notna().any() else float("nan")
    return pool, alloc


def _kv_bandwidth(baseline: Logs, current: Logs, wb: list[int], wc: list[int]) -> Cause:
    """The ``kv_bandwidth`` cause: demanded KV read bandwidth and its utilisation, before and
    after (verdict :func:`kvdiag.diagnosis.rules.kv_bandwidth_rose`)."""
    title = "KV bandwidth utilisation rose"
    b, c = bandwidth.summarize(baseline), bandwidth.summarize(current)
    if not b.steps or not c.steps:
        return Cause("kv_bandwidth", title, False,
                     "no engine steps with KV blocks in one of the windows (needs EngineStep and "
                     "block events or pool samples)", evidence={})
    per_step_b, per_step_c = b.kv_read_bytes / b.steps, c.kv_read_bytes / c.steps
    supported = kv_bandwidth_rose(b.kv_read_bytes_per_s, c.kv_read_bytes_per_s, per_step_b, per_step_c,
                                  c.utilisation)
    util = (f"; utilisation {b.utilisation:.1%} -> {c.utilisation:.1%} of "
            f"{c.peak_copy_bytes_per_s / 1e9:.1f} GB/s measured" if np.isfinite(c.utilisation)
            else "; no bandwidth probe in the log (utilisation N/A)")
    nvml = (f"; NVML memory-controller utilisation {b.nvml_memory_util_pct:.0f}% -> "
            f"{c.nvml_memory_util_pct:.0f}%" if np.isfinite(c.nvml_memory_util_pct) else "")
    ratio = c.kv_read_bytes_per_s / b.kv_read_bytes_per_s if b.kv_read_bytes_per_s > 0 else float("inf")
    return Cause(
        "kv_bandwidth", title, supported,
        f"demanded KV read {b.kv_read_bytes_per_s / 1e9:.2f} -> {c.kv_read_bytes_per_s / 1e9:.2f} GB/s "
        f"({per_step_b / 2**20:.1f} -> {per_step_c / 2**20:.1f} MiB per step){util}{nvml}",
        score=float(ratio) if np.isfinite(ratio) else 10.0,
        evidence={"baseline": b.to_dict(), "current": c.to_dict(),
                  "kv_read_bytes_per_step_baseline": per_step_b, "kv_read_bytes_per_step_current": per_step_c,
                  "baseline_window_ns": wb, "current_window_ns": wc})


def _window(logs: Logs) -> list[int]:
    return list(logs.time_range_ns())


def attribute(baseline: Logs, current: Logs) -> list[Cause]:
    """Evaluate every candidate cause between the two windows; supported causes first,
    strongest first."""
    wb, wc = _window(baseline), _window(current)
    out = [judge(baseline, current, wb, wc)
           for judge in (_compression, _kv_bandwidth, _prefix_hit_rate, _long_sequences,
                         _memory_pressure, _fragmentation_rise, _queueing)]
    return sorted(out, key=lambda c: (not c.supported, -c.score))


def _compression(baseline: Logs, current: Logs, wb: list[int], wc: list[int]) -> Cause:
    """The ``compression`` cause: compression runs per second of each window."""
    comp = current.frame(ShadowCompression)
    rb = len(baseline.frame(ShadowCompression)) / _duration_s(baseline)
    rc = len(comp) / _duration_s(current)
    busy_ns = float(comp[["encode_ns", "decode_ns"]].fillna(0).to_numpy().sum()) if len(comp) else 0.0
    return Cause(
        "compression", "compression/decompression path active", rose(rb, rc),
        f"{len(comp)} compression runs in the regressed window ({rc:.2f}/s vs {rb:.2f}/s before)",
        score=rc / rb if rb > 0 else float(rc > 0) * 10,
        evidence={"events_per_s_baseline": rb, "events_per_s_current": rc,
                  "events_current": len(comp), "busy_s_current": busy_ns / 1e9,
                  "methods": sorted(comp["method"].unique().tolist()) if len(comp) else [],
                  "baseline_window_ns": wb, "current_window_ns": wc})


def _prefix_hit_rate(baseline: Logs, current: Logs, wb: list[int], wc: list[int]) -> Cause:
    """The ``prefix_hit_rate`` cause: token hit rate and its spread over sub-windows."""
    hb, sb, nb = _hit_rates(baseline)
    hc, sc, nc = _hit_rates(current)
    return Cause(
        "prefix_hit_rate", "prefix hit rate dropped or fluctuated", hit_rate_moved(hb, hc, sb, sc),
        f"token hit rate {hb:.1%} -> {hc:.1%} (std over sub-windows {sb:.1%} -> {sc:.1%})",
        score=float(max(hb - hc, sc - (sb if np.isfinite(sb) else 0), 0) * 10) if np.isfinite(hc) else 0.0,
        evidence={"hit_rate_baseline": hb, "hit_rate_current": hc, "hit_rate_std_baseline": sb,
                  "hit_rate_std_current": sc, "requests_baseline": nb, "requests_current": nc,
                  "baseline_window_ns": wb, "current_window_ns": wc})


def _long_sequences(baseline: Logs, current: Logs, wb: list[int], wc: list[int]) -> Cause:
    """The ``long_sequences`` cause: the share of prompts longer than the baseline's P90."""
    lb, lc = _prompt_lengths(baseline), _prompt_lengths(current)
    if not len(lb) or not len(lc):
        return Cause("long_sequences", "abnormally long sequences arrived", False,
                     "no request arrivals in one of the windows", evidence={})
    # the baseline's P90, not its P99: a few stragglers of the new traffic that fall
    # before the change point must not set the bar
    p90b = float(np.quantile(lb, 0.90, method="inverted_cdf"))
    long_c = lc > p90b
    share_b, share = float((lb > p90b).mean()), float(long_c.mean())
    arr = current.frame(RequestArrived)
    ids = arr["request_id"][arr["prompt_tokens"] > p90b].tolist()[:20] if len(arr) else []
    return Cause(
        "long_sequences", "abnormally long sequences arrived",
        long_sequences_rose(share_b, share),
        f"{int(long_c.sum())} of {len(lc)} prompts ({share:.1%}) longer than the baseline's "
        f"P90 of {p90b:.0f} tokens, against {share_b:.1%} before (longest {lc.max():.0f})",
        score=share / max(share_b, 0.01),
        evidence={"baseline_p90_prompt_tokens": p90b, "long_requests": int(long_c.sum()),
                  "long_share_baseline": share_b, "long_share_current": share,
                  "requests_current": len(lc), "max_prompt_tokens_current": float(lc.max()),
                  "long_request_ids": ids, "baseline_window_ns": wb, "current_window_ns": wc})


def _memory_pressure(baseline: Logs, current: Logs, wb: list[int], wc: list[int]) -> Cause:
    """The ``memory_pressure`` cause: preemptions, evictions, pool occupancy, allocator retries."""
    pb, pc = _pressure(baseline), _pressure(current)
    reasons = []
    if rose(pb["preemptions_per_s"], pc["preemptions_per_s"]):
        reasons.append(f"preemptions {pb['preemptions']:.0f} -> {pc['preemptions']:.0f}")
    if rose(pb["evictions_per_s"], pc["evictions_per_s"], EVICTION_RISE):
        reasons.append(f"evictions {pb['evictions_per_s']:.2f}/s -> {pc['evictions_per_s']:.2f}/s")
    if occupancy_crossed(pb["peak_block_occupancy"], pc["peak_block_occupancy"]):
        reasons.append(f"peak pool occupancy {pb['peak_block_occupancy']:.0%} -> "
                       f"{pc['peak_block_occupancy']:.0%}")
    if pc["alloc_retries"] > pb["alloc_retries"]:
        reasons.append(f"allocator retries {pb['alloc_retries']:.0f} -> {pc['alloc_retries']:.0f}")
    return Cause(
        "memory_pressure", "memory pressure, preemptions or evictions rose", bool(reasons),
        "; ".join(reasons) or (f"preemptions {pc['preemptions']:.0f}, evictions "
                               f"{pc['evictions_per_s']:.2f}/s, peak occupancy "
                               f"{pc['peak_block_occupancy']:.0%}: no rise"),
        score=float(len(reasons)),
        evidence={"baseline": pb, "current": pc, "baseline_window_ns": wb, "current_window_ns": wc})


def _fragmentation_rise(baseline: Logs, current: Logs, wb: list[int], wc: list[int]) -> Cause:
    """The ``fragmentation`` cause: the rise of the pool's or the allocator's fragmentation."""
    (fb, ab), (fc, ac) = _fragmentation(baseline), _fragmentation(current)
    rise = [x for x in (fc - fb, ac - ab) if np.isfinite(x)]
    up = max(rise) if rise else float("nan")
    return Cause(
        "fragmentation", "fragmentation rose", bool(rise) and fragmentation_rose(up),
        f"pool fragmentation {fb:.1%} -> {fc:.1%}, allocator {ab:.1%} -> {ac:.1%}",
        score=float(up * 10) if rise else 0.0,
        evidence={"pool_baseline": fb, "pool_current": fc, "allocator_baseline": ab,
                  "allocator_current": ac, "baseline_window_ns": wb, "current_window_ns": wc})


def _queueing(baseline: Logs, current: Logs, wb: list[int], wc: list[int]) -> Cause:
    """The ``queueing`` cause: median queue wait of the requests first scheduled in each window."""
    from kvdiag.diagnosis.latency import quantile  # both import this module
    from kvdiag.diagnosis.user_latency import queue_waits_ns
    title = "queue wait rose"
    qb, qc = queue_waits_ns(baseline), queue_waits_ns(current)
    if not len(qb) or not len(qc):
        return Cause("queueing", title, False,
                     "no scheduling events (RequestScheduled) in one of the windows: queue wait n/a",
                     evidence={"requests_baseline": len(qb), "requests_current": len(qc)})
    mb, mc = quantile(qb, 0.5), quantile(qc, 0.5)
    return Cause(
        "queueing", title, queue_wait_rose(mb, mc),
        f"queue wait P50 {mb / 1e9:.3f} -> {mc / 1e9:.3f} s, P99 {quantile(qb, 0.99) / 1e9:.3f} "
        f"-> {quantile(qc, 0.99) / 1e9:.3f} s ({len(qb)} -> {len(qc)} requests scheduled; "
        f"rise at >= {QUEUE_WAIT_RISE:g}x)",
        score=mc / mb if mb > 0 else float(mc > 0) * 10,
        evidence={"queue_p50_s_baseline": mb / 1e9, "queue_p50_s_current": mc / 1e9,
                  "requests_baseline": len(qb), "requests_current": len(qc),
                  "baseline_window_ns": wb, "current_window_ns": wc})
