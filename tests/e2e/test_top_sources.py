"""`kvdiag top`'s live sources: the agent's Unix-socket stream (header line, then one event per
line), the outside view of a process, and attaching without touching the target.

The streamed events are CONSTRUCTED TEST DATA (tests/tui_data.py), sent by a socket server in
the test that speaks the agent's documented protocol.
"""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import numpy as np
import pytest

from kvdiag.live.socket_source import SocketSource
from kvdiag.tui.app import KvTopApp
from tui_data import T0_NS, constructed_events, header

pytestmark = pytest.mark.anyio
ENC = msgspec.json.Encoder()


@pytest.fixture
def anyio_backend():
    return "asyncio"


class AgentServer:
    """Accepts one client at a time and sends it the header then ``lines`` in odd-sized chunks."""

    def __init__(self, path, lines: list[bytes], hdr=None) -> None:
        self.path = str(path)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(1)
        self.payload = ENC.encode(hdr or header()) + b"\n" + b"".join(line + b"\n" for line in lines)
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        self.connections += 1
        for i in range(0, len(self.payload), 997):  # chunks that cut lines in the middle
            conn.sendall(self.payload[i:i + 997])
        time.sleep(0.3)
        conn.close()
        self.server.close()
        os.unlink(self.path)


def _drain(source, until, timeout_s=10.0):
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got += source.poll()
        if until(got):
            return got
        time.sleep(0.05)
    raise AssertionError(f"stream incomplete: {len(got)} events")


def test_socket_source_reads_header_events_bad_lines_and_loss(tmp_path):
    events = constructed_events(n_requests=15)
    lines = [ENC.encode(e) for e in events]
    lines.insert(100, b'{"type": "block_allocated", "ts_ns": "soon"}')
    server = AgentServer(tmp_path / "agent-1.sock", lines)
    src = SocketSource(tmp_path / "agent-1.sock", retry_s=0.1)
    try:
        got = _drain(src, lambda g: any(getattr(e, "available", True) is False for e in g))
    finally:
        src.close()
    assert src.header == header()
    data = [e for e in got if type(e).__name__ not in ("CollectorStatus", "CollectorError")]
    assert data == events  # every event, in order, despite lines cut across reads
    errors = [e for e in got if type(e).__name__ == "CollectorError"]
    assert len(errors) == 1 and "expected an event line" in errors[0].message
    assert server.connections == 1


async def test_app_renders_a_live_stream(tmp_path):
    now = time.time_ns()
    events = [msgspec.structs.replace(e, ts_ns=e.ts_ns - T0_NS + now - 20 * 10**9)
              for e in constructed_events(n_requests=40)]
    events = [e for e in events if e.ts_ns <= now]
    AgentServer(tmp_path / "agent-2.sock", [ENC.encode(e) for e in events])
    src = SocketSource(tmp_path / "agent-2.sock", retry_s=0.1)
    app = KvTopApp(src, interval_s=0.2)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            for _ in range(200):
                if app.snapshot is not None and app.snapshot.events >= len(events):
                    break
                await pilot.pause(0.05)
            snap = app.snapshot
            assert snap.events >= len(events)
            pools = [e for e in events if type(e).__name__ == "KVPoolSample"]
            assert snap.pool.blocks_used == pools[-1].blocks_used
            assert f"{pools[-1].blocks_used}/256" in str(app.query_one("#poolpanel").render())
            assert any(snap.latency.ttft_p99_history)  # live events land in the history bins
            # every request finished within the last 20 s: all inside the 60 s latency window,
            # so TTFT p99 is the inverted-CDF percentile of all their TTFTs (numpy, here)
            first = {e.request_id: e.ttft_ns for e in events if type(e).__name__ == "RequestFirstToken"}
            done = [e for e in events if type(e).__name__ == "RequestFinished" and e.status == "finished"]
            ttft = [(e.ttft_ns if e.ttft_ns is not None else first.get(e.request_id)) for e in done]
            ttft = [t / 1e6 for t in ttft if t is not None]
            assert len(ttft) >= 10
            assert snap.latency.ttft_p99_ms == pytest.approx(np.percentile(ttft, 99, method="inverted_cdf"))
            assert snap.requests.finished == len([e for e in events if type(e).__name__ == "RequestFinished"])
    finally:
        src.close()


def _tmux_top(args: list[str], name: str):
    from test_top_tmux import KVDIAG, Tmux

    tmux = Tmux(name)
    tmux.type(f"{KVDIAG} top {' '.join(args)}; echo TOP-EXIT=$?")
    return tmux


