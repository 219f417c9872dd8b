"""Host view of a target process and its children (psutil): RSS, PSS and swap, threads, CPU
time, and the TCP ports it listens on (to find its HTTP ``/metrics``).

A target that is an ancestor of kvdiag (a container's PID 1, the shell that started kvdiag)
has kvdiag below it: :meth:`ProcessCollector.excluded_pids` (kvdiag, its descendants and its
ancestors below the target) are never part of the target's tree.

:class:`ProcessSampler` runs a :class:`ProcessCollector` on a thread of its own; the in-process
agent uses it to sample its own process."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Optional

import psutil

from kvdiag.events.schema import CollectorError, ProcessSample
from kvdiag.events.sinks import Sink

COLLECTOR = "procfs"
# share of wall time the smaps_rollup page-table walk (PSS, swap) may take: it costs ~15 ms per
# GiB resident, so it runs less often than the RSS read on large processes
PSS_BUDGET_FRAC = 0.01


class TargetGone(RuntimeError):
    """The target process exited."""


class TargetNotAccessible(PermissionError):
    """The target exists but this user may not read it."""


def open_target(pid: int) -> psutil.Process:
    """The target process; raises ``TargetGone`` / ``TargetNotAccessible`` with a clear message."""
    try:
        proc = psutil.Process(pid)
        proc.memory_info()
        return proc
    except psutil.NoSuchProcess:
        raise TargetGone(f"no process with PID {pid}") from None
    except psutil.ZombieProcess:
        raise TargetGone(f"process {pid} has exited (zombie)") from None
    except psutil.AccessDenied:
        raise TargetNotAccessible(
            f"process {pid} is not ours to read: run kvdiag as its user or as root") from None


def lineage_below(pid: int) -> list[int]:
    """kvdiag's own ancestors strictly below ``pid``, outermost first, then kvdiag itself;
    empty when ``pid`` is kvdiag itself or not one of its ancestors."""
    me = os.getpid()
    if pid == me:
        return []
    chain = [me]
    try:
        for parent in psutil.Process(me).parents():
            if parent.pid == pid:
                return chain[::-1]
            chain.append(parent.pid)
    except psutil.Error:
        pass
    return []


class ProcessCollector:
    """Samples the target and its current children (re-listed each sample: engines spawn
    workers late)."""

    def __init__(self, pid: int, children: bool = True, pss_budget_frac: Optional[float] = None) -> None:
        """``children``: also sample the target's descendants (listing them scans all of /proc).
        ``pss_budget_frac``: read the target's PSS and swap (``smaps_rollup``) whenever the
        time spent reading it stays under this share of wall time; None: never."""
        self.root = open_target(pid)
        self.pid = pid
        self.children = children
        self.pss_budget_frac = pss_budget_frac
        self.pss_readable = pss_budget_frac is not None and os.path.exists(f"/proc/{pid}/smaps_rollup")
        self._next_pss_ns = 0
        self.lineage = lineage_below(pid)  # non-empty when the target is an ancestor of kvdiag

    def excluded_pids(self) -> set[int]:
        """kvdiag's processes inside the target's tree: its ancestors below the target, itself
        and its current descendants (py-spy); empty when the target is not an ancestor."""
        if not self.lineage:
            return set()
        try:
            below = [c.pid for c in psutil.Process(os.getpid()).children(recursive=True)]
        except psutil.Error:
            below = []
        return set(self.lineage) | set(below)

    def processes(self) -> list[psutil.Process]:
        """The target and its live descendants but kvdiag's own (:meth:`excluded_pids`);
        raises ``TargetGone`` when the target exited."""
        try:
            if self.root.status() == psutil.STATUS_ZOMBIE:
                raise TargetGone(f"process {self.pid} has exited")
            below = self.root.children(recursive=True) if self.children else []
        except psutil.NoSuchProcess:
            raise TargetGone(f"process {self.pid} has exited") from None
        if self.lineage:
            skip = self.excluded_pids()
            below = [c for c in below if c.pid not in skip]
        return [self.root] + below

    def _pss_due(self, p: psutil.Process, now: int) -> bool:
        return p.pid == self.pid and self.pss_readable and now >= self._next_pss_ns

    def _read_pss(self, p: psutil.Process) -> tuple[int, Optional[int], Optional[int]]:
        """(rss, pss, swap) from one ``memory_full_info``; schedules the next read so that
        these reads take at most ``pss_budget_frac`` of wall time."""
        start = time.perf_counter_ns()
        try:
            full = p.memory_full_info()
        except psutil.AccessDenied:
            self.pss_readable = False
            return p.memory_info().rss, None, None
        took = time.perf_counter_ns() - start
        self._next_pss_ns = time.time_ns() + int(took / self.pss_budget_frac)
        return full.rss, full.pss, full.swap

    def pids(self) -> list[int]:
        try:
            return [p.pid for p in self.processes()]
        except TargetGone:
            return []

    def sample(self) -> list[ProcessSample]:
        """One ``ProcessSample`` per process of the tree; a child that exits mid-sample is
        skipped; raises ``TargetGone`` if the target itself is gone."""
        now = time.time_ns()
        out = []
        for p in self.processes():
            try:
                with p.oneshot():
                    cpu = p.cpu_times()
                    if self._pss_due(p, now):
                        rss, pss, swap = self._read_pss(p)
                    else:
                        rss, pss, swap = p.memory_info().rss, None, None
                    out.append(ProcessSample(ts_ns=now, pid=p.pid, rss_bytes=rss, pss_bytes=pss,
                                             swap_bytes=swap, num_threads=p.num_threads(),
                                             cpu_time_ns=int((cpu.user + cpu.system) * 1e9), name=p.name()))
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                if p.pid == self.pid:
                    raise TargetGone(f"process {self.pid} has exited") from None
            except psutil.AccessDenied:
                continue
        return out

    def listening_ports(self) -> list[tuple[int, str, int]]:
        """``(pid, ip, port)`` of TCP sockets in LISTEN state owned by the tree."""
        out = []
        for p in self.processes():
            try:
                conns = p.net_connections(kind="tcp")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            for c in conns:
                if c.status == psutil.CONN_LISTEN and c.laddr:
                    out.append((p.pid, c.laddr.ip, c.laddr.port))
        return sorted(set(out))


def connect_host(ip: str) -> str:
    """Where to connect for a socket listening on ``ip`` (wildcards mean loopback)."""
    if ip in ("0.0.0.0", ""):
        return "127.0.0.1"
    if ip == "::":
        return "::1" if socket.has_ipv6 else "127.0.0.1"
    return ip


def tree_rss_bytes(samples: list[ProcessSample]) -> Optional[int]:
    """Total resident memory of one sampling of the tree (None if empty)."""
    return sum(s.rss_bytes for s in samples) if samples else None


class ProcessSampler:
    """Sends a ``ProcessSample`` of a process to ``sink`` every ``interval_s`` from a daemon
    thread (the agent samples its own process with it: ``ProcessSampler.of_self``).

    Never raises into its caller or the observed process: a failed sample is counted in
    ``error_count`` and reported once per kind of failure as a ``CollectorError``."""

    def __init__(self, collector: ProcessCollector, sink: Sink, interval_s: float = 0.5) -> None:
        self.collector = collector
        self.sink = sink
        self.interval_s = interval_s
        self.error_count = 0
        self.samples = 0
        self.attempts = 0  # samplings begun and ended, taken or failed
        self._reported: set[str] = set()
        self._lock = threading.Lock()
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def of_self(cls, sink: Sink, interval_s: float = 0.5,
                pss_budget_frac: Optional[float] = PSS_BUDGET_FRAC) -> "ProcessSampler":
        """A sampler of this process alone (RSS every interval; PSS and swap within budget)."""
        return cls(ProcessCollector(os.getpid(), children=False, pss_budget_frac=pss_budget_frac),
                   sink, interval_s)

    def sample_now(self) -> None:
        """Take one sampling and send it; failures are counted and reported, never raised."""
        try:
            self._sample()
        finally:
            with self._progress:
                self.attempts += 1
                self._progress.notify_all()

    def _sample(self) -> None:
        with self._lock:
            try:
                events = self.collector.sample()
            except Exception as exc:  # the observed process must never see our failures
                self._failed(exc)
                return
            for ev in events:
                try:
                    self.sink.record(ev)
                except Exception as exc:
                    self._failed(exc)
            self.samples += 1

    def wait_attempts(self, n: int, timeout_s: float) -> bool:
        """Block until ``n`` more samplings than now have ended (taken or failed); False if
        ``timeout_s`` passed first. For callers that need samples on both sides of a moment."""
        with self._progress:
            target = self.attempts + n
            return self._progress.wait_for(lambda: self.attempts >= target, timeout_s)

    def _failed(self, exc: BaseException) -> None:
        self.error_count += 1
        key = type(exc).__name__
        if key in self._reported:
            return
        self._reported.add(key)
        try:
            self.sink.record(CollectorError(ts_ns=time.time_ns(), collector=COLLECTOR,
                                            message=f"sample: {key}: {exc}"))
        except Exception:
            pass

    def start(self) -> "ProcessSampler":
        """Sample now, then every ``interval_s`` until :meth:`stop`."""
        self.sample_now()
        self._thread = threading.Thread(target=self._loop, name="kvdiag-procfs", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_now()

    def stop(self) -> None:
        """Stop the thread and take a last sample."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.sample_now()
