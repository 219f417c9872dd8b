"""`kvdiag top` in a real terminal: tmux runs it, send-keys drives it, capture-pane reads it.

Replays CONSTRUCTED TEST DATA (tests/tui_data.py) until a recorded demo log exists.
"""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tui_data import write_constructed_log

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
KVDIAG = str(Path(sys.executable).with_name("kvdiag"))


class Tmux:
    def __init__(self, name: str, width: int = 120, height: int = 36) -> None:
        self.server = ["tmux", "-L", f"kvdiag-test-{os.getpid()}-{name}"]
        env = dict(os.environ, TERM="xterm-256color")
        subprocess.run([*self.server, "-f", "/dev/null", "new-session", "-d", "-s", name, "-x", str(width),
                        "-y", str(height), "bash --norc --noprofile"], check=True, env=env)
        self.target = name
        self.type("PS1='READY$ '; clear")
        self.wait_for(r"^READY\$", timeout_s=10)

    def send(self, *keys: str) -> None:
        for key in keys:  # one key per call: tmux would read "Escape q" as alt+q
            subprocess.run([*self.server, "send-keys", "-t", self.target, key], check=True)
            time.sleep(0.15)

    def type(self, text: str) -> None:
        subprocess.run([*self.server, "send-keys", "-t", self.target, "-l", text], check=True)
        subprocess.run([*self.server, "send-keys", "-t", self.target, "Enter"], check=True)

    def capture(self) -> str:
        return subprocess.run([*self.server, "capture-pane", "-p", "-t", self.target], check=True,
                              capture_output=True, text=True).stdout

    def wait_for(self, pattern: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            screen = self.capture()
            if re.search(pattern, screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} did not appear; screen:\n{self.capture()}")

    def wait_gone(self, pattern: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            screen = self.capture()
            if not re.search(pattern, screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} is still on the screen:\n{self.capture()}")

    def close(self) -> None:
        subprocess.run([*self.server, "kill-server"], capture_output=True)


@pytest.fixture
def tmux(request):
    t = Tmux(request.node.name.replace("[", "-").replace("]", "")[:40])
    yield t
    t.close()


def test_top_replays_a_log_and_quits_cleanly(tmux, tmp_path):
    log = write_constructed_log(tmp_path / "demo.jsonl")
    tmux.type(f"cd {tmp_path} && {KVDIAG} top --log {log} --speed 4; echo TOP-EXIT=$?")
    screen = tmux.wait_for(r"blocks\s+\d+/256", timeout_s=60)
    for title in ("Memory", "KV pool", "Latency", "Prefix sharing", "Compression", "Locality", "Requests", "Alerts"):
        assert title in screen
    screen = tmux.wait_for(r"TTFT p50\s+\d+ms p99\s+\d+ms")
    assert re.search(r"engine hit\s+\d+\.\d%", screen)
    assert re.search(r"GPU used\s+\d", screen)
    assert re.search(r"req-\d{5}\s+\d", screen)

    tmux.send("p")
    tmux.wait_for("PAUSED")
    tmux.send("p")
    tmux.send("?")
    tmux.wait_for("this help")
    tmux.send("Escape")
    tmux.wait_gone("this help")  # back on the main screen, where "s" takes the screenshot
    tmux.send("s")
    tmux.wait_for("screenshot saved")
    tmux.send("q")
    screen = tmux.wait_for(r"TOP-EXIT=\d+")
    assert "TOP-EXIT=0" in screen
    assert "╭─ Memory" not in screen  # the alternate screen is gone: the shell is back
    assert screen.rstrip().endswith("READY$")
    assert list(tmp_path.glob("kvdiag-top-*.svg"))


def test_terminal_is_restored_after_an_exception(tmux, tmp_path):
    log = write_constructed_log(tmp_path / "demo.jsonl", n_requests=20, shadow=False)
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import kvdiag.tui.app as app_module
        from kvdiag.cli import main

        class Crashing(app_module.KvTopApp):
            def on_snapshot_ready(self, message):
                raise RuntimeError("panel exploded")

        app_module.KvTopApp = Crashing
        sys.exit(main(["top", "--log", {str(log)!r}]))
    """))
    tmux.type(f"{sys.executable} {script}; echo TOP-EXIT=$?; "
              "echo STTY: $(stty -a | tr ' ;' '\\n\\n' | grep -x -E -- '-?(icanon|echo)')")
    screen = tmux.wait_for(r"(?m)^STTY: ", timeout_s=60)
    assert "TOP-EXIT=1" in screen and "panel exploded" in screen
    assert "STTY: icanon echo" in screen  # cooked mode with echo: the terminal is usable again
    assert screen.rstrip().endswith("READY$")


def test_bad_log_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not a kvdiag log\n")
    out = subprocess.run([KVDIAG, "top", "--log", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and f"{bad}:1: expected" in out.stderr and "Traceback" not in out.stderr
    missing = subprocess.run([KVDIAG, "top", "--log", str(tmp_path / "nope.jsonl")], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_pid_that_does_not_exist_is_one_line_error():
    out = subprocess.run([KVDIAG, "top", "--pid", "999999999"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip() == "kvdiag top: no process with PID 999999999"


@pytest.mark.slow
@pytest.mark.model
def test_top_runs_the_live_demo_and_stops_it_on_quit(tmux, tmp_path):
    """Quitting top stops the demo within a few seconds, while requests are in flight, and no
    request gets an HTTP 500 (the server's own access log, beside the demo's event log)."""
    import psutil

    log = tmp_path / "demo.kvlog"
    tmux.type(f"cd {tmp_path} && {KVDIAG} top -- --log {log}; echo TOP-EXIT=$?")
    screen = tmux.wait_for(r"demo pid (\d+)", timeout_s=60)
    demo_pid = int(re.search(r"demo pid (\d+)", screen).group(1))
    quit_at = None
    try:
        # model load, server start, then requests holding blocks (ids like c0003/t0)
        screen = tmux.wait_for(r"│ \S+\s+[\d.]+[KMG]\s+\d+\s+\d+\s+[\d.]+s\s+running", timeout_s=400)
        assert re.search(r"blocks\s+\d+/256", screen) and re.search(r"\d+ live", screen)
        tmux.wait_for(r"TTFT p50\s+[\d.]+m?s", timeout_s=300)  # the first finished requests
    finally:
        quit_at = time.monotonic()
        tmux.send("q")
        screen = tmux.wait_for(r"TOP-EXIT=\d+", timeout_s=150)
    stopped_s = time.monotonic() - quit_at
    assert "TOP-EXIT=0" in screen
    assert not psutil.pid_exists(demo_pid) or psutil.Process(demo_pid).status() == psutil.STATUS_ZOMBIE
    # the demo stops sending and cuts what is in flight (the server cancels those requests), so the
    # server's graceful shutdown has nothing to wait for
    assert stopped_s < 25, stopped_s
    access = (tmp_path / "demo.kvlog.server.txt").read_text()
    from kvdiag.demo.traffic import CHAT_ROUTE
    answered = re.findall(rf'"POST /{re.escape(CHAT_ROUTE)} HTTP/1.1" (\d{{3}})', access)
    assert answered and set(answered) == {"200"}, sorted(set(answered))
    demo_out = (tmp_path / "kvdiag-top-demo.out").read_text()  # beside the demo's --log
    assert "Traceback" not in demo_out and re.search(r"stopped: \d+ requests answered, 0 failed, \d+ cut by the stop", demo_out)
    # the log is complete: the engine recorded the cut requests as aborted before it stopped
    from kvdiag.events.eventlog import read_log
    events = read_log(log)
    cut = int(re.search(r"(\d+) cut by the stop", demo_out).group(1))
    finished = events.frame("request_finished")
    assert len(finished) == len(events.frame("request_arrived"))
    # (a cut request the engine had just finished, or not yet read, is not aborted)
    assert (finished["status"] == "aborted").sum() <= cut
