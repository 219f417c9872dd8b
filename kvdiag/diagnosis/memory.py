"""Memory over time by source, where it goes, and how full the KV pool's blocks are.

Sources (all bytes): NVML's device and per-process use, torch's allocator (reserved,
allocated), the KV pool (blocks x block bytes: held by live requests, held only by the prefix
cache, the pool's capacity) and each process's host RSS.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis.frames import Logs, NodeName
from kvdiag.events.schema import AllocatorSample, KVPoolSample, NvmlSample, ProcessSample

COLUMNS = ["ts_ns", "node", "source", "bytes"]


def _long(ts, node, source, values) -> pd.DataFrame:
    return pd.DataFrame({"ts_ns": ts.to_numpy(), "node": node.to_numpy(),
                         "source": source, "bytes": pd.to_numeric(values).to_numpy(dtype="float64")})


def kv_pool_bytes(logs: Logs) -> pd.DataFrame:
    """KVPoolSample rows with the block bytes of their node applied: columns ts_ns, node,
    used_bytes (blocks held by live requests), cached_bytes (held only by the prefix cache),
    capacity_bytes (all blocks). Nodes whose block size is unknown are left out."""
    kp = logs.frame(KVPoolSample)
    out = []
    for node, g in kp.groupby("node", sort=False):
        bb = logs.block_bytes(node)
        if bb is None:
            continue
        out.append(pd.DataFrame({
            "ts_ns": g["ts_ns"].to_numpy(), "node": node,
            "used_bytes": g["blocks_used"].to_numpy(dtype="float64") * bb,
            "cached_bytes": g["blocks_cached"].to_numpy(dtype="float64") * bb,
            "capacity_bytes": g["num_blocks"].to_numpy(dtype="float64") * bb,
        }))
    cols = ["ts_ns", "node", "used_bytes", "cached_bytes", "capacity_bytes"]
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=cols)


def memory_over_time(logs: Logs) -> pd.DataFrame:
    """Long frame ts_ns, node, source, bytes with one series per source (absent sources
    have no rows)."""
    parts = []
    nv = logs.frame(NvmlSample)
    if len(nv):
        dev = "gpu" + nv["device"].astype(str)
        for col, label in (("memory_used_bytes", "nvml used"),
                           ("process_memory_bytes", "nvml process")):
            ok = nv[col].notna()
            if ok.any():
                parts.append(_long(nv["ts_ns"][ok], nv["node"][ok],
                                   label + " (" + dev[ok] + ")", nv[col][ok]))
    al = logs.frame(AllocatorSample)
    if len(al):
        dev = "gpu" + al["device"].astype(str)
        parts.append(_long(al["ts_ns"], al["node"], "allocator reserved (" + dev + ")",
                           al["reserved_bytes"]))
        parts.append(_long(al["ts_ns"], al["node"], "allocator allocated (" + dev + ")",
                           al["allocated_bytes"]))
    kv = kv_pool_bytes(logs)
    if len(kv):
        parts.append(_long(kv["ts_ns"], kv["node"], "kv pool capacity", kv["capacity_bytes"]))
        parts.append(_long(kv["ts_ns"], kv["node"], "kv held by requests", kv["used_bytes"]))
        parts.append(_long(kv["ts_ns"], kv["node"], "kv prefix cache", kv["cached_bytes"]))
    ps = logs.frame(ProcessSample)
    if len(ps):
        label = "host rss pid " + ps["pid"].astype(str) + np.where(
            ps["name"].astype(str) != "", " (" + ps["name"].astype(str) + ")", "")
        parts.append(_long(ps["ts_ns"], ps["node"], label, ps["rss_bytes"]))
        for col, name in (("pss_bytes", "host pss"), ("swap_bytes", "host swap")):
            # logs older than schema 1.1 have no such column; PSS/swap are read less often
            ok = ps[col].notna() if col in ps else None
            if ok is not None and ok.any():
                parts.append(_long(ps["ts_ns"][ok], ps["node"][ok], label[ok].str.replace("host rss", name, n=1).to_numpy(),
                                   ps[col][ok]))
    if not parts:
        return pd.DataFrame(columns=COLUMNS)
    return pd.concat(parts, ignore_index=True).sort_values(["source", "ts_ns"], ignore_index=True)


def _last(df: pd.DataFrame, col: str) -> Optional[float]:
    v = df[col].dropna()
    return float(v.iloc[-1]) if len(v) else None


def breakdown(logs: Logs, node: NodeName) -> pd.DataFrame:
    """Where one node's memory goes at its last samples, as waterfall rows: component,
    bytes, measure ("relative": a part; "total": the sum of the parts before it, as measured
    by the next layer). Layers: KV pool (held by requests, prefix cache, free blocks) ->
    torch allocated -> torch reserved -> NVML process memory; or, without a GPU, KV pool ->
    host RSS. A part is the measured layer minus the layer below, so it can be negative
    (e.g. pool pages never touched are not resident in RSS)."""
    rows: list[tuple[str, float, str]] = []
    kv = kv_pool_bytes(logs)
    kv = kv[kv["node"] == node]
    level = 0.0
    if len(kv):
        used, cached, cap = (float(kv[c].iloc[-1]) for c in
                             ("used_bytes", "cached_bytes", "capacity_bytes"))
        rows += [("kv held by requests", used, "relative"), ("kv prefix cache", cached, "relative"),
                 ("kv free blocks", cap - used - cached, "relative"), ("kv pool", cap, "total")]
        level = cap

    def layer(part: str, total_label: str, total: Optional[float]) -> None:
        nonlocal level
        if total is None:
            return
        rows.append((part, total - level, "relative"))
        rows.append((total_label, total, "total"))
        level = total

    al = logs.frame(AllocatorSample)
    al = al[al["node"] == node]
    nv = logs.frame(NvmlSample)
    nv = nv[nv["node"] == node]
    if len(al) or len(nv):
        layer("other tensors (weights, activations)", "torch allocated",
              _last(al, "allocated_bytes") if len(al) else None)
        layer("allocator cache (reserved, not allocated)", "torch reserved",
              _last(al, "reserved_bytes") if len(al) else None)
        layer("outside torch's allocator (CUDA context, other libs)", "nvml process memory",
              _last(nv, "process_memory_bytes") if len(nv) else None)
    else:
        ps = logs.frame(ProcessSample)
        ps = ps[ps["node"] == node]
        if len(ps):
            rss = float(ps.groupby("pid")["rss_bytes"].last().sum())
            layer("rest of the process (weights, activations, runtime)", "host rss", rss)
    return pd.DataFrame(rows, columns=["component", "bytes", "measure"])


def cum_at(ev_t: np.ndarray, ev_v: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Sum of ``ev_v`` over events with ``ev_t <= t``, for each t."""
    ev_t = np.asarray(ev_t, dtype="int64")
    order = np.argsort(ev_t, kind="stable")
    cs = np.concatenate([[0.0], np.cumsum(np.asarray(ev_v, dtype="float64")[order])])
    return cs[np.searchsorted(ev_t[order], np.asarray(t, dtype="int64"), side="right")]


