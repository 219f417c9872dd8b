"""KV cache release paths and leaks, from an engine adapter's block events.

Per request: blocks allocated, prefix hits, released (to the free list or kept as cached
prefixes), evicted later. Per block allocation: lifetime (allocation -> last holder released
it) and idle-before-evict (cached -> evicted). Leak rules (each finding names its requests
and blocks):

- ``leak.finished_holding``: a request that finished more than ``grace_s`` before the end of
  the window still holds blocks (its release path did not fire);
- ``leak.double_release``: a request released a block it had already released;
- ``leak.pool_growth``: blocks held by live requests grow across the samples taken at the
  window's lowest number of running requests (occupancy grows while live requests don't).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis import rules
from kvdiag.diagnosis.rules import MIN_POOL_GROWTH_BLOCKS, MIN_POOL_GROWTH_SAMPLES, RELEASE_GRACE_NS, too_few
from kvdiag.pool.blockledger import BlockLedger
from kvdiag.events.schema import Event

DEFAULT_GRACE_S = RELEASE_GRACE_NS / 1e9
MAX_NAMED = 20  # requests/blocks listed in a finding's evidence

REQUEST_COLUMNS = [
    "request_id", "arrived_ns", "finished_ns", "status", "blocks_allocated", "blocks_prefix_hit",
    "blocks_deduplicated", "blocks_released", "blocks_released_cached", "blocks_evicted_later", "blocks_still_held",
    "double_releases",
]
EPISODE_COLUMNS = [
    "block_id", "request_id", "allocated_ns", "released_ns", "lifetime_ns", "cached", "hits",
    "evicted_ns", "idle_before_evict_ns",
]


def ledger_from_events(events: Iterable[Event], keep_history: bool = True) -> BlockLedger:
    """Replay events (in the order given, which should be time order) into a ledger; with
    ``keep_history`` (the default here) it keeps the request records and episodes the frames
    below need."""
    ledger = BlockLedger(keep_history=keep_history)
    ledger.apply_all(events)
    return ledger


def request_frame(ledger: BlockLedger) -> pd.DataFrame:
    """One row per request seen in block or request events; ``blocks_still_held`` at the end
    (a ledger built with ``keep_history``)."""
    rows = [{"request_id": r.request_id, "arrived_ns": r.arrived_ns, "finished_ns": r.finished_ns,
             "status": r.status, "blocks_allocated": r.blocks_allocated,
             "blocks_prefix_hit": r.blocks_prefix_hit, "blocks_deduplicated": r.blocks_deduplicated,
             "blocks_released": r.blocks_released,
             "blocks_released_cached": r.blocks_released_cached,
             "blocks_evicted_later": r.blocks_evicted_later,
             "blocks_still_held": len(ledger.blocks_of(r.request_id)), "double_releases": r.double_releases} for r in ledger.history.requests.values()]
    return pd.DataFrame(rows, columns=REQUEST_COLUMNS)


def episode_frame(ledger: BlockLedger) -> pd.DataFrame:
    """One row per block allocation (a ledger built with ``keep_history``): lifetime_ns = released - allocated (NaN while held);
    idle_before_evict_ns = evicted - released for cached blocks (NaN until evicted)."""
    rows = []
    for e in ledger.history.episodes:
        rows.append({"block_id": e.block_id, "request_id": e.request_id, "allocated_ns": e.allocated_ns,
                     "released_ns": e.released_ns,
                     "lifetime_ns": None if e.released_ns is None else e.released_ns - e.allocated_ns,
                     "cached": e.cached, "hits": e.hits, "evicted_ns": e.evicted_ns,
                     "idle_before_evict_ns": (None if e.evicted_ns is None or e.released_ns is None
                                              else e.evicted_ns - e.released_ns)})
    return pd.DataFrame(rows, columns=EPISODE_COLUMNS).astype(
        {"lifetime_ns": "float64", "idle_before_evict_ns": "float64"})


def anomaly_frame(ledger: BlockLedger) -> pd.DataFrame:
    """Events that contradict the pool state (:mod:`kvdiag.pool.blockledger` defines the kinds):
    double_release, release_unheld (also normal for blocks allocated before recording began),
    alloc_in_use, evict_held; every one with ``keep_history``, else the first of each kind
    (``ledger.anomaly_counts`` has the counts)."""
    return pd.DataFrame([{"kind": a.kind, "ts_ns": a.ts_ns, "block_id": a.block_id,
                          "request_id": a.request_id} for a in ledger.anomalies],
                        columns=["kind", "ts_ns", "block_id", "request_id"])


def finished_holding_finding(ledger: BlockLedger, grace_s: float = DEFAULT_GRACE_S,
                             now_ns: Optional[int] = None) -> Finding:
    """Rule ``leak.finished_holding`` at ``now_ns`` (default: the last event's time)."""
    now = ledger.last_ts_ns if now_ns is None else now_ns
    held = ledger.held_by_finished(now, int(grace_s * 1e9))
    title = f"finished requests release their KV blocks within {grace_s:g} s"
    finished = ledger.finished_requests
    if finished == 0:
        return Finding("leak.finished_holding", "n/a", title, "no finished request in the window")
    if not held:
        return Finding("leak.finished_holding", rules.finished_holding_status(0), title,
                       f"0 of {finished} finished requests still hold blocks", {"finished_requests": finished})
    blocks = sum(len(b) for b in held.values())
    named = dict(sorted(held.items(), key=lambda kv: -len(kv[1]))[:MAX_NAMED])
    return Finding("leak.finished_holding", rules.finished_holding_status(len(held)), title,
                   f"{len(held)} of {finished} finished requests still hold {blocks} blocks "
                   f"more than {grace_s:g} s after finishing",
                   {"requests": {str(k): [int(b) for b in v] for k, v in named.items()},
                    "num_requests": len(held), "num_blocks": blocks, "grace_s": grace_s,
                    "finished_requests": finished, "now_ns": now})


def double_release_finding(ledger: BlockLedger) -> Finding:
    """Rule ``leak.double_release``: releases of a block the same request had already released."""
    count = ledger.anomaly_counts["double_release"]
    title = "no KV block is released twice"
    if not ledger.block_events and not ledger.finished_requests:
        return Finding("leak.double_release", "n/a", title, "no block events")
    if not count:
        return Finding("leak.double_release", rules.double_release_status(0), title, "0 double releases")
    doubles = [a for a in ledger.anomalies if a.kind == "double_release"][:MAX_NAMED]
    return Finding("leak.double_release", rules.double_release_status(count), title,
                   f"{count} double releases by {len(ledger.double_release_requests)} requests",
                   {"releases": [{"request_id": str(a.request_id), "block_id": int(a.block_id), "ts_ns": a.ts_ns}
                                 for a in doubles], "count": count})


def ledger_findings(ledger: BlockLedger, grace_s: float = DEFAULT_GRACE_S,
                    now_ns: Optional[int] = None) -> list[Finding]:
    """The two rules a ledger decides, under the ids the doctor reports them with
    (``leak.release_paths`` for ``leak.finished_holding``, ``leak.double_release``): what
    ``kvdiag top`` shows from its own ledger, without an event window."""
    held = finished_holding_finding(ledger, grace_s, now_ns)
    return [replace(held, rule="leak.release_paths"), double_release_finding(ledger)]


def prefill_spans(arrived: pd.DataFrame, scheduled: pd.DataFrame, first_token: pd.DataFrame,
                  finished: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per request, when its prefill ran: from its first scheduling (a log without scheduling
    events: its arrival) to its first output token or its finish, whichever came first; a
    request with neither in the window is still in its prefill at the window's end (end
    +inf). Frames of ``RequestArrived``/``RequestScheduled``/``RequestFirstToken``/
    ``RequestFinished`` (columns ``request_id``, ``ts_ns``). Returns (start_ns, end_ns)."""
    first = (scheduled if len(scheduled) else arrived)
    if first is None or not len(first):
        return np.zeros(0, dtype="float64"), np.zeros(0, dtype="float64")
    start = first.groupby("request_id")["ts_ns"].min()
    ends = [f.groupby("request_id")["ts_ns"].min() for f in (first_token, finished) if f is not None and len(f)]
    end = pd.concat(ends, axis=1).min(axis=1).reindex(start.index) if ends else pd.Series(np.nan, index=start.index)
    s_ns = start.to_numpy(dtype="float64")
    e_ns = np.maximum(end.fillna(np.inf).to_numpy(dtype="float64"), s_ns)
    return s_ns, e_ns


def _mid_prefill(ts_ns: np.ndarray, spans: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Whether some request was in its prefill (start <= t < end) at each time."""
    start, end = np.sort(spans[0]), np.sort(spans[1])
    t = np.asarray(ts_ns, dtype="float64")
    return (np.searchsorted(start, t, side="right") - np.searchsorted(end, t, side="right")) > 0


def pool_growth_finding(pool_samples: pd.DataFrame, min_growth_blocks: int = MIN_POOL_GROWTH_BLOCKS,
                        min_samples: int = MIN_POOL_GROWTH_SAMPLES,
                        prefill: Optional[tuple[np.ndarray, np.ndarray]] = None) -> Finding:
    """Rule ``leak.pool_growth``: among ``KVPoolSample`` rows taken at the window's lowest
    running-request count, blocks used by live requests at the last such sample minus at the
    first (at least ``min_samples`` samples). Real demand moves with running requests; a
    leak raises the floor. Samples taken while a request was in its prefill (``prefill``:
    :func:`prefill_spans`) are left out: a prompt's chunked prefill grows the pool at a
    constant running count, and a window cut mid-prefill would end on it."""
    title = "KV pool occupancy does not grow while live requests don't"
    n = 0 if pool_samples is None else len(pool_samples)
    if pool_samples is not None and n and prefill is not None and len(prefill[0]):
        pool_samples = pool_samples[~_mid_prefill(pool_samples["ts_ns"].to_numpy(), prefill)]
    if pool_samples is None or len(pool_samples) < min_samples:
        have = 0 if pool_samples is None else len(pool_samples)
        why = "KV pool samples" + (" outside prefills" if prefill is not None and have < n else "")
        return Finding("leak.pool_growth", "n/a", title, too_few(have, min_samples, why),
                       {"samples": have, "needed": min_samples})
    floor = int(pool_samples["running_requests"].min())
    at_floor = pool_samples[pool_samples["running_requests"] == floor].sort_values("ts_ns")
    if len(at_floor) < min_samples:
        return Finding("leak.pool_growth", "n/a", title,
                       too_few(len(at_floor), min_samples,
                               f"KV pool samples at the lowest load ({floor} running)"),
                       {"samples": int(len(at_floor)), "needed": min_samples})
    first, last = at_floor.iloc[0], at_floor.iloc[-1]
    growth = int(last["blocks_used"] - first["blocks_used"])
    evidence = {"running_requests": floor, "blocks_used_first": int(first["blocks_used"]),
                "blocks_used_last": int(last["blocks_used"]), "ts_first_ns": int(first["ts_ns"]),
                "ts_last_ns": int(last["ts_ns"]), "samples": int(len(at_floor)), "growth_blocks": growth}
    status = rules.pool_growth_status(growth, min_growth_blocks)
    verb = "grew" if status == "fail" else "changed"
    return Finding("leak.pool_growth", status, title,
                   f"blocks used {verb} by {growth} at a constant {floor} running requests", evidence)


def leak_findings(events: Iterable[Event], pool_samples: Optional[pd.DataFrame] = None,
                  grace_s: float = DEFAULT_GRACE_S, now_ns: Optional[int] = None,
                  prefill: Optional[tuple[np.ndarray, np.ndarray]] = None) -> list[Finding]:
    """All three leak rules over one event sequence (time order), judged at ``now_ns``
    (default: the sequence's last event of any type, the end of the window it covers, not its
    last block event); ``prefill``: the requests' prefill spans (:func:`prefill_spans`) for
    ``leak.pool_growth``."""
    events = list(events)
    if now_ns is None and events:
        now_ns = max(e.ts_ns for e in events)
    ledger = ledger_from_events(events, keep_history=False)
    return [finished_holding_finding(ledger, grace_s, now_ns), double_release_finding(ledger),
            pool_growth_finding(pool_samples, prefill=prefill)]


def outliver_finding(outlivers: list, grace_s: float = 0.0) -> Finding:
    """Rule ``leak.tracked_objects``: objects registered with ``kvdiag.track`` that are still
    alive after their owner ended (``outlivers``: ``Tracker.outliving(grace_s)``)."""
    title = "tracked cache objects die with their owner"
    if not outlivers:
        return Finding("leak.tracked_objects", "pass", title, "no tracked object outlives its owner")
    total = sum(o.nbytes for o in outlivers)
    return Finding("leak.tracked_objects", "fail", title,
                   f"{len(outlivers)} tracked objects ({total} bytes) outlive their owner by over {grace_s:g} s",
                   {"objects": [{"label": o.label, "type": o.type_name, "nbytes": o.nbytes, "owner": o.owner,
                                 "outlived_s": round(o.outlived_s, 3)} for o in outlivers[:MAX_NAMED]],
                    "count": len(outlivers), "bytes": total})


DISTRIBUTION_COLUMNS = ["quantity", "count", "mean_ns", "p50_ns", "p90_ns", "p99_ns", "max_ns"]


def distribution_frame(episodes: pd.DataFrame) -> pd.DataFrame:
    """Distributions of block lifetime (allocation -> last release) and idle-before-evict
    (cached -> evicted) over the episodes where each is known."""
    rows = []
    for q in ("lifetime_ns", "idle_before_evict_ns"):
        v = episodes[q].dropna() if q in episodes else pd.Series(dtype="float64")
        rows.append({"quantity": q, "count": int(len(v)),
                     **({"mean_ns": v.mean(), "p50_ns": v.quantile(0.5), "p90_ns": v.quantile(0.9),
                         "p99_ns": v.quantile(0.99), "max_ns": v.max()} if len(v) else
                        {k: float("nan") for k in DISTRIBUTION_COLUMNS[2:]})})
    return pd.DataFrame(rows, columns=DISTRIBUTION_COLUMNS)
