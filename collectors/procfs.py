"""Host view of a target process and its children (psutil): RSS, threads, CPU time, and the
TCP ports it listens on (to find its HTTP ``/metrics``)."""

from __future__ import annotations

import socket
import time
from typing import Optional

import psutil

from kvdiag.schema import ProcessSample


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


class ProcessCollector:
    """Samples the target and its current children (re-listed each sample: engines spawn
    workers late)."""

    def __init__(self, pid: int) -> None:
        self.root = open_target(pid)
        self.pid = pid

    def processes(self) -> list[psutil.Process]:
        """The target and its live descendants; raises ``TargetGone`` when the target exited."""
        try:
            if self.root.status() == psutil.STATUS_ZOMBIE:
                raise TargetGone(f"process {self.pid} has exited")
            return [self.root] + self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            raise TargetGone(f"process {self.pid} has exited") from None

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
                    out.append(ProcessSample(ts_ns=now, pid=p.pid, rss_bytes=p.memory_info().rss,
                                             num_threads=p.num_threads(),
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
