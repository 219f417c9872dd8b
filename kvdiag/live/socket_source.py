"""The kvdiag agent's event stream read from its Unix socket: the source of ``kvdiag top
--socket`` and of a PID whose tree runs the agent (the source interface: :mod:`kvdiag.live.sources`)."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Optional

import msgspec

from kvdiag.events import schema as s
from kvdiag.collectors import agent_client
from kvdiag.collectors.agent_client import AgentConnection, AgentProtocolError
from kvdiag.live.sources import LiveSource, drain


class SocketSource(LiveSource):
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
        return drain(self._queue, limit)

    def close(self) -> None:
        self._stop.set()
        if self._conn is not None:
            self._conn.shutdown()
        self._thread.join(timeout=2)
