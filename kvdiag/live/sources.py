"""Where ``kvdiag top`` gets its events: a recorded log replayed as if live, the kvdiag agent's
Unix socket stream of a running server, a served engine without the agent read from outside by
attach's collectors (its /metrics and KV events), or a host-level view of a process.

Every source has the same small interface: ``poll()`` returns the events available now,
``now_ns()`` is the source's event-time clock (wall clock when live, the replay position when
replaying), ``pause()``/``resume()``/``seek(seconds)``, ``finished``, ``header`` and ``close()``.
Pure data: no UI library is imported here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Callable, Iterator, Optional

import msgspec

from kvdiag.events import schema as s
from kvdiag.demo.child_command import kvdiag_module, reset_interrupt_signal
from kvdiag.collectors import agent_client
from kvdiag.collectors.agent_client import AgentConnection, AgentProtocolError
from kvdiag.paths import open_private

Clock = Callable[[], float]


class NoEngineError(Exception):
    """The process serves no recognised engine (exit status
    :data:`kvdiag.collectors.agent_client.NO_ENGINE_EXIT`)."""


class SourceError(Exception):
    """A source that cannot be opened; the message says what to do (one line)."""


def _drain(queue, limit: Optional[int]) -> list[s.Event]:
    """Up to ``limit`` events (all when None) taken from the left of a live source's deque,
    which its reader thread appends to."""
    out = []
    while queue and (limit is None or len(out) < limit):
        out.append(queue.popleft())
    return out


class ReplaySource:
    """Replays a recorded log at ``speed`` × real time. The replay position starts at the first
    event; pausing stops it; ``seek(seconds)`` jumps forward in log time. At the end of the log
    the position stays on the last event, so the final picture remains on screen."""

    live = False

    def __init__(self, path: str | os.PathLike, speed: float = 1.0, clock: Clock = time.monotonic,
                 start_paused: bool = False) -> None:
        from kvdiag.events.eventlog import iter_events, read_header

        if speed <= 0:
            raise ValueError(f"--speed must be positive, got {speed}")
        self.path = Path(path)
        self.header: Optional[s.LogHeader] = read_header(self.path)
        self.description = f"log {self.path.name} ×{speed:g}"
        self.speed = speed
        self._clock = clock
        self._events: Iterator[s.Event] = iter_events(self.path)
        self._problems: list[s.Event] = []
        self._next: Optional[s.Event] = self._read()
        start = self._next.ts_ns if self._next is not None else (self.header.start_ns if self.header else 0)
        self._pos_ns = start
        self._last_ts_ns = start
        self._last_clock = clock()
        self.paused = start_paused
        self.finished = self._next is None

    def _read(self) -> Optional[s.Event]:
        """The next event; the reader's warnings (bad or truncated lines) become
        CollectorError events instead of text on the terminal."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ev = next(self._events, None)
        for w in caught:
            self._problems.append(s.CollectorError(ts_ns=ev.ts_ns if ev else self._last_ts_ns,
                                                   collector="log-replay", message=str(w.message)))
        return ev

    def _advance(self) -> None:
        now = self._clock()
        if not self.paused and not self.finished:
            self._pos_ns += int((now - self._last_clock) * self.speed * 1e9)
        self._last_clock = now

    def now_ns(self) -> int:
        """The replay position (event time)."""
        self._advance()
        return self._last_ts_ns if self.finished else self._pos_ns

    def poll(self, limit: Optional[int] = None) -> list[s.Event]:
        """Events of the log up to the replay position (at most about ``limit``)."""
        self._advance()
        out, self._problems = self._problems, []
        while self._next is not None and self._next.ts_ns <= self._pos_ns and (limit is None or len(out) < limit):
            out.append(self._next)
            self._last_ts_ns = max(self._last_ts_ns, self._next.ts_ns)
            self._next = self._read()
        if self._next is None:
            self.finished = True
        return out

    def pause(self) -> None:
        self._advance()
        self.paused = True

    def resume(self) -> None:
        self._advance()
        self.paused = False

    def seek(self, seconds: float) -> None:
        """Jump forward ``seconds`` of log time (backwards is not supported: state only grows)."""
        self._advance()
        if seconds > 0:
            self._pos_ns += int(seconds * 1e9)

    def close(self) -> None:
        close = getattr(self._events, "close", None)
        if close is not None:
            close()


