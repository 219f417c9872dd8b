"""The engine's KV event stream as rules over a log: ``kv_events.gaps`` (batches the
subscriber lost) and ``kv_events.health`` (the stream's consistency:
:mod:`kvdiag.pool.kv_stream_health`). Verdicts come from :mod:`kvdiag.diagnosis.rules`.
"""

from __future__ import annotations

import pandas as pd

from kvdiag.diagnosis import block_facts, rules
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.frames import Logs
from kvdiag.events.schema import CollectorError, CollectorGap, EngineMetrics
from kvdiag.pool.blockfacts import KV_BATCHES_TAG, KV_HEALTH_COLUMNS, KV_HEALTH_TAG
from kvdiag.pool.prefix_cache import DUPLICATE_BATCH_MESSAGE, VLLM_KV_EVENTS_COLLECTOR


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
