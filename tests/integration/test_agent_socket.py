"""The agent's live socket under misbehaving clients (issue 14, item 3): a client that never
reads, too many clients, file-descriptor exhaustion, and an agent that accepts but never
answers (``kvdiag doctor --pid`` and ``kvdiag top --pid`` must say so, not hang).

Events are CONSTRUCTED TEST DATA (BlockAllocated lines of about 1 KB). Waits poll a condition
with a bounded deadline; nothing sleeps for a fixed time to let something happen."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvdiag.agent import LiveSocketSink
from kvdiag.agent.setup_lines import MAX_PROCESS_LINES
from kvdiag.collectors import agent_client
from kvdiag.collectors.agent_client import AgentConnection
from kvdiag.events.eventlog import make_header
from kvdiag.events.schema import BlockAllocated, CollectorGap, CollectorStatus, ProcessSample
from waiting import wait_for

PAD = "r" * 1000  # request id that makes one event line about 1 KB
MARKER = 10**9  # block id of the event a test waits for (beyond every flooded id)


def _sink(tmp_path, **limits) -> LiveSocketSink:
    return LiveSocketSink(tmp_path / "agent-1.sock", make_header(engine="test"), **limits)


def _flood(sink: LiveSocketSink, n: int, first_ts_ns: int = 1) -> None:
    for i in range(n):
        sink.record(BlockAllocated(ts_ns=first_ts_ns + i, request_id=PAD, block_id=i))


class Reader(threading.Thread):
    """Reads one connection's events into ``events``; ``seen(block_id)`` is set when that block's
    event arrives."""

    def __init__(self, path, timeout_s: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.conn = AgentConnection(path, timeout_s=timeout_s)
        self.header = self.conn.read_header()
        self.events: list = []
        self.arrived: dict[int, float] = {}
        self.start()

    def run(self) -> None:
        for ev in self.conn.events():
            self.events.append(ev)
            if isinstance(ev, BlockAllocated):
                self.arrived[ev.block_id] = time.monotonic()


def test_a_late_client_first_gets_each_process_latest_sample(tmp_path):
    """A client that joins between two memory samples sees each process's memory at once (its
    latest sample, before any new event), not only at the next sample."""
    sink = _sink(tmp_path)
    for rss in (100, 200):
        sink.record(ProcessSample(ts_ns=rss, pid=7, rss_bytes=rss))
    sink.record(ProcessSample(ts_ns=150, pid=8, rss_bytes=150))
    _flood(sink, 3)  # nobody listening: not kept
    reader = Reader(sink.path)
    try:
        wait_for(lambda: sink.num_clients == 1, what="the client accepted")
        sink.record(BlockAllocated(ts_ns=10**9, request_id="marker", block_id=MARKER))
        wait_for(lambda: MARKER in reader.arrived, what="the marker")
        samples = [e for e in reader.events if isinstance(e, ProcessSample)]
        assert [(e.pid, e.rss_bytes) for e in samples] == [(7, 200), (8, 150)]
        assert reader.events.index(samples[-1]) < len(reader.events) - 1  # before the new event
        assert [e.block_id for e in reader.events if isinstance(e, BlockAllocated)] == [MARKER]
    finally:
        reader.conn.close()
        sink.close()


def test_many_processes_never_crowd_out_a_new_collector_status(tmp_path):
    """Processes come and go (workers restart, a fleet of short-lived pids): each pid's latest
    sample is kept under its own bound, the most recently sampled first, so a collector that
    starts after hundreds of pids still reaches a late client."""
    sink = _sink(tmp_path)
    pids = range(1000, 1000 + 4 * MAX_PROCESS_LINES)
    for pid in pids:
        sink.record(ProcessSample(ts_ns=pid, pid=pid, rss_bytes=pid))
    sink.record(ProcessSample(ts_ns=9999, pid=pids[0], rss_bytes=1))  # sampled again: recent
    sink.record(CollectorStatus(ts_ns=10**4, collector="late-collector", available=True))
    reader = Reader(sink.path)
    try:
        wait_for(lambda: sink.num_clients == 1, what="the client accepted")
        sink.record(BlockAllocated(ts_ns=10**9, request_id="marker", block_id=MARKER))
        wait_for(lambda: MARKER in reader.arrived, what="the marker")
        assert [e.collector for e in reader.events if isinstance(e, CollectorStatus)] == ["late-collector"]
        samples = {e.pid: e.rss_bytes for e in reader.events if isinstance(e, ProcessSample)}
        assert len(samples) == MAX_PROCESS_LINES
        assert samples[pids[0]] == 1
        assert set(samples) == {pids[0], *pids[len(pids) - MAX_PROCESS_LINES + 1:]}
    finally:
        reader.conn.close()
        sink.close()


def test_a_client_that_never_reads_does_not_stall_the_others(tmp_path):
    """An order check, not a speed check: the reading client gets the marker behind 2 MB while
    the stuck client is still connected (its stall limit is far off), so the marker did not wait
    for the stuck client to take its data or to be dropped; a serving thread that blocks on the
    stuck client never delivers it."""
    sink = _sink(tmp_path, client_stall_s=600.0)
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.connect(str(sink.path))  # connected, never reads
    reader = Reader(sink.path)
    try:
        wait_for(lambda: sink.num_clients == 2, what="both clients accepted")
        _flood(sink, 2000)  # 2 MB: far beyond the stuck client's socket buffer, within its queue
        sink.record(BlockAllocated(ts_ns=10**9, request_id="marker", block_id=MARKER))
        wait_for(lambda: MARKER in reader.arrived, timeout_s=30.0, what="the reading client's marker")
        assert sink.num_clients == 2  # the stuck client was not dropped to get there (count only falls)
        assert sink.client_dropped_events == 0  # nor did it lose events: its 2 MB wait in its queue
    finally:
        stuck.close()
        reader.conn.close()
        sink.close()


def test_a_slow_client_is_told_how_many_events_it_lost(tmp_path):
    sink = _sink(tmp_path, client_queue_bytes=64 * 1024, client_stall_s=60.0)
    slow = AgentConnection(sink.path, timeout_s=10.0)
    try:
        slow.read_header()
        wait_for(lambda: sink.num_clients == 1)
        n = 4000
        _flood(sink, n)
        wait_for(lambda: sink.client_dropped_events > 0, what="drops for the slow client")
        got, gaps = 0, []
        events = slow.events()
        for ev in events:  # now it reads: the queued events, then what it lost
            if isinstance(ev, CollectorGap):
                gaps.append(ev)
                break
            got += 1
        sink.record(BlockAllocated(ts_ns=10**9, request_id="marker", block_id=MARKER))
        for ev in events:
            if isinstance(ev, CollectorGap):
                gaps.append(ev)
            elif ev.block_id == MARKER:
                break
            else:
                got += 1
    finally:
        slow.close()
        sink.close()
    assert gaps and all(g.collector == "agent-socket" for g in gaps)
    lost = sum(g.dropped_events for g in gaps)
    assert lost > 0 and got + lost == n  # every event arrived or was counted as lost
    assert all(1 <= g.start_ns <= g.end_ns <= n for g in gaps)


class FakeClock:
    """The sink's clock, moved by the test; ``reads`` counts the sink's readings of it."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now_s

    def wait_for_ticks(self, n: int = 2) -> None:
        """Until the serving thread has read the clock ``n`` more times: with ``n`` >= 2 it has
        finished a whole step (dispatch, flush, stall checks) at the current time."""
        reads = self.reads
        wait_for(lambda: self.reads >= reads + n, what=f"{n} reads of the clock")


