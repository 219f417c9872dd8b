"""Pressure on the KV pool as rules over a log: ``forecast.memory_pressure`` (the blocks the
active requests still need against the free blocks, :func:`forecast_frame`) and
``pool.preemptions`` (requests the engine preempted for lack of blocks). Verdicts come from
:mod:`kvdiag.diagnosis.rules`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvdiag.diagnosis import block_facts, rules
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.frames import Logs
from kvdiag.diagnosis.memory import cum_at
from kvdiag.events.schema import (EngineStep, KVPoolSample, RequestArrived, RequestFinished, RequestPreempted,
                                  RequestScheduled)
from kvdiag.pool import pressure
from kvdiag.pool.blockfacts import FACTS_TAG

_NEVER_NS = 2 ** 62  # a time after any log (exact as a float, unlike int64 max)


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
