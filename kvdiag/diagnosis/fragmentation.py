"""Fragmentation of the CUDA caching allocator, from a snapshot or from allocator samples (a KV
block pool's, from engine events, is :mod:`kvdiag.diagnosis.pool_fragmentation`'s).

Allocator quantities, from ``torch.cuda.memory._snapshot()`` (structure documented in
``torch/cuda/memory.py``: segments of blocks with ``size``, ``requested_size``, ``address`` and
``state``; ``device_traces`` of alloc/free/segment actions):

- reserved bytes: a segment's ``total_size`` (what cudaMalloc returned);
- allocated bytes: sizes of its ``active_allocated`` blocks;
- slack bytes: reserved - allocated (cached by the allocator, not used by tensors);
- rounding bytes: size - requested_size over allocated blocks (internal fragmentation);
- inactive-split bytes: inactive blocks of segments split into more than one block (free
  memory that ``empty_cache`` cannot return because the segment is partly in use);
- external fragmentation: 1 - largest free block / total free bytes, over a segment, a pool or
  a device (0 when nothing is free): the share of free memory unusable for one allocation of
  the size of all free memory.
"""

from __future__ import annotations

from typing import Any, Optional

import pandas as pd

from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.rules import FRAGMENTATION_LIMIT, fragmentation_status
from kvdiag.events.snapshot_check import check_snapshot

SMALL_ALLOC_MAX_BYTES = 1 << 20
"""torch serves requests up to 1 MiB from the small pool, larger ones from the large pool."""

ALLOCATED = "active_allocated"
AWAITING = "active_awaiting_free"
INACTIVE = "inactive"


class SnapshotInvariantError(ValueError):
    """A snapshot contradicts itself (blocks do not tile their segment, sizes disagree).

    The functions that read a snapshot first check its shape
    (:func:`kvdiag.events.snapshot_check.check_snapshot`, raising ``SnapshotFormatError``): both
    errors are ``ValueError`` with a one-line message, and a check passed bounds their work by
    the snapshot's size."""


# ---------------------------------------------------------------- snapshot structure


def pool_name(segment: dict) -> str:
    """``large`` / ``small`` for the default pools, ``pool(a,b)/large`` for private pools
    (CUDA graphs, MemPool), with ``@stream N`` when the segment belongs to a side stream:
    an allocation is served only from free blocks of its own pool and stream."""
    name = segment.get("segment_type", "large")
    pool_id = tuple(segment.get("segment_pool_id") or (0, 0))
    if any(pool_id):
        name = f"pool({pool_id[0]},{pool_id[1]})/{name}"
    stream = segment.get("stream", 0) or 0
    if stream:
        name += f"@stream {stream}"
    return name


def check_segment(segment: dict) -> None:
    """Assert a segment's invariants: its blocks tile it (contiguous from its address, sizes
    summing to ``total_size``, so free + allocated + awaiting-free == reserved), and its
    ``allocated_size`` / ``active_size`` (when present) equal the sums over its blocks."""
    blocks = sorted(segment["blocks"], key=lambda b: b["address"])
    where = f"segment at {segment.get('address', 0):#x}"
    expandable = bool(segment.get("is_expandable"))
    cursor = segment.get("address", blocks[0]["address"] if blocks else 0)
    for b in blocks:
        if b["state"] not in (ALLOCATED, AWAITING, INACTIVE):
            raise SnapshotInvariantError(f"{where}: block {b['address']:#x} has unknown state {b['state']!r}")
        if not expandable and b["address"] != cursor:
            raise SnapshotInvariantError(
                f"{where}: block at {b['address']:#x} does not follow the previous block (expected {cursor:#x})")
        cursor = b["address"] + b["size"]
    total = sum(b["size"] for b in blocks)
    if not expandable and total != segment["total_size"]:
        raise SnapshotInvariantError(
            f"{where}: blocks sum to {total} bytes but the segment reserves {segment['total_size']}")
    allocated = sum(b["size"] for b in blocks if b["state"] == ALLOCATED)
    active = sum(b["size"] for b in blocks if b["state"] != INACTIVE)
    if "allocated_size" in segment and segment["allocated_size"] != allocated:
        raise SnapshotInvariantError(
            f"{where}: allocated_size {segment['allocated_size']} != {allocated} summed over its blocks")
    if "active_size" in segment and segment["active_size"] != active:
        raise SnapshotInvariantError(
            f"{where}: active_size {segment['active_size']} != {active} summed over its blocks")