class SocketSource:
    """Reads the kvdiag agent's stream: JSON lines on a Unix socket, the agent's
    :class:`LogHeader` first, then one event per line. A reader thread decodes into a
    bounded queue; a line that does not decode, a full queue, a lost connection or an agent
    silent for :data:`~kvdiag.collectors.agent_client.READ_TIMEOUT_S` (it sends keep-alives
    every second) become ``CollectorError``/``CollectorGap``/``CollectorStatus`` events, never
    exceptions. The connection is retried every ``retry_s`` until :meth:`close`. ``conn``: a
    connection whose header was read already (see :func:`attach`)."""

    live = True

    def __init__(self, path: str | os.PathLike, max_queue: int = 200_000, retry_s: float = 1.0,
                 description: str = "", conn: Optional[AgentConnection] = None) -> None:
        self.path = Path(path)
        self.description = description or f"agent {self.path}"
        self.header: Optional[s.LogHeader] = conn.header if conn is not None else None
        self._first_conn = conn
        self.paused = False
        self.finished = False
        self.connected = False
        self._queue: deque[s.Event] = deque()
        self._max_queue = max_queue
        self._dropped = 0
        self._drop_start_ns = 0
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._conn: Optional[AgentConnection] = None
        self._thread = threading.Thread(target=self._run, name="kvdiag-agent-reader", daemon=True)
        self._thread.start()

    def now_ns(self) -> int:
        return time.time_ns()

    def _emit(self, ev: s.Event) -> None:
        if len(self._queue) >= self._max_queue:
            if not self._dropped:
                self._drop_start_ns = ev.ts_ns
            self._dropped += 1
            return
        if self._dropped:
            self._queue.append(s.CollectorGap(ts_ns=time.time_ns(), collector="agent-stream",
                                              start_ns=self._drop_start_ns, end_ns=ev.ts_ns,
                                              dropped_events=self._dropped))
            self._dropped = 0
        self._queue.append(ev)

    def _run(self) -> None:
        was_connected = False
        while not self._stop.is_set():
            conn, self._first_conn = self._first_conn, None
            try:
                conn = conn or AgentConnection(self.path, timeout_s=agent_client.READ_TIMEOUT_S)
            except OSError as exc:
                if was_connected or isinstance(exc, (AgentProtocolError, PermissionError)):
                    self._status(f"agent socket lost: {exc}" if was_connected else str(exc))
                    was_connected = False
                self._stop.wait(self._retry_s)
                continue
            self._conn = conn
            self.connected = was_connected = True
            self._emit(s.CollectorStatus(ts_ns=time.time_ns(), collector="agent-stream", available=True))
            self._read(conn)
            self.connected = False
            conn.close()
            if conn.timed_out:
                self._status(f"{self.path}: the agent is not answering (nothing for "
                             f"{agent_client.READ_TIMEOUT_S:g} s); reconnecting")
                was_connected = False

    def _status(self, hint: str) -> None:
        self._emit(s.CollectorStatus(ts_ns=time.time_ns(), collector="agent-stream", available=False, hint=hint))

    def _read(self, conn: AgentConnection) -> None:
        if conn.header is None:
            try:
                self.header = conn.read_header()
            except agent_client.AgentNotAnswering as exc:
                self._status(str(exc))
                return
            except AgentProtocolError as exc:
                if conn.header_line is None:  # closed before a header: nothing was sent
                    return
                self._emit(s.CollectorError(ts_ns=time.time_ns(), collector="agent-stream", message=str(exc)))
            except OSError:
                return
        for ev in conn.events(self._bad_line):
            if self._stop.is_set():
                return
            self._emit(ev)

    def _bad_line(self, _line: bytes, exc: msgspec.DecodeError) -> None:
        self._emit(s.CollectorError(ts_ns=time.time_ns(), collector="agent-stream",
                                    message=f"{self.path}: expected an event line: {exc}"))

    def poll(self, limit: Optional[int] = None) -> list[s.Event]:
        return _drain(self._queue, limit)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def seek(self, seconds: float) -> None:
        """A live stream cannot seek."""

    def close(self) -> None:
        self._stop.set()
        if self._conn is not None:
            self._conn.shutdown()
        self._thread.join(timeout=2)


class ProcessSource:
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
        self.paused = False
        self.finished = False
        self._period_ns = int(period_s * 1e9)
        self._last_ns = 0
        self._pending: list[s.Event] = [self.nvml.start()]
        if not has_agent:
            self._pending.append(s.CollectorStatus(
                ts_ns=time.time_ns(), collector="agent-stream", available=False,
                hint=f"no kvdiag agent in pid {pid}: KV pool, requests and shadow panels need one "
                     "(start the server under kvdiag)"))

    def now_ns(self) -> int:
        return time.time_ns()

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

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def seek(self, seconds: float) -> None:
        """A live view cannot seek."""

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


class OutsideSource:
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
        self.paused = False
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

    def now_ns(self) -> int:
        return time.time_ns()

    def poll(self, limit: Optional[int] = None) -> list[s.Event]:
        return _drain(self._sink.queue, limit)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def seek(self, seconds: float) -> None:
        """A live view cannot seek."""

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.collectors.close()


