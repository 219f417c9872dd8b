"""torch's CUDA caching allocator, observed in-process.

On CUDA: :meth:`AllocatorCollector.sample` reads ``torch.cuda.memory_stats(device)`` (the
"all" pool, current values) into ``AllocatorSample`` events; :meth:`start` can turn on
torch's memory history with a bounded entry count; :meth:`snapshot` writes
``torch.cuda.memory._snapshot()`` as JSON beside the log, and an OOM observer does the same
when the allocator raises out-of-memory. Without CUDA: one ``CollectorStatus(available=False)``
from :meth:`start`, no samples, nothing raised.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from kvdiag.events.schema import AllocatorSample, CollectorError, CollectorStatus
from kvdiag.events.sinks import NullSink, Sink

NAME = "cuda-allocator"


def sample_from_stats(stats: dict, device: int, ts_ns: int) -> AllocatorSample:
    """An ``AllocatorSample`` from a ``memory_stats()`` dict (keys documented in
    ``torch/cuda/memory.py``: ``<stat>.all.current``, ``num_alloc_retries``, ``num_ooms``)."""
    cur = lambda key: int(stats.get(f"{key}.all.current", 0))  # noqa: E731
    return AllocatorSample(ts_ns=ts_ns, device=device, reserved_bytes=cur("reserved_bytes"),
                           allocated_bytes=cur("allocated_bytes"), active_bytes=cur("active_bytes"),
                           inactive_split_bytes=cur("inactive_split_bytes"),
                           alloc_retries=int(stats.get("num_alloc_retries", 0)),
                           num_ooms=int(stats.get("num_ooms", 0)))


class AllocatorCollector:
    """``snapshot_dir``: where snapshots go (beside the log); ``history_entries``: when set,
    ``start`` enables torch's memory history keeping at most that many trace entries."""

    def __init__(self, sink: Optional[Sink] = None, snapshot_dir: str | os.PathLike = ".",
                 history_entries: Optional[int] = None, snapshot_prefix: str = "kvdiag-snapshot") -> None:
        self.sink = sink or NullSink()
        self.snapshot_dir = Path(snapshot_dir)
        self.history_entries = history_entries
        self.snapshot_prefix = snapshot_prefix
        self.available = False
        self.devices: list[int] = []
        self.snapshots: list[Path] = []

    def start(self) -> CollectorStatus:
        """Check for CUDA, enable history and the OOM observer; report the status once."""
        now = time.time_ns()
        try:
            import torch
            if not torch.cuda.is_available():
                return self._status(False, "no CUDA device (CPU-only torch or no GPU): allocator stats are N/A")
            self.devices = list(range(torch.cuda.device_count()))
            if self.history_entries:
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=int(self.history_entries))
            torch._C._cuda_attach_out_of_memory_observer(self._on_oom)
        except Exception as exc:
            return self._status(False, f"CUDA allocator not readable ({type(exc).__name__}: {exc}): N/A")
        self.available = True
        return self._status(True, f"{len(self.devices)} CUDA device(s)"
                            + (f", memory history {self.history_entries} entries" if self.history_entries else ""),
                            now)

    def _status(self, ok: bool, hint: str, now: Optional[int] = None) -> CollectorStatus:
        st = CollectorStatus(ts_ns=now or time.time_ns(), collector=NAME, available=ok, hint=hint)
        self.sink.record(st)
        return st

    def sample(self) -> list[AllocatorSample]:
        """One sample per device, recorded into the sink and returned (empty without CUDA)."""
        if not self.available:
            return []
        out = []
        try:
            import torch
            now = time.time_ns()
            for d in self.devices:
                ev = sample_from_stats(torch.cuda.memory_stats(d), d, now)
                self.sink.record(ev)
                out.append(ev)
        except Exception as exc:
            self.sink.record(CollectorError(ts_ns=time.time_ns(), collector=NAME, message=str(exc)))
        return out

    def snapshot(self, reason: str = "on-demand") -> Optional[Path]:
        """Write ``torch.cuda.memory._snapshot()`` as JSON; returns its path (None without
        CUDA or on failure, which is recorded as a ``CollectorError``)."""
        if not self.available:
            return None
        try:
            import torch
            from kvdiag.events.snapshot_io import save_snapshot_json
            from kvdiag.paths import make_private_dirs
            make_private_dirs(self.snapshot_dir)
            path = self.snapshot_dir / f"{self.snapshot_prefix}-{reason}-{time.time_ns()}.json"
            save_snapshot_json(torch.cuda.memory._snapshot(), path)
            self.snapshots.append(path)
            return path
        except Exception as exc:
            self.sink.record(CollectorError(ts_ns=time.time_ns(), collector=NAME,
                                            message=f"snapshot failed: {exc}"))
            return None

    def _on_oom(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        # torch calls this from inside the failing allocation: keep it small and never raise
        try:
            self.snapshot(reason=f"oom-dev{device}")
            self.sample()
        except Exception:
            pass

    def stop(self) -> None:
        if self.available and self.history_entries:
            try:
                import torch
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:
                pass
