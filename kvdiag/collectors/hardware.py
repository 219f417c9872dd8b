"""What a recorder writes about the machine, beside the engine's events: the memory bandwidth
probe (:mod:`kvdiag.collectors.bandwidth_probe`, the peak that KV bandwidth utilisation divides by), host
energy readings (:mod:`kvdiag.collectors.rapl`) and, in the agent, NVML readings of the GPUs
(energy counter, memory-controller utilisation: :mod:`kvdiag.collectors.nvml`), at the start,
every ``interval_s`` and at the end of a run. Failures become ``CollectorError`` /
``CollectorStatus`` events, never exceptions in the engine."""

from __future__ import annotations

import threading
import time
from typing import Optional

from kvdiag.collectors.rapl import RaplCollector
from kvdiag.events.schema import CollectorError, Event
from kvdiag.events.sinks import Sink

NAME = "bandwidth-probe"


def probe_event(device: Optional[str] = None) -> Event:
    """The (per-host cached) bandwidth probe of ``device`` (default: the process's CUDA device
    if it uses one, else the CPU), or the error that prevented it."""
    from kvdiag.collectors import bandwidth_probe
    try:
        return bandwidth_probe.probe(device or bandwidth_probe.default_device())
    except Exception as exc:  # no memory for the buffers, a CUDA error: the run goes on
        return CollectorError(ts_ns=time.time_ns(), collector=NAME, message=f"{type(exc).__name__}: {exc}")


class HardwareRecorder:
    """Records the probe, RAPL's (and with ``nvml``, NVML's) status and readings into ``sink``;
    with ``interval_s``, a daemon thread samples them until :meth:`stop`."""

    def __init__(self, sink: Sink, device: Optional[str] = None, probe: bool = True, nvml: bool = False,
                 interval_s: Optional[float] = None) -> None:
        self.sink, self.device, self.probe, self.interval_s = sink, device, probe, interval_s
        self.rapl = RaplCollector()
        self.nvml = None
        if nvml:
            from kvdiag.collectors.nvml import NvmlCollector
            self.nvml = NvmlCollector()
        self._probe_pending = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "HardwareRecorder":
        self.sink.record(self.rapl.start())
        if self.nvml is not None:
            self.sink.record(self.nvml.start())
        self.sample()
        gpus = self.nvml is not None and self.nvml.available
        self._probe_pending = self.probe
        if self.probe and (self.device is not None or not gpus or _cuda_initialized()):
            self._probe_now()
        # else on a GPU machine before the engine initialised CUDA: probe the GPU once it has
        # (the sampling thread looks), or the CPU at stop if it never does
        if self.interval_s and (self.rapl.zones or gpus or self._probe_pending):
            self._thread = threading.Thread(target=self._run, name="kvdiag-hardware", daemon=True)
            self._thread.start()
        return self

    def _probe_now(self, device: Optional[str] = None) -> None:
        self._probe_pending = False
        self.sink.record(probe_event(device or self.device))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self._probe_pending and _cuda_initialized():
                    self._probe_now()
                self.sample()
            except Exception:  # the sink closed under us (the run is ending): stop quietly
                return

    def sample(self) -> None:
        for ev in self.rapl.sample():
            self.sink.record(ev)
        if self.nvml is not None:
            for ev in self.nvml.sample():
                self.sink.record(ev)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._probe_pending:
            self._probe_now("cuda:0" if _cuda_initialized() else "cpu")
        self.sample()
        if self.nvml is not None:
            self.nvml.close()


def _cuda_initialized() -> bool:
    """Whether this process's torch has initialised CUDA (without initialising anything)."""
    import sys
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False
