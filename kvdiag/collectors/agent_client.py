"""Client of the kvdiag agent's live stream: a Unix socket sending JSON lines, the agent's
``LogHeader`` first, then every event (the same JSON as a log line).

:class:`AgentConnection` is the one client of that protocol (connect, header, events);
:class:`AgentStream` records a connection's events into a sink from a background thread;
:func:`candidate_sockets` finds a process tree's agent sockets and :func:`find_agent_socket`
the one agent serving any PID of a served process tree (what ``doctor --pid``, ``top --pid``
and ``attach`` all use).

Trust: a socket file owned by another uid, or a symlink, is never connected to, and after
connecting the peer's uid (``SO_PEERCRED``, Linux) must be this process's uid. Timeouts: the
connect and the header are bounded by :data:`HEADER_TIMEOUT_S` (a live agent answers at
once); the agent sends a blank keep-alive line every second it has nothing else to say, so a
reader may bound every later read too (:data:`READ_TIMEOUT_S`)."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import msgspec
import psutil

from kvdiag.events.schema import AnyEvent, CollectorError, Event, LogHeader
from kvdiag.events.sinks import Sink
from kvdiag.paths import is_worker_inbox

NAME = "agent"

_HEADER_DECODER = msgspec.json.Decoder(LogHeader)
_EVENT_DECODER = msgspec.json.Decoder(AnyEvent)


HEADER_TIMEOUT_S = 5.0
"""Longest wait for the connection and the agent's header line."""
READ_TIMEOUT_S = 10.0
"""Longest silence after the header before a reader may call the agent not answering."""


NO_ENGINE_EXIT = 4
"""Exit status of ``attach PID`` and ``doctor --pid PID`` when PID serves no recognised engine
(no kvdiag agent in its process tree; for attach, not a vLLM server either)."""


class AgentProtocolError(ConnectionError):
    """The agent closed the connection before its header, or its first line is not a header."""


class AgentNotAnswering(AgentProtocolError):
    """The agent accepted the connection (or left it pending) but sent no header in time."""


class AgentRefused(AgentProtocolError):
    """The agent refused this client (too many clients, out of file descriptors); the message
    is its one-line reason."""


class AgentNotTrusted(PermissionError):
    """The socket, or the process serving it, belongs to another user: not connected to."""


