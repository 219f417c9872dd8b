"""What is visible of a served process tree from outside, without a kvdiag agent in it: the
collectors both ``kvdiag attach`` and ``kvdiag top --pid`` run (one code path).

- the process tree (procfs: RSS, threads, CPU time) and NVIDIA GPUs (NVML);
- the engine: vLLM (:mod:`kvdiag.collectors.vllm`), SGLang or TensorRT-LLM
  (:mod:`kvdiag.collectors.servers`) by its command line, else by its ``/metrics`` names;
- its Prometheus ``/metrics`` (``--metrics-url``, else found among the tree's listening
  ports), scraped into ``EngineMetrics`` at every sample;
- its KV events over ZMQ (``--kv-events``, else vLLM's ``/kv_event_sources`` or the
  ``--kv-events-config`` of a vLLM or SGLang command line).

Read-only towards the target: GETs, a ZMQ subscription, /proc and NVML. Every event goes to
``sink.record`` (the KV-event subscriber records from its own thread).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvdiag.events.schema import CollectorStatus

METRICS_PROBE_PERIOD_S = 5.0
"""Seconds between two searches of the tree's listening ports for a ``/metrics``."""


@dataclass
class OutsideOptions:
    """attach's and top's options for the outside collectors (``None``: found from the target)."""

    metrics_url: Optional[str] = None
    kv_events: Optional[str] = None
    kv_events_topic: str = ""
    kv_events_replay: Optional[str] = None
    kv_events_publisher: Optional[str] = None
    kv_events_raw: Optional[Path] = None  # where the raw KV-event stream is kept (None: not kept)
    hardware: bool = True  # record the hardware probe and RAPL (attach's log); top does without

    @classmethod
    def from_args(cls, args, kv_events_raw: Optional[Path] = None, hardware: bool = True) -> "OutsideOptions":
        """From attach's or top's parsed arguments (the options they share)."""
        return cls(metrics_url=getattr(args, "metrics_url", None), kv_events=getattr(args, "kv_events", None),
                   kv_events_topic=getattr(args, "kv_events_topic", "") or "",
                   kv_events_replay=getattr(args, "kv_events_replay", None),
                   kv_events_publisher=getattr(args, "kv_events_publisher", None),
                   kv_events_raw=kv_events_raw, hardware=hardware)


