"""What a recorder writes about the machine, beside the engine's events: the memory bandwidth
probe (:mod:`kvdiag.bandwidth_probe`, the peak that KV bandwidth utilisation divides by) and
host energy readings (:mod:`kvdiag.collectors.rapl`) at the start and the end of a run, and
whenever :meth:`HardwareRecorder.sample` is called. Failures become ``CollectorError`` /
``CollectorStatus`` events, never exceptions in the engine."""

from __future__ import annotations

import time
from typing import Optional

from kvdiag.collectors.rapl import RaplCollector
from kvdiag.schema import CollectorError, Event
from kvdiag.sinks import Sink

NAME = "bandwidth-probe"


def probe_event(device: Optional[str] = None) -> Event:
    """The (per-host cached) bandwidth probe of ``device`` (default: the process's CUDA device
    if it uses one, else the CPU), or the error that prevented it."""
    from kvdiag import bandwidth_probe
    try:
        return bandwidth_probe.probe(device or bandwidth_probe.default_device())
    except Exception as exc:  # no memory for the buffers, a CUDA error: the run goes on
        return CollectorError(ts_ns=time.time_ns(), collector=NAME, message=f"{type(exc).__name__}: {exc}")


class HardwareRecorder:
    """Records the probe and the RAPL status and readings into ``sink``."""

    def __init__(self, sink: Sink, device: Optional[str] = None, probe: bool = True) -> None:
        self.sink, self.device, self.probe = sink, device, probe
        self.rapl = RaplCollector()

    def start(self) -> "HardwareRecorder":
        self.sink.record(self.rapl.start())
        self.sample()
        if self.probe:
            self.sink.record(probe_event(self.device))
        return self

    def sample(self) -> None:
        for ev in self.rapl.sample():
            self.sink.record(ev)

    def stop(self) -> None:
        self.sample()