def _vmrss_bytes(pid: int) -> int:
    line = next(x for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_attach_outside_view_then_quit_leaves_target_running():
    import re

    ballast = 50_000_000
    target = subprocess.Popen([sys.executable, "-c", f"import time; x = b'x' * {ballast}; time.sleep(120)"])
    tmux = _tmux_top(["--pid", str(target.pid), "--any-process"], "attach-outside")
    try:
        # the first memory sample and the source's note may reach the screen in either order:
        # wait for a screen with both
        screen = tmux.wait_for(rf"(?s)(?=.*host RSS\s+\d)(?=.*no kvdiag agent in pid {target.pid}\b)", timeout_s=60)
        # the title and the alert say this is the outside view of *this* pid, without an agent
        assert f"pid {target.pid} (outside view, no agent)" in screen
        # the RSS shown is the target's own (read here from /proc), to the 3 digits shown
        shown = re.search(r"host RSS\s+([\d.]+)M", screen)
        assert shown, screen
        rss = _vmrss_bytes(target.pid)
        assert rss >= ballast
        assert abs(float(shown.group(1)) * 2**20 - rss) <= 0.05 * 2**20 + (1 << 20), (shown.group(0), rss)
        tmux.send("q")
        screen = tmux.wait_for(r"TOP-EXIT=\d+")
        assert "TOP-EXIT=0" in screen
        with pytest.raises(subprocess.TimeoutExpired):  # quitting never signals an attached target
            target.wait(timeout=1)
    finally:
        tmux.close()
        target.send_signal(signal.SIGKILL)
        target.wait()


def test_attach_prefers_the_agent_socket(tmp_path):
    from kvdiag.paths import agent_socket_path

    events = constructed_events(n_requests=10)
    payload = tmp_path / "events.jsonl"
    payload.write_bytes(ENC.encode(header()) + b"\n" + b"".join(ENC.encode(e) + b"\n" for e in events))
    code = textwrap.dedent(f"""
        import os, socket, time
        from kvdiag.paths import agent_socket_path
        path = agent_socket_path(os.getpid())
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path)); srv.listen(1)
        print("READY", flush=True)
        conn, _ = srv.accept()
        conn.sendall(open({str(payload)!r}, "rb").read())
        time.sleep(120)
    """)
    target = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert target.stdout.readline().strip() == "READY"
    tmux = _tmux_top(["--pid", str(target.pid)], "attach-agent")
    try:
        tmux.wait_for(rf"pid {target.pid} agent", timeout_s=60)
        tmux.wait_for(r"req-\d{5}", timeout_s=30)
        tmux.send("q")
        assert "TOP-EXIT=0" in tmux.wait_for(r"TOP-EXIT=\d+")
        assert target.poll() is None
    finally:
        tmux.close()
        target.kill()
        target.wait()
        agent_socket_path(target.pid).unlink(missing_ok=True)


def test_demo_child_and_its_children_stop_on_close(tmp_path):
    from kvdiag.live.demo_source import DemoSource
    import psutil

    # a stand-in for `kvdiag demo` that, like a server, starts a worker process of its own
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"
    src = DemoSource([], log_dir=tmp_path, command=[sys.executable, "-c", code], stop_timeout_s=5)
    parent = psutil.Process(src.child.pid)
    for _ in range(100):
        kids = parent.children(recursive=True)
        if kids:
            break
        time.sleep(0.05)
    assert kids
    src.poll()
    src.close()
    assert src.child.poll() is not None
    gone, alive = psutil.wait_procs(kids, timeout=5)
    assert not alive


def test_demo_close_waits_for_a_server_that_outlives_the_demo(tmp_path):
    """`kvdiag demo` dies at once on SIGINT while its server shuts down gracefully: close()
    must wait for the whole group, and SIGKILL what is still there past the timeout.

    Two servers in the demo's group: a graceful one that, once the demo is gone, finishes its
    shutdown (writes a marker) and exits; a stubborn one that ignores SIGINT and SIGTERM and
    only SIGKILL ends. The marker proves close() gave the group time; the stubborn one dead
    proves it then killed what was left."""
    from kvdiag.live.demo_source import DemoSource
    import psutil

    marker = tmp_path / "graceful-shutdown-done"
    graceful = (f"import os, pathlib, time\nparent = os.getppid()\nprint('up', flush=True)\n"
                f"while os.getppid() == parent: time.sleep(0.05)\n"
                f"time.sleep(0.5)  # its shutdown takes a while\npathlib.Path({str(marker)!r}).write_text('done')")
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(300)")
    code = ("import subprocess, sys, time; "
            f"[subprocess.Popen([sys.executable, '-c', c]) for c in ({graceful!r}, {stubborn!r})]; time.sleep(300)")
    src = DemoSource([], log_dir=tmp_path, command=[sys.executable, "-c", code], stop_timeout_s=3)
    parent = psutil.Process(src.child.pid)
    out = tmp_path / "kvdiag-top-demo.out"
    deadline = time.monotonic() + 30
    while not (out.exists() and out.read_text().count("up") == 2):
        assert time.monotonic() < deadline, "the demo's two servers never started"
        time.sleep(0.05)
    kids = parent.children(recursive=True)
    assert len(kids) == 2
    src.close()
    assert marker.read_text() == "done"  # close() waited while the graceful server shut down
    gone, alive = psutil.wait_procs(kids, timeout=5)
    assert not alive  # ...and the stubborn one, which only SIGKILL stops, is gone too


def test_demo_child_is_interrupted_when_top_dies(tmp_path):
    """If top is killed (no chance to close), the demo still gets SIGINT and stops, even when
    top itself was started with SIGINT ignored (``cmd &`` in a script, CI, nohup)."""
    import psutil

    ready, marker = tmp_path / "ready", tmp_path / "interrupted"
    demo = (f"import time, pathlib\ntry:\n    pathlib.Path({str(ready)!r}).touch()\n    time.sleep(300)\n"
            f"except KeyboardInterrupt:\n    pathlib.Path({str(marker)!r}).write_text('yes')")
    top = textwrap.dedent(f"""
        import signal, sys, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a non-interactive shell gives `top &`
        from kvdiag.live.demo_source import DemoSource
        src = DemoSource([], log_dir=__import__('pathlib').Path({str(tmp_path)!r}),
                         command=[sys.executable, "-c", {demo!r}])
        print(src.child.pid, flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", top], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(proc.stdout.readline()))
    deadline = time.monotonic() + 60
    while not ready.exists():  # the demo is inside its try block: a SIGINT now is a graceful stop
        assert time.monotonic() < deadline and child.is_running(), "the demo child never started"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    child.wait(timeout=30)
    assert marker.read_text() == "yes"