class OutsideCollectors:
    """The outside collectors of one served tree (``procs``: a
    :class:`kvdiag.collectors.procfs.ProcessCollector`), sampled by the caller's loop with
    :meth:`sample` (which raises ``TargetGone`` when the target exited); :meth:`close` stops
    them."""

    def __init__(self, procs, sink, options: Optional[OutsideOptions] = None) -> None:
        from kvdiag.collectors import metrics, nvml, servers, vllm
        self.procs, self.sink = procs, sink
        self.options = options = options or OutsideOptions()
        self.nvml = nvml.NvmlCollector(pids=procs.pids)
        sink.record(self.nvml.start())
        self.hardware = None
        if options.hardware:
            from kvdiag.collectors.hardware import HardwareRecorder
            # the target's device is not ours to allocate on: probe the GPU only through torch
            # already imported here, else the host's memory
            self.hardware = HardwareRecorder(sink).start()
        self.metrics_url: Optional[str] = options.metrics_url
        self.metrics_mod = metrics
        self.next_probe = 0.0
        self.vllm = vllm.identify(procs.root)
        self.other = servers.identify(procs.root) if self.vllm is None else None  # SGLang, TRT-LLM
        self.engine = "vllm" if self.vllm is not None else self.other.engine if self.other else None
        self.engine_probed = False
        self.kv_events = None  # the ZMQ subscriber, once a stream is found
        self.kv_events_tried = False
        if self.vllm is not None:
            sink.record(CollectorStatus(ts_ns=time.time_ns(), collector="vllm", available=True,
                                        hint=self.vllm.describe()))
        if self.other is not None:
            sink.record(CollectorStatus(ts_ns=time.time_ns(), collector=self.other.engine,
                                        available=True, hint=self.other.describe()))
        if options.kv_events:
            self.kv_events_tried = True
            self._subscribe({"endpoint": options.kv_events, "topic": options.kv_events_topic,
                             "replay_endpoint": options.kv_events_replay})

    def publisher(self) -> str:
        """Who publishes the KV events: ``--kv-events-publisher``, else the recognised engine,
        else ``unknown``."""
        return self.options.kv_events_publisher or self.engine or "unknown"

    def describe(self) -> str:
        """What is read now: ``/metrics + KV events``, ``/metrics``, ``KV events`` or
        ``process tree`` (the host view only)."""
        parts = [name for name, on in (("/metrics", self.metrics_url), ("KV events", self.kv_events)) if on]
        return " + ".join(parts) or "process tree"

    def _subscribe(self, cfg: dict) -> None:
        """Subscribe to one KV-event endpoint (the subscriber side decided by
        :func:`kvdiag.collectors.vllm.subscriber_side`); the publisher named in the status."""
        from kvdiag.collectors import vllm
        from kvdiag.collectors.vllm_kv_events import KVEventSubscriber
        mode, address = vllm.subscriber_side(cfg["endpoint"])
        raw = self.options.kv_events_raw
        publisher = self.publisher()
        try:
            self.kv_events = KVEventSubscriber(address, self.sink, topic=cfg.get("topic") or "",
                                               replay_endpoint=cfg.get("replay_endpoint"),
                                               bind=(mode == "bind"), raw_path=raw,
                                               publisher=publisher).start()
        except Exception as exc:  # e.g. the address is taken by another subscriber
            self.sink.record(CollectorStatus(ts_ns=time.time_ns(), collector="vllm-kv-events",
                                             available=False, hint=f"{mode} {address}: {exc}"))
            return
        kept = f"; raw stream {raw}" if raw is not None else ""
        self.sink.record(CollectorStatus(ts_ns=time.time_ns(), collector="vllm-kv-events", available=True,
                                         hint=f"publisher {publisher}: {mode} {address}{kept}"))

    def probe_metrics(self) -> None:
        """Look for a ``/metrics`` among the tree's listening ports (every
        :data:`METRICS_PROBE_PERIOD_S` until one answers)."""
        from kvdiag.collectors.procfs import connect_host
        if self.metrics_url or time.monotonic() < self.next_probe:
            return
        self.next_probe = time.monotonic() + METRICS_PROBE_PERIOD_S
        ports = [(connect_host(ip), port) for _, ip, port in self.procs.listening_ports()]
        self.metrics_url = self.metrics_mod.find_metrics_url(ports, timeout_s=1.0)
        if self.metrics_url:
            self.sink.record(CollectorStatus(ts_ns=time.time_ns(), collector="metrics", available=True,
                                             hint=self.metrics_url))

    def _engine_from_metrics(self) -> None:
        """SGLang (``sglang:*``), TensorRT-LLM (``trtllm_*``) or vLLM (``vllm:*``) by the names
        its /metrics serves; recorded as that engine's ``CollectorStatus``."""
        from kvdiag.collectors import servers
        try:
            names = [m.name for m in self.metrics_mod.parse_prometheus(
                self.metrics_mod.fetch_metrics_text(self.metrics_url, 1.0))]
        except (OSError, ValueError):
            return
        engine = servers.engine_of_metrics(names)
        if engine is not None:
            self.engine = engine
            self.sink.record(CollectorStatus(ts_ns=time.time_ns(), collector=engine, available=True,
                                             hint=f"recognised by its metric names at {self.metrics_url}"))

    def subscribe_kv_events(self) -> None:
        """A vLLM server's KV-event stream: from ``/kv_event_sources``, else its command line."""
        from kvdiag.collectors import vllm
        self.kv_events_tried = True
        base_url = self.metrics_url.rsplit("/metrics", 1)[0]
        self.vllm.base_url = base_url
        try:
            configs = vllm.kv_event_sources(base_url)
        except (OSError, ValueError):
            cfg = vllm.kv_events_from_cmdline(self.procs.root.cmdline())
            configs = [cfg] if cfg and cfg.get("enable_kv_cache_events") else []
        if not configs:
            self.sink.record(CollectorStatus(
                ts_ns=time.time_ns(), collector="vllm-kv-events", available=False,
                hint="the server publishes no KV events (start it with --kv-events-config "
                     "'{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\"}')"))
            return
        self._subscribe({"endpoint": configs[0]["endpoint"], "topic": configs[0].get("topic", "")})

    def sample(self) -> None:
        """One sampling of every collector (raises ``TargetGone`` when the target exited)."""
        for ev in self.procs.sample():
            self.sink.record(ev)
        for ev in self.nvml.sample():
            self.sink.record(ev)
        if self.hardware is not None:
            self.hardware.sample()
        self.probe_metrics()
        if self.metrics_url and self.engine is None and not self.engine_probed:
            self.engine_probed = True  # not recognised from its command line: its metric names
            self._engine_from_metrics()
        if self.metrics_url and self.vllm is not None and not self.kv_events_tried:
            self.subscribe_kv_events()
        if self.other is not None and self.other.engine == "sglang" and not self.kv_events_tried:
            self.kv_events_tried = True  # SGLang takes vLLM's flag: --kv-events-config JSON
            from kvdiag.collectors import vllm
            cfg = vllm.kv_events_from_cmdline(self.procs.root.cmdline())
            if cfg and cfg.get("publisher", "zmq") == "zmq":
                self._subscribe({"endpoint": cfg.get("endpoint", "tcp://*:5557"),
                                 "topic": cfg.get("topic", ""),
                                 "replay_endpoint": cfg.get("replay_endpoint")})
        if self.metrics_url:
            self.metrics_mod.scrape_into(self.metrics_url, self.sink)

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.stop()
        self.nvml.close()


def recognised_server(pid: int):
    """The served tree ``pid`` belongs to, as a :class:`kvdiag.collectors.servers.EngineServer`:
    a vLLM server (``pid`` or its nearest vLLM ancestor, :func:`kvdiag.collectors.vllm.vllm_root`),
    else an SGLang or TensorRT-LLM server that ``pid`` itself runs; None when neither."""
    import psutil

    from kvdiag.collectors import servers
    from kvdiag.collectors.vllm import vllm_root
    root = vllm_root(pid)
    if root is not None:
        return servers.EngineServer("vllm", root)
    try:
        return servers.identify(psutil.Process(pid))
    except psutil.Error:
        return None
