"""The article's memory-leak checklist as rules over a log, each a :class:`Finding`:
``leak.memory_growth`` (process memory grows without matching KV growth),
``leak.release_paths`` / ``leak.double_release`` / ``leak.pool_growth`` (finished requests
whose blocks were never given back: :mod:`kvdiag.diagnosis.leaks`), ``fragmentation.kv_pool``
/ ``fragmentation.allocator`` (:mod:`kvdiag.diagnosis.pool_fragmentation`,
:mod:`kvdiag.diagnosis.fragmentation`) and ``leak.oom`` (OOMs, allocator retries). Thresholds
and verdicts come from :mod:`kvdiag.diagnosis.rules`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis import fragmentation as _allocator_fragmentation
from kvdiag.diagnosis import leaks as _leaks
from kvdiag.diagnosis import pool_fragmentation as _pool_fragmentation
from kvdiag.diagnosis import rules
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.frames import Logs, node_events
from kvdiag.diagnosis.memory import allocator_fragmentation, growth, kv_pool_bytes
from kvdiag.events.schema import (AllocatorSample, BlockAllocated, BlockDeduplicated, BlockEvicted, BlockReleased,
                                  EngineMetrics, EngineStep, KVPoolInfo, KVPoolSample, NvmlSample, PrefixHit,
                                  ProcessSample, RequestArrived, RequestFinished, RequestFirstToken,
                                  RequestScheduled)


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


LEDGER_EVENTS = (RequestArrived, RequestFinished, KVPoolInfo, BlockAllocated, PrefixHit,
                  BlockDeduplicated, BlockReleased, BlockEvicted)


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
        node_events(logs, node, LEDGER_EVENTS), pool_samples=kp[kp["node"] == node], now_ns=last[node],
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