def _free_runs(blocks: list[dict]) -> list[int]:
    """Sizes of maximal runs of adjacent inactive blocks (what one allocation could use)."""
    runs, current = [], 0
    for b in blocks:
        if b["state"] == INACTIVE:
            current += b["size"]
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs


def external_fragmentation(free_bytes: int, largest_free_bytes: int) -> float:
    """1 - largest free run / free (0 when nothing is free): the share of free memory unusable
    for one allocation of all of it."""
    return 0.0 if free_bytes == 0 else 1.0 - largest_free_bytes / free_bytes


SEGMENT_COLUMNS = [
    "device", "pool", "segment_address", "stream", "reserved_bytes", "allocated_bytes",
    "awaiting_free_bytes", "free_bytes", "slack_bytes", "rounding_bytes", "inactive_split_bytes",
    "largest_free_bytes", "num_blocks", "num_free_runs", "external_fragmentation",
]


def segment_frame(snapshot: dict) -> pd.DataFrame:
    """One row per segment with the quantities defined in the module docstring; checks each
    segment's invariants first (raises :class:`SnapshotInvariantError`)."""
    rows = []
    for seg in check_snapshot(snapshot)["segments"]:
        check_segment(seg)
        blocks = sorted(seg["blocks"], key=lambda b: b["address"])
        reserved = seg["total_size"]
        allocated = sum(b["size"] for b in blocks if b["state"] == ALLOCATED)
        awaiting = sum(b["size"] for b in blocks if b["state"] == AWAITING)
        free = sum(b["size"] for b in blocks if b["state"] == INACTIVE)
        runs = _free_runs(blocks)
        largest = max(runs, default=0)
        rows.append({
            "device": seg.get("device", 0),
            "pool": pool_name(seg),
            "segment_address": seg.get("address", 0),
            "stream": seg.get("stream", 0),
            "reserved_bytes": reserved,
            "allocated_bytes": allocated,
            "awaiting_free_bytes": awaiting,
            "free_bytes": free,
            "slack_bytes": reserved - allocated,
            "rounding_bytes": sum(b["size"] - b.get("requested_size", b["size"])
                                  for b in blocks if b["state"] == ALLOCATED),
            "inactive_split_bytes": free if len(blocks) > 1 else 0,
            "largest_free_bytes": largest,
            "num_blocks": len(blocks),
            "num_free_runs": len(runs),
            "external_fragmentation": external_fragmentation(free, largest),
        })
    return pd.DataFrame(rows, columns=SEGMENT_COLUMNS)