def block_references(logs: Logs, node: NodeName, t: np.ndarray) -> Optional[np.ndarray]:
    """Blocks held per request, summed over requests, at each time t: blocks taken
    (allocated, reused from the prefix cache, adopted in place of a duplicate) minus blocks
    released. A block shared by k requests counts k times. None without block events."""
    ts, vs = [], []
    for tag, sign in (("block_allocated", 1), ("prefix_hit", 1), ("block_deduplicated", 1),
                      ("block_released", -1)):
        df = logs.frame(tag)
        df = df[df["node"] == node]
        ts.append(df["ts_ns"].to_numpy(dtype="int64"))
        vs.append(np.full(len(df), sign, dtype="float64"))
    if not sum(len(x) for x in ts):
        return None
    return cum_at(np.concatenate(ts), np.concatenate(vs), t)


def pool_occupancy(logs: Logs) -> pd.DataFrame:
    """Per KVPoolSample: block_occupancy = blocks_used / num_blocks; token_occupancy =
    tokens_held / (blocks_used x block_size) (NaN when no block is used); fragmentation =
    1 - token_occupancy (token slots allocated but empty, the pool's internal
    fragmentation); pressure = (blocks_used + blocks_cached) / num_blocks.

    Some adapters count ``tokens_held`` per request, so that a prefix block shared by k
    requests counts its tokens k times while ``blocks_used`` counts it once; then tokens_held
    exceeds the slots of the blocks used. When any sample shows that, the node's slots are
    counted the same way, per request (:func:`block_references` x block size), and
    ``basis`` says "per request" instead of "pool"."""
    kp = logs.frame(KVPoolSample)
    cols = ["ts_ns", "node", "block_occupancy", "token_occupancy", "fragmentation", "pressure",
            "basis", "blocks_used", "blocks_cached", "blocks_free", "num_blocks", "running_requests",
            "waiting_requests"]
    out = []
    for node, g in kp.groupby("node", sort=False):
        bs = logs.block_size_tokens(node)
        used = g["blocks_used"].to_numpy(dtype="float64")
        nb = g["num_blocks"].to_numpy(dtype="float64")
        held = g["tokens_held"].to_numpy(dtype="float64")
        slots_blocks, basis = used, "pool"
        if bs and (held > used * bs).any():
            refs = block_references(logs, node, g["ts_ns"].to_numpy())
            if refs is not None:
                slots_blocks, basis = refs, "per request"
        with np.errstate(divide="ignore", invalid="ignore"):
            tok = held / (slots_blocks * bs) if bs else np.full(len(g), np.nan)
            tok = np.where(slots_blocks > 0, tok, np.nan)
            d = pd.DataFrame({
                "ts_ns": g["ts_ns"].to_numpy(), "node": node,
                "block_occupancy": used / nb, "token_occupancy": tok, "fragmentation": 1 - tok,
                "pressure": (used + g["blocks_cached"].to_numpy(dtype="float64")) / nb,
                "basis": basis,
            })
        for c in cols[7:]:
            d[c] = g[c].to_numpy()
        out.append(d)
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=cols)