def check_socket_owner(path: Path) -> None:
    """Raise :class:`AgentNotTrusted` when ``path`` is a symlink or a file of another uid
    (nothing is raised for a missing path: connecting then fails as usual)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise AgentNotTrusted(f"{path} is a symlink; not connecting to it")
    if st.st_uid != os.getuid():
        raise AgentNotTrusted(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); "
                              "not connecting to it (run kvdiag as the server's user)")


def _peer_uid(sock: socket.socket) -> Optional[int]:
    """The uid of the process at the other end (None where SO_PEERCRED is not available)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class AgentConnection:
    """One connection to an agent socket. ``timeout_s`` bounds every read (None: block); the
    connect and the header are bounded by :data:`HEADER_TIMEOUT_S` as well. Raises OSError
    when nothing listens at ``path``, :class:`AgentNotTrusted` for another user's socket.

    Read :meth:`read_header` first, then :meth:`events` (decoded) or :meth:`lines` (raw, each
    a log line with its newline)."""

    def __init__(self, path: str | os.PathLike, timeout_s: Optional[float] = None) -> None:
        self.path = Path(path)
        self.header_line: Optional[bytes] = None
        self.header: Optional[LogHeader] = None
        self.timed_out = False  # a read timed out (set by lines())
        self._timeout_s = timeout_s
        check_socket_owner(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(self._header_timeout_s())
        try:
            self._sock.connect(str(self.path))
            uid = _peer_uid(self._sock)
            if uid is not None and uid != os.getuid():
                raise AgentNotTrusted(f"{self.path} is served by uid {uid}, not by this user (uid {os.getuid()}); "
                                      "not reading it")
        except TimeoutError:  # its listen backlog is full: nobody accepts
            self._sock.close()
            raise AgentNotAnswering(f"{self.path}: the agent is not answering "
                                    f"(connection not accepted within {self._header_timeout_s():g} s)") from None
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(timeout_s)
        self._file = self._sock.makefile("rb")

    def _header_timeout_s(self) -> float:
        return HEADER_TIMEOUT_S if self._timeout_s is None else min(self._timeout_s, HEADER_TIMEOUT_S)

    def settimeout(self, timeout_s: Optional[float]) -> None:
        """Bound the following reads (None: block until data or close)."""
        self._timeout_s = timeout_s
        self._sock.settimeout(timeout_s)

    def read_header(self) -> LogHeader:
        """The stream's first non-blank line as the agent's ``LogHeader`` (kept raw in
        ``header_line``); raises :class:`AgentNotAnswering` when none comes within
        :data:`HEADER_TIMEOUT_S`, :class:`AgentRefused` when the agent refused this client and
        :class:`AgentProtocolError` if it is missing or not a header."""
        wait_s = self._header_timeout_s()
        self._sock.settimeout(wait_s)
        try:
            for line in self._file:
                if line.strip():
                    break
            else:
                raise AgentProtocolError(f"{self.path}: the agent closed the connection before its header")
        except TimeoutError:
            raise AgentNotAnswering(f"{self.path}: the agent is not answering (no header within {wait_s:g} s)") from None
        self._sock.settimeout(self._timeout_s)
        self.header_line = line
        try:
            self.header = _HEADER_DECODER.decode(line)
            return self.header
        except msgspec.DecodeError as exc:
            refused = _refusal(line)
            if refused:
                raise AgentRefused(f"{self.path}: the agent refused this client: {refused}") from None
            raise AgentProtocolError(f"{self.path}:1: expected a kvdiag log header line ({exc})") from None

    def lines(self) -> Iterator[bytes]:
        """The raw non-blank lines after the header, until the agent closes the connection, the
        connection is closed or shut down here, or a read times out (``timed_out`` is then set)."""
        try:
            for line in self._file:
                if line.strip():
                    yield line
        except TimeoutError:
            self.timed_out = True
        except (OSError, ValueError):  # reset, or closed here: the stream ends
            return

    def events(self, on_bad_line: Optional[Callable[[bytes, msgspec.DecodeError], None]] = None
               ) -> Iterator[Event]:
        """The events after the header, decoded with the schema; a line that does not decode
        is passed to ``on_bad_line`` (if given) and skipped."""
        for line in self.lines():
            try:
                yield _EVENT_DECODER.decode(line)
            except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
                if on_bad_line is not None:
                    on_bad_line(line, exc)

    def shutdown(self) -> None:
        """Make a blocked read in another thread return (end of stream)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Disconnect; a read blocked in another thread ends first (its stream just ends)."""
        self.shutdown()  # closing the buffered file waits for a blocked reader to let go
        try:
            self._file.close()
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "AgentConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refusal(line: bytes) -> Optional[str]:
    """The reason of the agent's refusal line ``{"refused": REASON}``, else None."""
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    return str(obj["refused"]) if isinstance(obj, dict) and "refused" in obj else None


def _is_agent_socket(path: str) -> bool:
    """A socket named like an agent's, or in a kvdiag runtime dir; never a vLLM workers' inbox
    (the engine core listens on both, and the process title vLLM sets hides its environment's
    ``KVDIAG_SOCKET`` from /proc)."""
    p = Path(path)
    return p.suffix == ".sock" and not is_worker_inbox(p) and (
        p.name.startswith("agent-") or p.parent.name == "kvdiag" or p.parent.name.startswith("kvdiag-"))


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
    ``python -m kvdiag.run`` command line, or ``KVDIAG_SOCKET`` in the environment of a
    process running the agent as a plugin (vLLM's engine core); Unix sockets the tree listens on that live in a
    kvdiag runtime dir or are named ``agent-*.sock``; the default per-pid path under the
    target's runtime dir (``$XDG_RUNTIME_DIR/kvdiag`` of its environment, else
    ``/tmp/kvdiag-<uid>``). Only existing sockets of this uid are returned; stale sockets of
    dead agents in this uid's runtime dirs are removed on the way."""
    from kvdiag.paths import remove_stale_sockets

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
            explicit = psutil.Process(pid).environ().get("KVDIAG_SOCKET")
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
        if _owned_by_me(base, stat.S_ISDIR):
            remove_stale_sockets(base)
        found.append(base / f"agent-{pid}.sock")
    seen, out = set(), []
    for p in found:
        if p not in seen and _owned_by_me(p, stat.S_ISSOCK):
            seen.add(p)
            out.append(p)
    return out


def tree_below(pid: int) -> list[int]:
    """``pid`` and its live descendants (just ``pid`` when they cannot be listed)."""
    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except (psutil.Error, OSError):
        return [pid]


def ancestors(pid: int) -> list[int]:
    """The parents of ``pid``, nearest first (empty when it cannot be read)."""
    try:
        return [p.pid for p in psutil.Process(pid).parents()]
    except (psutil.Error, OSError):
        return []


def find_agent_socket(pid: int) -> Optional[Path]:
    """The kvdiag agent socket serving process ``pid``, given any PID of a served process tree:
    first ``pid`` and its descendants (the launcher ``kvdiag demo``, the server under
    ``python -m kvdiag.run``, a vLLM API server whose engine core runs the plugin), then each
    ancestor on its own, nearest first (an engine child such as ``VLLM::Worker``, whose agent is
    its parent ``VLLM::EngineCore``). An ancestor's other children are never searched: a shell
    that started a server is not that server. None when the tree runs no agent."""
    found = candidate_sockets(tree_below(pid))
    if found:
        return found[0]
    for parent in ancestors(pid):
        found = candidate_sockets([parent])
        if found:
            return found[0]
    return None


def process_label(pid: int) -> str:
    """``PID (name)`` for messages, or ``PID`` when the name cannot be read."""
    try:
        return f"{pid} ({psutil.Process(pid).name()})"
    except (psutil.Error, OSError):
        return str(pid)


def _owned_by_me(path: Path, is_kind) -> bool:
    """Whether ``path`` exists, is of the kind ``is_kind`` tests (no symlink) and is this uid's."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return is_kind(st.st_mode) and st.st_uid == os.getuid()


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
        self._conn = AgentConnection(self.path, timeout_s=timeout_s)
        try:
            self.header = self._conn.read_header()
        except OSError:  # AgentProtocolError included
            self._conn.close()
            raise
        self._conn.settimeout(None)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvdiag-attach-agent", daemon=True)

    def start(self) -> "AgentStream":
        self._thread.start()
        return self

    def _bad_line(self, _line: bytes, _exc: msgspec.DecodeError) -> None:
        self.bad_lines += 1

    def _run(self) -> None:
        # the agent or the target going away ends the stream: keep what was read
        for ev in self._conn.events(self._bad_line):
            if self._stop:
                break
            self.events += 1
            if self.first_ts_ns is None:
                self.first_ts_ns = ev.ts_ns
            self.last_ts_ns = ev.ts_ns
            self.sink.record(ev)

    def close(self, drain_s: float = 0.5) -> None:
        """Stop reading (after up to ``drain_s`` for lines already sent) and disconnect."""
        time.sleep(drain_s)
        self._stop = True
        self._conn.shutdown()
        self._thread.join(timeout=2)
        self._conn.close()
        if self.bad_lines:
            self.sink.record(CollectorError(ts_ns=time.time_ns(), collector=NAME,
                                            message="undecodable lines from the agent", count=self.bad_lines))
