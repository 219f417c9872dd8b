"""Client of the kvdiag agent's live stream: a Unix socket sending JSON lines, the agent's
``LogHeader`` first, then every event (the same JSON as a log line)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

import msgspec
import psutil

from kvdiag.schema import AnyEvent, CollectorError, LogHeader
from kvdiag.sinks import Sink

NAME = "agent"


def _is_agent_socket(path: str) -> bool:
    p = Path(path)
    return p.suffix == ".sock" and (p.name.startswith("agent-") or p.parent.name == "kvdiag"
                                    or p.parent.name.startswith("kvdiag-"))


def _socket_from_cmdline(cmdline: list[str]) -> Optional[str]:
    """``--socket PATH`` of ``python -m kvdiag.run`` (options before ``--``)."""
    if "kvdiag.run" not in cmdline:
        return None
    opts = cmdline[:cmdline.index("--")] if "--" in cmdline else cmdline
    for i, arg in enumerate(opts):
        if arg == "--socket" and i + 1 < len(opts):
            return opts[i + 1]
        if arg.startswith("--socket="):
            return arg.split("=", 1)[1]
    return None


def candidate_sockets(pids: list[int]) -> list[Path]:
    """Agent sockets of the target tree, most specific first: ``--socket`` on a
    ``python -m kvdiag.run`` command line; Unix sockets the tree listens on that live in a
    kvdiag runtime dir or are named ``agent-*.sock``; the default per-pid path under the
    target's runtime dir (``$XDG_RUNTIME_DIR/kvdiag`` of its environment, else
    ``/tmp/kvdiag-<uid>``). Only existing paths are returned."""
    found: list[Path] = []
    for pid in pids:
        try:
            explicit = _socket_from_cmdline(psutil.Process(pid).cmdline())
        except (psutil.Error, OSError):
            explicit = None
        if explicit:
            found.append(Path(explicit))
    for pid in pids:
        try:
            for c in psutil.Process(pid).net_connections(kind="unix"):
                if c.laddr and _is_agent_socket(c.laddr):
                    found.append(Path(c.laddr))
        except (psutil.Error, OSError):
            continue
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            env = proc.environ()
            uid = proc.uids().real
        except (psutil.Error, OSError):
            env, uid = {}, os.getuid()
        xdg = env.get("XDG_RUNTIME_DIR")
        base = Path(xdg) / "kvdiag" if xdg else Path(f"/tmp/kvdiag-{uid}")
        found.append(base / f"agent-{pid}.sock")
    seen, out = set(), []
    for p in found:
        if p not in seen and p.exists():
            seen.add(p)
            out.append(p)
    return out


class AgentStream:
    """Connects to ``path``, reads the header, then (after :meth:`start`) records every
    event into ``sink`` from a background thread. Undecodable lines are counted."""

    def __init__(self, path: str | os.PathLike, sink: Sink, timeout_s: float = 5.0) -> None:
        self.path = Path(path)
        self.sink = sink
        self.events = 0
        self.bad_lines = 0
        self.first_ts_ns: Optional[int] = None
        self.last_ts_ns: Optional[int] = None
        self._decoder = msgspec.json.Decoder(AnyEvent)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(str(self.path))
        self._file = self._sock.makefile("rb")
        line = self._file.readline()
        if not line:
            raise ConnectionError(f"{self.path}: the agent closed the connection before its header")
        try:
            self.header = msgspec.json.decode(line, type=LogHeader)
        except msgspec.DecodeError as exc:
            raise ConnectionError(f"{self.path}:1: expected the agent's log header ({exc})") from None
        self._sock.settimeout(None)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvdiag-attach-agent", daemon=True)

    def start(self) -> "AgentStream":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for line in self._file:
                if self._stop:
                    break
                try:
                    ev = self._decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.bad_lines += 1
                    continue
                self.events += 1
                if self.first_ts_ns is None:
                    self.first_ts_ns = ev.ts_ns
                self.last_ts_ns = ev.ts_ns
                self.sink.record(ev)
        except (OSError, ValueError):  # the agent or the target went away: keep what was read
            pass

    def close(self, drain_s: float = 0.5) -> None:
        """Stop reading (after up to ``drain_s`` for lines already sent) and disconnect."""
        time.sleep(drain_s)
        self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=2)
        try:
            self._file.close()
            self._sock.close()
        except OSError:
            pass
        if self.bad_lines:
            self.sink.record(CollectorError(ts_ns=time.time_ns(), collector=NAME,
                                            message="undecodable lines from the agent", count=self.bad_lines))
