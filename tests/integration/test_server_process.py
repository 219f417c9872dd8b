"""A server child that leaves a process of its own behind (as vLLM's API server leaves its engine
core when it is killed before it could stop it): :meth:`ServerProcess.stop` ends that process too.
The server here is CONSTRUCTED: a Python child that starts ``sleep`` and never answers HTTP."""

from __future__ import annotations

import signal
import sys
import time

import psutil
import pytest

from kvdiag.demo.server_process import ServerProcess, free_port

LEAVES_A_CHILD = """
import subprocess, sys, time
child = subprocess.Popen(["sleep", "600"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


class Leaver(ServerProcess):
    stop_signals = ((signal.SIGKILL, 10.0),)  # the server dies without stopping its child

    def __init__(self, tmp_path) -> None:
        self.pid_file = tmp_path / "child.pid"
        self.command = [sys.executable, "-c", LEAVES_A_CHILD, str(self.pid_file)]
        self.env = {}
        self.server_log = tmp_path / "server.txt"
        self.base_url = f"http://127.0.0.1:{free_port()}"


def _child_of(server: Leaver) -> psutil.Process:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = server.pid_file.read_text() if server.pid_file.exists() else ""
        if text:
            return psutil.Process(int(text))
        time.sleep(0.02)
    raise AssertionError("the server child did not start its own child within 30 s")


@pytest.mark.parametrize("seen_while_waiting", [True, False])
def test_stop_ends_what_a_killed_server_left_running(tmp_path, seen_while_waiting):
    server = Leaver(tmp_path)
    server.start(preexec_fn=lambda: None)
    try:
        child = _child_of(server)
        if seen_while_waiting:
            with pytest.raises(RuntimeError, match="did not answer"):
                server.wait_ready(timeout_s=0.5)
        assert child.is_running()
        assert server.stop() == -signal.SIGKILL
        child.wait(timeout=15)  # ended by stop (psutil.TimeoutExpired otherwise)
        assert not child.is_running()
    finally:
        server.proc.kill()
        for p in psutil.Process().children(recursive=True):
            if p.cmdline()[:1] == ["sleep"]:
                p.kill()