def _rollup(segments: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    sums = ["reserved_bytes", "allocated_bytes", "awaiting_free_bytes", "free_bytes", "slack_bytes",
            "rounding_bytes", "inactive_split_bytes", "num_blocks"]
    if segments.empty:
        return pd.DataFrame(columns=keys + sums + ["num_segments", "largest_free_bytes", "external_fragmentation"])
    g = segments.groupby(keys, sort=True)
    out = g[sums].sum()
    out["num_segments"] = g.size()
    out["largest_free_bytes"] = g["largest_free_bytes"].max()
    out["external_fragmentation"] = [
        external_fragmentation(f, l) for f, l in zip(out["free_bytes"], out["largest_free_bytes"])]
    return out.reset_index()


def pool_frame(snapshot: dict) -> pd.DataFrame:
    """Per (device, pool): summed bytes, largest free run, external fragmentation (a free run
    cannot serve a request of another pool or stream, so pools are the unit that matters)."""
    return _rollup(segment_frame(snapshot), ["device", "pool"])


def device_frame(snapshot: dict) -> pd.DataFrame:
    """Per device: summed bytes and external fragmentation over all its segments."""
    return _rollup(segment_frame(snapshot), ["device"])


UNSERVABLE_COLUMNS = ["device", "pool", "size_class_bytes", "free_bytes", "largest_free_bytes"]


def unservable_size_classes(snapshot: dict) -> pd.DataFrame:
    """Power-of-two request sizes (from 512 B) that a pool holds enough free bytes for in
    total but cannot serve from any single free run: each would need a new cudaMalloc (or
    OOM) purely because of fragmentation. Small-pool classes stop at 1 MiB, the largest size
    that pool serves."""
    pools = pool_frame(snapshot)
    rows = []
    for p in pools.itertuples(index=False):
        cap = p.free_bytes
        if p.pool.split("/")[-1].startswith("small"):
            cap = min(cap, SMALL_ALLOC_MAX_BYTES)
        size = 512
        while size <= cap:
            if size > p.largest_free_bytes:
                rows.append({"device": p.device, "pool": p.pool, "size_class_bytes": size,
                             "free_bytes": p.free_bytes, "largest_free_bytes": p.largest_free_bytes})
            size *= 2
    return pd.DataFrame(rows, columns=UNSERVABLE_COLUMNS)


FRAGMENTER_COLUMNS = [
    "device", "pool", "segment_address", "block_address", "size_bytes", "requested_bytes",
    "free_bytes_before", "free_bytes_after", "trace_index", "time_us", "frame",
]


def _top_frame(frames: Optional[list]) -> str:
    for f in frames or []:
        return f"{f.get('filename', '?')}:{f.get('line', 0)} {f.get('name', '?')}"
    return ""


def fragmenting_allocations(snapshot: dict) -> pd.DataFrame:
    """The live allocations that split a segment's free memory: an allocated block with free
    bytes on both sides within its segment keeps those free runs from coalescing. For each,
    the latest ``alloc`` entry at its address in ``device_traces`` (when memory history was
    recorded) gives the trace index, time and allocation site."""
    last_alloc: dict[tuple[int, int], tuple[int, dict]] = {}
    for device, trace in enumerate(check_snapshot(snapshot).get("device_traces") or []):
        for i, entry in enumerate(trace):
            if entry.get("action") == "alloc":
                last_alloc[(device, entry.get("addr", -1))] = (i, entry)
    rows = []
    for seg in snapshot.get("segments", []):
        blocks = sorted(seg["blocks"], key=lambda b: b["address"])
        free_prefix, total_free = [], 0
        for b in blocks:
            free_prefix.append(total_free)
            if b["state"] == INACTIVE:
                total_free += b["size"]
        device = seg.get("device", 0)
        for b, before in zip(blocks, free_prefix):
            after = total_free - before
            if b["state"] == ALLOCATED and before > 0 and after > 0:
                idx, entry = last_alloc.get((device, b["address"]), (None, {}))
                rows.append({
                    "device": device, "pool": pool_name(seg), "segment_address": seg.get("address", 0),
                    "block_address": b["address"], "size_bytes": b["size"],
                    "requested_bytes": b.get("requested_size", b["size"]),
                    "free_bytes_before": before, "free_bytes_after": after,
                    "trace_index": idx, "time_us": entry.get("time_us"),
                    "frame": _top_frame(entry.get("frames") or b.get("frames")),
                })
    return pd.DataFrame(rows, columns=FRAGMENTER_COLUMNS)


TRACE_COLUMNS = ["device", "trace_index", "action", "addr", "size_bytes", "time_us", "frame"]


def trace_frame(snapshot: dict) -> pd.DataFrame:
    """``device_traces`` flattened: one row per allocator action (alloc, free_requested,
    free_completed, segment_alloc, segment_free, oom, snapshot)."""
    rows = []
    for device, trace in enumerate(check_snapshot(snapshot).get("device_traces") or []):
        for i, e in enumerate(trace):
            rows.append({"device": device, "trace_index": i, "action": e.get("action"),
                         "addr": e.get("addr"), "size_bytes": e.get("size"),
                         "time_us": e.get("time_us"), "frame": _top_frame(e.get("frames"))})
    return pd.DataFrame(rows, columns=TRACE_COLUMNS)


# ---------------------------------------------------------------- allocator counters


ALLOCATOR_COLUMNS = [
    "ts_ns", "device", "reserved_bytes", "allocated_bytes", "slack_bytes",
    "inactive_split_bytes", "inactive_split_share", "alloc_retries", "num_ooms",
]


def allocator_frame(samples: pd.DataFrame) -> pd.DataFrame:
    """From ``AllocatorSample`` rows: slack = reserved - allocated and inactive-split share =
    inactive-split bytes / reserved bytes (0 when nothing is reserved)."""
    if samples is None or samples.empty:
        return pd.DataFrame(columns=ALLOCATOR_COLUMNS)
    out = samples[["ts_ns", "device", "reserved_bytes", "allocated_bytes", "inactive_split_bytes",
                   "alloc_retries", "num_ooms"]].copy()
    out["slack_bytes"] = out["reserved_bytes"] - out["allocated_bytes"]
    reserved = out["reserved_bytes"].where(out["reserved_bytes"] > 0)
    out["inactive_split_share"] = (out["inactive_split_bytes"] / reserved).fillna(0.0)
    return out[ALLOCATOR_COLUMNS]


# ---------------------------------------------------------------- the 15% rule


def allocator_fragmentation_finding(snapshot: Optional[dict] = None,
                                    samples: Optional[pd.DataFrame] = None,
                                    limit: float = FRAGMENTATION_LIMIT) -> Finding:
    """Rule ``fragmentation.allocator``: the worst device's external fragmentation from a
    snapshot, else the latest inactive-split share from allocator samples, against ``limit``."""
    title = f"CUDA allocator fragmentation under {limit:.0%}"
    if snapshot is not None and snapshot.get("segments"):
        dev = device_frame(snapshot)
        worst = dev.loc[dev["external_fragmentation"].idxmax()]
        value = float(worst["external_fragmentation"])
        evidence = {"source": "snapshot", "device": int(worst["device"]), "value": value,
                    "free_bytes": int(worst["free_bytes"]), "largest_free_bytes": int(worst["largest_free_bytes"]),
                    "reserved_bytes": int(worst["reserved_bytes"]), "slack_bytes": int(worst["slack_bytes"]),
                    "limit": limit}
        what = "external fragmentation (1 - largest free run / free bytes)"
    elif samples is not None and not samples.empty:
        frame = allocator_frame(samples)
        last = frame.iloc[-1]
        value = float(last["inactive_split_share"])
        evidence = {"source": "memory_stats", "device": int(last["device"]), "value": value,
                    "inactive_split_bytes": int(last["inactive_split_bytes"]),
                    "reserved_bytes": int(last["reserved_bytes"]), "limit": limit}
        what = "inactive-split share of reserved bytes"
    else:
        return Finding("fragmentation.allocator", "n/a", title,
                       "no CUDA allocator data (no snapshot, no allocator samples)", {"limit": limit})
    status = fragmentation_status(value, limit)
    return Finding("fragmentation.allocator", status, title,
                   f"{what}: {value:.1%} (limit {limit:.0%})", evidence)


def snapshot_summary(snapshot: dict) -> dict[str, Any]:
    """Device totals of a snapshot as plain numbers (for ``--json`` output)."""
    dev = device_frame(snapshot)
    return {"devices": dev.to_dict(orient="records"),
            "unservable_size_classes": unservable_size_classes(snapshot).to_dict(orient="records"),
            "fragmenting_allocations": int(len(fragmenting_allocations(snapshot)))}
