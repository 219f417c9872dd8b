"""A server the demo runs as a child process: started with its output in a file, waited for
with a bound, stopped gracefully then forcibly, and never left behind, nor its own children
(a vLLM server's engine core) when it exits without stopping them."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable, Optional

from kvdiag.demo.child_command import reset_interrupt_signal
from kvdiag.paths import open_private


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the demo process dies, so no server is left behind."""
    reset_interrupt_signal()  # stop() escalates to SIGINT: it must not be ignored
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``command`` with ``env``, its output in ``server_log``, answering at ``base_url``.
    Subclasses set those and may change :attr:`stop_signals` and :meth:`ready_extra`."""

    command: list[str]
    env: dict
    server_log: Path
    base_url: str
    cwd: Optional[Path] = None
    ready_path = "/v1/models"
    # (signal, seconds to wait for the exit after it), in order; SIGKILL last
    stop_signals: tuple = ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0))
    orphan_wait_s = 10.0  # SIGTERM to a descendant left behind, then SIGKILL after this
    proc: Optional[subprocess.Popen] = None
    _descendants: Optional[dict] = None

    def start(self, preexec_fn: Optional[Callable[[], None]] = None) -> None:

        with open_private(self.server_log, "wb") as out:  # 0600: it echoes requests and paths
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, preexec_fn=preexec_fn or _die_with_parent,
                                         cwd=self.cwd)

    def ready_extra(self) -> bool:
        """What must hold besides an HTTP 200 (e.g. the agent's socket exists)."""
        return True

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``ready_path`` answers 200 and :meth:`ready_extra`; RuntimeError naming the
        server log when the child exits first or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._note_descendants()
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}; "
                                   f"see {self.server_log}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}{self.ready_path}", timeout=2) as resp:
                    if resp.status == 200 and self.ready_extra():
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not answer within {timeout_s:.0f} s; see {self.server_log}")

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.server_log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _note_descendants(self) -> None:
        """Remember the child's process tree as it is now, so that :meth:`stop` can end what
        the child leaves behind (psutil's handles tell a reused PID from the process seen)."""
        import psutil

        if self._descendants is None:
            self._descendants = {}
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self._descendants.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def _end_descendants(self) -> None:
        """SIGTERM to each remembered descendant still running, SIGKILL after
        :attr:`orphan_wait_s` to those that outlive it."""
        import psutil

        def running(p) -> bool:  # a zombie has exited (init may not reap it in a container)
            try:
                return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                return False

        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in (self._descendants or {}).values() if running(p)]
            for p in alive:
                try:
                    p.send_signal(sig)
                except psutil.Error:
                    pass
            deadline = time.monotonic() + self.orphan_wait_s
            while alive and time.monotonic() < deadline:
                time.sleep(0.05)
                alive = [p for p in alive if running(p)]
            if not alive:
                break
        self._descendants = {}

    def stop(self, signals: Optional[tuple] = None) -> int:
        """Send ``signals`` (default :attr:`stop_signals`) in turn until the child exits, then
        end the descendants it left running (seen while waiting for it or now); its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self._note_descendants()
            for sig, wait_s in signals or self.stop_signals:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._end_descendants()
        return self.proc.returncode