def allocator_fragmentation(logs: Logs) -> pd.DataFrame:
    """Per AllocatorSample: fragmentation = (reserved - allocated) / reserved, the share of
    torch's reserved memory not holding a live tensor."""
    al = logs.frame(AllocatorSample)
    res = al["reserved_bytes"].to_numpy(dtype="float64")
    with np.errstate(divide="ignore", invalid="ignore"):
        frag = np.where(res > 0, 1 - al["allocated_bytes"].to_numpy(dtype="float64") / res, np.nan)
    return pd.DataFrame({"ts_ns": al["ts_ns"].to_numpy(), "node": al["node"].to_numpy(),
                         "device": al["device"].to_numpy(), "fragmentation": frag,
                         "alloc_retries": al["alloc_retries"].to_numpy(),
                         "num_ooms": al["num_ooms"].to_numpy()})


def growth(ts_ns: np.ndarray, values: np.ndarray, edge: float = 0.1) -> Optional[float]:
    """Growth of a series: median of its last ``edge`` share of samples minus the median of
    its first (robust to single spikes); None with fewer than
    :data:`kvdiag.diagnosis.rules.MIN_MEMORY_SAMPLES` samples."""
    from kvdiag.diagnosis.rules import MIN_MEMORY_SAMPLES

    v = np.asarray(values, dtype="float64")[np.argsort(ts_ns, kind="stable")]
    v = v[np.isfinite(v)]
    if len(v) < MIN_MEMORY_SAMPLES:
        return None
    k = max(2, int(len(v) * edge))
    return float(np.median(v[-k:]) - np.median(v[:k]))