def test_a_client_that_never_reads_is_disconnected(tmp_path):
    """On an injected clock: the stuck client stays while less than ``client_stall_s`` passes
    (a sink that drops a client once its queue overflows fails there), and goes once more has
    passed (a sink that never drops it fails there). A slow flood cannot shift the timer."""
    clock = FakeClock()
    stall_s = 10.0
    sink = _sink(tmp_path, client_queue_bytes=64 * 1024, client_stall_s=stall_s, clock_s=clock)
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.connect(str(sink.path))
    try:
        wait_for(lambda: sink.num_clients == 1)
        _flood(sink, 4000)
        wait_for(lambda: sink.client_dropped_events > 0, what="its queue overflowing")
        clock.now_s += 0.9 * stall_s
        clock.wait_for_ticks()
        assert sink.num_clients == 1
        clock.now_s += 0.2 * stall_s
        wait_for(lambda: sink.num_clients == 0, timeout_s=5.0, what="stuck client dropped")
        stuck.settimeout(5.0)
        while stuck.recv(1 << 16):  # what was in its socket buffer, then end of stream
            pass
    finally:
        stuck.close()
        sink.close()


def test_clients_past_the_cap_are_refused_at_once(tmp_path):
    sink = _sink(tmp_path, max_clients=2)
    first, second = AgentConnection(sink.path, timeout_s=5), AgentConnection(sink.path, timeout_s=5)
    try:
        first.read_header()
        second.read_header()
        # at once: a refusal that did not come within the connection's 5 s would be AgentNotAnswering
        with pytest.raises(agent_client.AgentRefused, match="too many clients"):
            with AgentConnection(sink.path, timeout_s=5) as third:
                third.read_header()
        first.close()  # a freed slot is taken again
        wait_for(lambda: sink.num_clients == 1, what="the closed client's slot freed")
        with AgentConnection(sink.path, timeout_s=5) as again:
            assert again.read_header().engine == "test"
    finally:
        first.close()
        second.close()
        sink.close()