def find_agent_socket(pid: int) -> Optional[Path]:
    """The kvdiag agent socket serving any PID of a served process tree (see
    :func:`kvdiag.collectors.agent_client.find_agent_socket`), if one exists."""
    return agent_client.find_agent_socket(pid)


class MergedSource:
    """A primary source (agent stream, demo) plus the host view of its process tree (RSS, GPU
    memory) sampled from outside; clock, header, pause and seek are the primary's."""

    live = True

    def __init__(self, primary, host: "ProcessSource") -> None:
        self.primary, self.host = primary, host

    description = property(lambda self: self.primary.description)
    header = property(lambda self: self.primary.header)
    paused = property(lambda self: self.primary.paused)
    finished = property(lambda self: self.primary.finished)

    def now_ns(self) -> int:
        return self.primary.now_ns()

    def poll(self, limit: Optional[int] = None) -> list[s.Event]:
        return self.primary.poll(limit) + self.host.poll()

    def pause(self) -> None:
        self.primary.pause()

    def resume(self) -> None:
        self.primary.resume()

    def seek(self, seconds: float) -> None:
        self.primary.seek(seconds)

    def close(self) -> None:
        self.host.close()
        self.primary.close()


def with_host_view(primary, pid: int):
    """``primary`` merged with the outside view of ``pid`` (``primary`` alone when that
    process cannot be read)."""
    try:
        return MergedSource(primary, ProcessSource(pid, has_agent=True))
    except Exception:  # the process went away or is unreadable: the primary still works
        return primary


def attach(pid: int, any_process: bool = False, outside=None):
    """A source for a running server: its agent socket if it has one; else, when its tree
    serves a recognised engine (vLLM, SGLang, TensorRT-LLM) or ``outside`` names a
    ``/metrics`` or KV-event endpoint, attach's outside collectors (:class:`OutsideSource`);
    else the host view. ``outside``: :class:`kvdiag.collectors.outside.OutsideOptions`.
    Raises SourceError when there is no such process or it may not be read, and when its agent
    does not send its header within :data:`~kvdiag.collectors.agent_client.HEADER_TIMEOUT_S`
    ("the agent is not answering"), refuses us or is another user's; :class:`NoEngineError`
    when the process serves no recognised engine (no agent in its tree, not a vLLM, SGLang or
    TensorRT-LLM server), unless ``any_process``."""
    import psutil

    from kvdiag.collectors.outside import OutsideOptions, recognised_server

    if not psutil.pid_exists(pid):
        raise SourceError(f"no process with PID {pid}")
    path = find_agent_socket(pid)
    served = recognised_server(pid) if path is None else None
    endpoints = outside is not None and bool(outside.metrics_url or outside.kv_events)
    if path is None and served is None and not endpoints and not any_process:
        raise NoEngineError(
            f"process {agent_client.process_label(pid)} serves no recognised engine: no kvdiag agent in "
            "its process tree and not a vLLM, SGLang or TensorRT-LLM server (--any-process watches it "
            "from outside anyway: process tree, NVML, py-spy)")
    if path is not None:
        try:
            conn = AgentConnection(path, timeout_s=agent_client.READ_TIMEOUT_S)
        except (AgentProtocolError, PermissionError) as exc:
            raise SourceError(f"pid {pid}: {exc}") from None
        except OSError:  # it went away: the outside view
            conn = None
        if conn is not None:
            try:
                conn.read_header()
            except OSError as exc:
                conn.close()
                raise SourceError(f"pid {pid}: {exc}") from None
            return with_host_view(SocketSource(path, description=f"pid {pid} agent", conn=conn), pid)
    try:
        if served is not None or endpoints:
            # an engine child (VLLM::EngineCore, ::Worker): its server's /metrics and KV events
            return OutsideSource(served.pid if served is not None else pid,
                                 options=outside or OutsideOptions(hardware=False))
        return ProcessSource(pid)
    except (RuntimeError, PermissionError) as exc:  # collectors' TargetGone / TargetNotAccessible
        raise SourceError(str(exc)) from None


class DemoSource:
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
        self.paused = False
        self.finished = False
        self._stop_timeout_s = stop_timeout_s
        self._deadline = time.monotonic() + socket_wait_s
        self._socket: Optional[SocketSource] = None
        self._pending: list[s.Event] = [s.CollectorStatus(
            ts_ns=time.time_ns(), collector="agent-stream", available=False,
            hint=f"starting kvdiag demo (pid {self.child.pid}); output in {self.output_path}")]

    def now_ns(self) -> int:
        return time.time_ns()

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

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def seek(self, seconds: float) -> None:
        """A live demo cannot seek."""

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
