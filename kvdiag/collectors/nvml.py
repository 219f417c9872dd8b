"""NVIDIA devices through NVML (``pynvml`` from ``nvidia-ml-py``): memory, utilization
(SM and memory controller), power, the energy counter, temperature, and GPU memory of the target's processes.

Without a driver or GPU ``nvmlInit`` fails: :meth:`NvmlCollector.start` returns one
``CollectorStatus(available=False, hint=...)`` and :meth:`sample` returns nothing. Each field
is read on its own, so one unsupported field (power on some boards) is null, not a failure.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional

from kvdiag.events.schema import CollectorStatus, NvmlSample

NAME = "nvml"


class NvmlCollector:
    """Reads every device; ``pids()`` (optional) gives the target's process ids for
    ``process_memory_bytes``. ``nvml`` is the pynvml module (imported when None)."""

    def __init__(self, pids: Optional[Callable[[], Iterable[int]]] = None, nvml: Any = None) -> None:
        self.pids = pids
        self.nvml = nvml
        self.handles: list = []
        self.available = False
        self.field_errors: dict[str, str] = {}

    def start(self) -> CollectorStatus:
        """Initialise NVML; the status says whether devices can be read and, if not, why."""
        now = time.time_ns()
        try:
            if self.nvml is None:
                import pynvml
                self.nvml = pynvml
            self.nvml.nvmlInit()
            count = self.nvml.nvmlDeviceGetCount()
            self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except ImportError:
            return CollectorStatus(ts_ns=now, collector=NAME, available=False,
                                   hint="pynvml is not installed: pip install nvidia-ml-py")
        except Exception as exc:
            return CollectorStatus(ts_ns=now, collector=NAME, available=False, hint=_hint(exc))
        if not self.handles:
            return CollectorStatus(ts_ns=now, collector=NAME, available=False,
                                   hint="NVML found no GPU: GPU memory, power and energy are N/A")
        self.available = True
        return CollectorStatus(ts_ns=now, collector=NAME, available=True, hint=f"{len(self.handles)} GPU(s)")

    def _read(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # one unsupported field must not hide the others
            self.field_errors[name] = f"{type(exc).__name__}: {exc}"
            return None

    def sample(self) -> list[NvmlSample]:
        """One ``NvmlSample`` per device (empty when NVML is not available)."""
        if not self.available:
            return []
        nv, now = self.nvml, time.time_ns()
        pids = set(self.pids()) if self.pids else set()
        out = []
        for i, h in enumerate(self.handles):
            mem = self._read("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
            util = self._read("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
            out.append(NvmlSample(
                ts_ns=now, device=i,
                memory_used_bytes=None if mem is None else int(mem.used),
                memory_total_bytes=None if mem is None else int(mem.total),
                gpu_util_pct=None if util is None else float(util.gpu),
                memory_util_pct=None if getattr(util, "memory", None) is None else float(util.memory),
                power_mw=self._read("power", lambda: int(nv.nvmlDeviceGetPowerUsage(h))),
                energy_mj=self._read("energy", lambda: int(nv.nvmlDeviceGetTotalEnergyConsumption(h))),
                temperature_c=self._read("temperature",
                                         lambda: int(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
                process_memory_bytes=self._read("process_memory", lambda: _process_memory(nv, h, pids))
                if pids else None,
            ))
        return out

    def device_names(self) -> list[str]:
        """Each device's name (``nvmlDeviceGetName``; "" where it cannot be read)."""
        names = []
        for h in self.handles:
            name = self._read("name", lambda: self.nvml.nvmlDeviceGetName(h)) or ""
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return names

    def close(self) -> None:
        if self.available:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self.available = False


def _process_memory(nv: Any, handle: Any, pids: set[int]) -> int:
    """GPU memory used by ``pids`` on one device (compute and graphics contexts)."""
    total, seen = 0, set()
    for fn in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
        for p in fn(handle):
            if p.pid in pids and p.pid not in seen and p.usedGpuMemory is not None:
                seen.add(p.pid)
                total += int(p.usedGpuMemory)
    return total


def _hint(exc: Exception) -> str:
    name = type(exc).__name__
    if "LibraryNotFound" in name:
        return "no NVIDIA driver (libnvidia-ml.so not found): GPU memory, power and energy are N/A"
    if "DriverNotLoaded" in name:
        return "the NVIDIA driver is not loaded: GPU memory, power and energy are N/A"
    if "NoPermission" in name:
        return "no permission to query NVML: run as a user with access to /dev/nvidia*"
    return f"NVML unavailable ({name}: {exc}): GPU values are N/A"