FD_EXHAUSTION = r"""
import os, resource, sys
from kvdiag.agent import LiveSocketSink
from kvdiag.events.eventlog import make_header
sink = LiveSocketSink(sys.argv[1], make_header(engine="test"))
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
fds = []
try:
    while True:
        fds.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print("full", flush=True)
sys.stdin.readline()
for fd in fds:
    os.close(fd)
print("freed", flush=True)
sys.stdin.readline()
sink.close()
"""


def _readline(proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise AssertionError(f"no line from the child within {timeout_s} s")
    return proc.stdout.readline().strip()


def test_the_agent_accepts_again_after_running_out_of_file_descriptors(tmp_path):
    path = tmp_path / "agent-fd.sock"
    proc = subprocess.Popen([sys.executable, "-c", FD_EXHAUSTION, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert _readline(proc) == "full"
        # refused at once, not left hanging: AgentNotAnswering if no refusal came within 5 s
        with pytest.raises(agent_client.AgentRefused, match="file descriptors"):
            with AgentConnection(path, timeout_s=5) as conn:
                conn.read_header()
        proc.stdin.write("free\n")
        proc.stdin.flush()
        assert _readline(proc) == "freed"
        with AgentConnection(path, timeout_s=5) as conn:
            assert conn.read_header().engine == "test"
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


class SilentAgent:
    """A socket that accepts clients and never sends a byte."""

    def __init__(self, path) -> None:
        self.path = path
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(8)
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while True:
                self.held.append(self.server.accept()[0])
        except OSError:
            return

    def close(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        for conn in self.held:
            conn.close()


def test_doctor_pid_says_the_agent_is_not_answering(tmp_path, capsys, monkeypatch):
    from kvdiag.cli import main

    monkeypatch.setattr(agent_client, "HEADER_TIMEOUT_S", 0.5)
    silent = SilentAgent(tmp_path / "agent-silent.sock")
    try:
        start = time.monotonic()
        rc = main(["doctor", "--pid", str(os.getpid()), "--socket", str(silent.path), "--seconds", "30"])
        took_s = time.monotonic() - start
    finally:
        silent.close()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and took_s < 5.0
    assert "the agent is not answering" in err and len(err.splitlines()) == 1


SILENT_AGENT_PROCESS = """
import socket, sys
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(8)
print("listening", flush=True)
held = []
while True:
    held.append(server.accept()[0])
"""


def test_top_pid_says_the_agent_is_not_answering(tmp_path, capsys, monkeypatch):
    """A process of its own holds the silent agent socket, so the search finds that socket and
    no other (this test process may have children with live agents: a server fixture's)."""
    from kvdiag.cli import main
    from kvdiag.live.pid_source import attach
    from kvdiag.live.sources import SourceError

    monkeypatch.setattr(agent_client, "HEADER_TIMEOUT_S", 0.5)
    path = tmp_path / "agent-silent.sock"
    proc = subprocess.Popen([sys.executable, "-c", SILENT_AGENT_PROCESS, str(path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "listening"
        assert agent_client.find_agent_socket(proc.pid) == path
        start = time.monotonic()
        with pytest.raises(SourceError, match="the agent is not answering"):
            attach(proc.pid).close()
        assert time.monotonic() - start < 5.0
        assert main(["top", "--pid", str(proc.pid)]) == 2
    finally:
        proc.kill()
        proc.wait()
    err = capsys.readouterr().err.strip()
    assert "the agent is not answering" in err and len(err.splitlines()) == 1
