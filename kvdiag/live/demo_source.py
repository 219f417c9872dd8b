"""``kvdiag demo`` started as top's child, read through its agent socket: the source of ``kvdiag
top`` without a log, socket or PID (the source interface: :mod:`kvdiag.live.sources`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from kvdiag.events import schema as s
from kvdiag.demo.child_command import kvdiag_module, reset_interrupt_signal
from kvdiag.live.socket_source import SocketSource
from kvdiag.live.sources import LiveSource, SourceError, find_agent_socket
from kvdiag.paths import open_private


class DemoSource(LiveSource):
    """Starts ``kvdiag demo`` (or ``command``) as a child (its own session, output to a file)
    and reads its agent socket. :meth:`close` stops the child and its server (see there). A
    child that exits early becomes a CollectorStatus event."""

    live = True

    def __init__(self, demo_args: list[str], log_dir: Path = Path("."), stop_timeout_s: float = 90.0,
                 socket_wait_s: float = 300.0, command: Optional[list[str]] = None) -> None:
        import importlib.util

        if command is None and importlib.util.find_spec("kvdiag.commands.demo") is None:
            raise SourceError("the embedded demo (`kvdiag demo`) is not in this build; "
                              "use --log FILE or --pid PID")
        self.output_path = log_dir / "kvdiag-top-demo.out"
        self._out = open_private(self.output_path, "ab")  # 0600, folders 0700
        self.child = subprocess.Popen([*(command or [*kvdiag_module("kvdiag"), "demo"]), *demo_args],
                                      stdin=subprocess.DEVNULL, stdout=self._out, stderr=subprocess.STDOUT,
                                      start_new_session=True, preexec_fn=_interrupt_when_parent_dies)
        self.description = f"demo pid {self.child.pid}"
        self.header: Optional[s.LogHeader] = None
        self.finished = False
        self._stop_timeout_s = stop_timeout_s
        self._deadline = time.monotonic() + socket_wait_s
        self._socket: Optional[SocketSource] = None
        self._pending: list[s.Event] = [s.CollectorStatus(
            ts_ns=time.time_ns(), collector="agent-stream", available=False,
            hint=f"starting kvdiag demo (pid {self.child.pid}); output in {self.output_path}")]

    def poll(self, limit: Optional[int] = None) -> list[s.Event]:
        out, self._pending = self._pending, []
        if self._socket is None:
            path = self._find_socket()
            if path is not None:
                self._socket = SocketSource(path, description=self.description)
            elif time.monotonic() > self._deadline and not self.finished:
                out.append(s.CollectorStatus(ts_ns=time.time_ns(), collector="agent-stream", available=False,
                                             hint=f"demo agent socket did not appear; see {self.output_path}"))
                self._deadline = float("inf")
        if self._socket is not None:
            out.extend(self._socket.poll(limit))
            self.header = self._socket.header or self.header
        rc = self.child.poll()
        if rc is not None and not self.finished:
            self.finished = True
            out.append(s.CollectorStatus(ts_ns=time.time_ns(), collector="demo", available=False,
                                         hint=f"kvdiag demo exited with status {rc}; see {self.output_path}"))
        return out

    def _find_socket(self) -> Optional[Path]:
        """The live socket of the demo's server: ``demo-<demo pid>-<port>.sock`` in the
        runtime dir (what ``kvdiag demo`` names it), else an agent socket of the tree."""
        from kvdiag.paths import runtime_dir

        found = sorted(runtime_dir().glob(f"demo-{self.child.pid}-*.sock"))
        return found[0] if found else find_agent_socket(self.child.pid)

    def close(self) -> None:
        """Stop the demo: SIGINT to it (``kvdiag demo`` then stops its server gracefully, so
        that the server's log is complete), then SIGKILL to whatever is left of its process
        group after ``stop_timeout_s``."""
        if self._socket is not None:
            self._socket.close()
        pgid = self.child.pid  # start_new_session: the child leads its own group
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGINT)
        deadline = time.monotonic() + self._stop_timeout_s
        while _group_alive(pgid, self.child) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pgid, self.child):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.child.wait()
        self._out.close()


def _group_alive(pgid: int, child: subprocess.Popen) -> bool:
    """Whether any process of group ``pgid`` is still running (reaping ``child`` if done)."""
    child.poll()
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _interrupt_when_parent_dies() -> None:
    """In the demo child: SIGINT (a graceful stop) if top dies without closing it (SIGHUP,
    SIGKILL), so that no demo server is left behind."""
    reset_interrupt_signal()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
