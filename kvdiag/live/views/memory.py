"""Process and device memory: NVML, the torch allocator and host RSS/PSS/swap per process,
their histories by event-time bin, beside the KV pool's bytes (read from the pool's state)."""

from __future__ import annotations

from typing import Callable, Optional

from kvdiag.events import schema as s
from kvdiag.live.snapshot import History, MemoryView
from kvdiag.live.views.series import Series

RECENT_PROCESS_NS = 30_000_000_000
"""A process's RSS counts while its latest sample is at most 30 s old."""


class MemoryFold:
    def __init__(self) -> None:
        self.nvml: dict[int, s.NvmlSample] = {}
        self.allocator: dict[int, s.AllocatorSample] = {}
        self.processes: dict[int, s.ProcessSample] = {}
        self._latest_full_memory: dict[str, dict[int, int]] = {}  # "pss"/"swap" -> pid -> bytes
        self.series = {k: Series() for k in ("nvml", "allocator", "rss")}
        self.handlers = {s.AllocatorSample: self.on_allocator, s.NvmlSample: self.on_nvml,
                         s.ProcessSample: self.on_process}

    def on_allocator(self, ev: s.AllocatorSample, b, idx: int) -> None:
        self.allocator[ev.device] = ev
        self.series["allocator"].set(idx, sum(a.reserved_bytes for a in self.allocator.values()))

    def on_nvml(self, ev: s.NvmlSample, b, idx: int) -> None:
        self.nvml[ev.device] = ev
        used = [n.memory_used_bytes for n in self.nvml.values() if n.memory_used_bytes is not None]
        if used:
            self.series["nvml"].set(idx, sum(used))

    def on_process(self, ev: s.ProcessSample, b, idx: int) -> None:
        self.processes[ev.pid] = ev
        # PSS and swap are read less often than RSS: keep each process's last reading
        for key, value in (("pss", ev.pss_bytes), ("swap", ev.swap_bytes)):
            if value is not None:
                self._latest_full_memory.setdefault(key, {})[ev.pid] = value
        self.series["rss"].set(idx, self.rss(ev.ts_ns))

    def rss(self, now_ns: int) -> int:
        """Sum of the latest RSS of each process seen in the last 30 s."""
        return sum(p.rss_bytes for p in self.processes.values() if now_ns - p.ts_ns <= RECENT_PROCESS_NS)

    def trim(self, first: int) -> None:
        for series in self.series.values():
            series.trim(first)

    def memory_util_pct(self) -> Optional[float]:
        """NVML's memory-controller utilisation, mean over devices (None without it)."""
        mem = [n.memory_util_pct for n in self.nvml.values() if n.memory_util_pct is not None]
        return sum(mem) / len(mem) if mem else None

    def view(self, first: int, last: int, now_ns: int, kv_used: Optional[int], kv_total: Optional[int],
             kv_pool_history: History, hint: Callable[[tuple[str, ...], str], str]) -> MemoryView:
        """The memory view; ``kv_*``: the pool's bytes (used and cached; total) and history,
        ``hint``: the health fold's hint for an unavailable collector."""
        used = [n.memory_used_bytes for n in self.nvml.values() if n.memory_used_bytes is not None]
        total = [n.memory_total_bytes for n in self.nvml.values() if n.memory_total_bytes is not None]
        proc = [n.process_memory_bytes for n in self.nvml.values() if n.process_memory_bytes is not None]
        alloc = list(self.allocator.values())
        nvml_hint = hint(("nvml", "gpu"), "no NVML samples") if not self.nvml else ""
        alloc_hint = hint(("allocator", "cuda"), "no CUDA allocator samples") if not alloc else ""
        carry = 10
        rss = self.rss(now_ns) if self.processes else None
        host_only = not self.nvml and not alloc and bool(rss)  # no device: the pool is in RSS
        recent = {pid for pid, p in self.processes.items() if now_ns - p.ts_ns <= RECENT_PROCESS_NS}
        pss, swap = ([v for pid, v in self._latest_full_memory.get(key, {}).items() if pid in recent]
                     for key in ("pss", "swap"))
        return MemoryView(
            nvml_used_bytes=sum(used) if used else None, nvml_total_bytes=sum(total) if total else None,
            nvml_process_bytes=sum(proc) if proc else None,
            allocator_reserved_bytes=sum(a.reserved_bytes for a in alloc) if alloc else None,
            allocator_allocated_bytes=sum(a.allocated_bytes for a in alloc) if alloc else None,
            kv_pool_used_bytes=kv_used, kv_pool_total_bytes=kv_total,
            host_rss_bytes=rss,
            host_pss_bytes=sum(pss) if pss else None,
            host_swap_bytes=sum(swap) if swap else None,
            kv_pool_rss_share=kv_used / rss if host_only and kv_used is not None else None,
            kv_pool_total_rss_share=kv_total / rss if host_only and kv_total is not None else None,
            nvml_history=self.series["nvml"].history(first, last, carry),
            allocator_history=self.series["allocator"].history(first, last, carry),
            kv_pool_history=kv_pool_history,
            rss_history=self.series["rss"].history(first, last, carry),
            gpu_hint=nvml_hint, allocator_hint=alloc_hint)

    def allocator_fragmentation(self) -> Optional[float]:
        """(reserved - allocated) / reserved over devices (None without allocator samples)."""
        alloc = list(self.allocator.values())
        reserved = sum(a.reserved_bytes for a in alloc)
        return (reserved - sum(a.allocated_bytes for a in alloc)) / reserved if reserved else None
