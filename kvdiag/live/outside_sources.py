"""A process read from outside, without a kvdiag agent: its host view (process tree, NVML;
:class:`ProcessSource`) or, for a served engine, attach's outside collectors (its /metrics and
KV events; :class:`OutsideSource`). The source interface: :mod:`kvdiag.live.sources`."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional

from kvdiag.events import schema as s
from kvdiag.live.sources import LiveSource, drain


class ProcessSource(LiveSource):
    """What is visible of a process from outside without an agent: RSS, threads and CPU time of
    its process tree and, where NVML works, GPU memory, every ``period_s``; plus one
    ``CollectorStatus`` saying that KV pool, requests and shadow panels need the agent.
    Read-only: the target is never signalled. Uses ``kvdiag.collectors`` (procfs, nvml)."""

    live = True

    def __init__(self, pid: int, period_s: float = 1.0, has_agent: bool = False) -> None:
        from kvdiag.collectors.nvml import NvmlCollector
        from kvdiag.collectors.procfs import ProcessCollector

        self.processes = ProcessCollector(pid)  # raises TargetGone / TargetNotAccessible
        self.nvml = NvmlCollector(pids=self.processes.pids)
        self.description = f"pid {pid} (outside view, no agent)"
        self.header = s.LogHeader(schema_version=s.SCHEMA_VERSION, pid=pid, engine="attach",
                                  start_ns=time.time_ns())
        self.finished = False
        self._period_ns = int(period_s * 1e9)
        self._last_ns = 0
        self._pending: list[s.Event] = [self.nvml.start()]
        if not has_agent:
            self._pending.append(s.CollectorStatus(
                ts_ns=time.time_ns(), collector="agent-stream", available=False,
                hint=f"no kvdiag agent in pid {pid}: KV pool, requests and shadow panels need one "
                     "(start the server under kvdiag)"))

    def poll(self, limit: Optional[int] = None) -> list[s.Event]:
        """One sampling of the tree when due (``limit`` is moot: a sampling is small)."""
        out, self._pending = self._pending, []
        now = time.time_ns()
        if self.finished or now - self._last_ns < self._period_ns:
            return out
        self._last_ns = now
        try:
            out.extend(self.processes.sample())
        except Exception as exc:  # the target exited (TargetGone) or became unreadable
            self.finished = True
            out.append(s.CollectorStatus(ts_ns=now, collector="process", available=False, hint=str(exc)))
            return out
        out.extend(self.nvml.sample())
        return out

    def close(self) -> None:
        self.nvml.close()


class _QueueSink:
    """Events recorded by the outside collectors, from the sampling thread and the KV-event
    subscriber's (a deque: appends and pops are thread-safe), taken by :meth:`OutsideSource.poll`."""

    def __init__(self) -> None:
        self.queue: deque[s.Event] = deque()

    def record(self, event: s.Event) -> None:
        self.queue.append(event)

    def flush(self) -> None:
        pass


class OutsideSource(LiveSource):
    """A served engine without a kvdiag agent, read from outside by attach's collectors
    (:class:`kvdiag.collectors.outside.OutsideCollectors`: process tree, NVML, the engine's
    ``/metrics`` scraped every ``period_s``, its KV events): the pool, prefix-hit and latency
    panels fill from the engine's own gauges, counters and histograms, counted since the join
    (the first scrape seen; :mod:`kvdiag.live.views.engine`). Token ids of KV events are
    hashed under a fresh salt, as attach does. A daemon thread samples; :meth:`poll` takes
    what it recorded. ``options``: :class:`kvdiag.collectors.outside.OutsideOptions`."""

    live = True

    def __init__(self, pid: int, period_s: float = 1.0, options=None) -> None:
        from kvdiag.collectors.outside import OutsideCollectors, OutsideOptions
        from kvdiag.collectors.procfs import ProcessCollector
        from kvdiag.events.eventlog import make_header
        from kvdiag.pool.hashing import CONTENT_CHUNK_TOKENS, ContentHasher, HashingSink

        self.pid = pid
        self.processes = ProcessCollector(pid)  # raises TargetGone / TargetNotAccessible
        self._sink = _QueueSink()
        hasher = ContentHasher()
        self.collectors = OutsideCollectors(self.processes, HashingSink(self._sink, hasher),
                                            options or OutsideOptions(hardware=False))
        self.joined_ns = time.time_ns()
        self.header = make_header(pid=pid, engine=self.collectors.engine or "attach", content="hashes",
                                  content_salt=hasher.salt, content_chunk_tokens=CONTENT_CHUNK_TOKENS,
                                  start_ns=self.joined_ns)
        self.finished = False
        self._period_s = period_s
        self._sink.record(s.CollectorStatus(
            ts_ns=time.time_ns(), collector="agent-stream", available=False,
            hint=f"no kvdiag agent in pid {pid}: pool, prefix hits and latency from the engine's /metrics "
                 "and KV events; requests, compression and locality need the agent (its plugin)"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdiag-outside", daemon=True)
        self._thread.start()

    @property
    def description(self) -> str:
        """The source named in top's status line: what is read, and since when."""
        since = time.strftime("%H:%M:%S", time.gmtime(self.joined_ns / 1e9))  # as the status line's clock
        return f"pid {self.pid} outside: {self.collectors.describe()} (since join {since} UTC)"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.collectors.sample()
            except Exception as exc:  # the target exited (TargetGone) or became unreadable
                self.finished = True
                self._sink.record(s.CollectorStatus(ts_ns=time.time_ns(), collector="process",
                                                    available=False, hint=str(exc)))
                return
            self._stop.wait(self._period_s)

    def poll(self, limit: Optional[int] = None) -> list[s.Event]:
        return drain(self._sink.queue, limit)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.collectors.close()
