"""The agent's live socket: a Sink that serves every event as a JSON line to local clients.

Protocol: the ``LogHeader`` line, then the setup lines (:mod:`kvdiag.agent.setup_lines`: the
pool, the collectors' statuses, the shadow's counters, each process's latest memory sample),
then every event as it happens; a blank line is a keep-alive, sent after
:data:`KEEPALIVE_S` without data. A refused client gets one line ``{"refused": REASON}``.

Limits (one client cannot hurt the others or the engine):

- each client has its own queue of at most ``client_queue_bytes`` (:data:`CLIENT_QUEUE_BYTES`)
  beyond its kernel socket buffer; events that do not fit are dropped for that client only and
  counted, and once its queue is half empty it gets a ``CollectorGap`` (collector
  ``agent-socket``) saying how many and over which time span;
- a client that takes no byte for ``client_stall_s`` (:data:`CLIENT_STALL_S`) while data waits
  for it is disconnected;
- at most ``max_clients`` (:data:`MAX_CLIENTS`) clients; more are refused at once;
- out of file descriptors (EMFILE, ENFILE), the pending client is refused through a reserve
  descriptor, or accepting pauses :data:`ACCEPT_BACKOFF_S`; accepting resumes by itself.

One thread serves everything with non-blocking sockets. ``record()`` (the engine's thread)
only appends to a bounded deque and, once per batch, writes one byte to wake that thread; it
never blocks and never raises.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Optional

import msgspec

from kvdiag.agent.setup_lines import KEPT_TYPES, SetupLines
from kvdiag.events.schema import CollectorGap, Event, LogHeader

MAX_CLIENTS = 8
CLIENT_QUEUE_BYTES = 4 << 20
CLIENT_STALL_S = 10.0
KEEPALIVE_S = 1.0
ACCEPT_BACKOFF_S = 0.1
CHUNK_BYTES = 16 << 10  # a queued chunk (whole lines): the unit a slow client loses
_TICK_S = 0.2  # the serving thread's longest sleep (keep-alives, stall checks)
_FD_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_log = logging.getLogger("kvdiag.agent")

class _Client:
    """One connection: its queue of encoded chunks and what it lost."""

    __slots__ = ("sock", "out", "out_bytes", "offset", "progress_s", "sent_s", "dropped", "gap_ns", "mask")

    def __init__(self, sock: socket.socket, first: bytes, now_s: float) -> None:
        self.sock = sock
        self.out: deque[bytes] = deque([first])
        self.out_bytes = len(first)
        self.offset = 0  # bytes of out[0] already sent
        self.progress_s = now_s  # last time it took bytes (or its queue started filling)
        self.sent_s = now_s
        self.dropped = 0
        self.gap_ns = (0, 0)
        self.mask = 0

    def push(self, chunk: bytes, now_s: float) -> None:
        if not self.out:
            self.progress_s = now_s
        self.out.append(chunk)
        self.out_bytes += len(chunk)


class LiveSocketSink:
    """A Sink that streams events as JSON lines to every client of a Unix socket (module doc)."""

    def __init__(self, path: Path, header: LogHeader, max_pending: int = 50_000,
                 max_clients: int = MAX_CLIENTS, client_queue_bytes: int = CLIENT_QUEUE_BYTES,
                 client_stall_s: float = CLIENT_STALL_S, clock_s: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._clock_s = clock_s  # the time of stalls, keep-alives and the accept back-off (tests inject one)
        self.dropped_events = 0  # lost for every client: the shared pending queue was full
        self.client_dropped_events = 0  # lost by slow clients, summed over clients
        self.refused_clients = 0
        self.max_clients, self.client_queue_bytes, self.client_stall_s = max_clients, client_queue_bytes, client_stall_s
        self._encoder = msgspec.json.Encoder()
        self._header_line = self._encoder.encode(header) + b"\n"
        self._pending: deque[Event] = deque()
        self._max_pending = max_pending
        self._reported_dropped = 0
        self._setup_lines = SetupLines()  # what a late client is told first
        self._clients: dict[socket.socket, _Client] = {}
        self._closed = False
        self._woken = False
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self._server.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._server.listen(16)
        self._server.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._reserve_fd: Optional[int] = self._open_reserve()
        self._accept_resume_s: Optional[float] = None
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._server, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name="kvdiag-agent-socket", daemon=True)
        self._thread.start()

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    def record(self, event: Event) -> None:
        if isinstance(event, KEPT_TYPES):
            self._setup_lines.keep(event)
        if not self._clients:  # nobody listening: nothing to do on the hot path
            return
        if len(self._pending) >= self._max_pending:
            self.dropped_events += 1
            return
        self._pending.append(event)
        if not self._woken:
            self._wake()

    def flush(self) -> None:
        self._wake()

    def _wake(self) -> None:
        self._woken = True
        if self._wake_w is None:  # closed
            return
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # the pipe is full: the thread wakes anyway
            pass

    # --- the serving thread -------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._closed:
                self._step(self._select_timeout_s())
            self._step(0)  # what was recorded before close
            deadline = time.monotonic() + 1.0  # real time, whatever the clock: it bounds close()
            while any(c.out for c in self._clients.values()) and time.monotonic() < deadline:
                self._step(0.05)
        except Exception as exc:  # never into the engine: the socket stops, the log goes on
            _log.warning("kvdiag agent: live socket %s stopped: %r", self.path, exc)
        finally:
            for client in list(self._clients.values()):
                self._drop(client)
            self._sel.close()
            self._server.close()

    def _select_timeout_s(self) -> float:
        if self._accept_resume_s is None:
            return _TICK_S
        return max(0.0, min(_TICK_S, self._accept_resume_s - self._clock_s()))

    def _step(self, timeout_s: float) -> None:
        for key, mask in self._sel.select(timeout_s):
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except OSError:
                    pass
            elif mask & selectors.EVENT_READ:
                self._read(key.data)
        now_s = self._clock_s()
        if self._accept_resume_s is not None and now_s >= self._accept_resume_s:
            self._accept_resume_s = None
            if self._reserve_fd is None:
                self._reserve_fd = self._open_reserve()
            self._sel.register(self._server, selectors.EVENT_READ, "accept")
        self._dispatch(now_s)
        for client in list(self._clients.values()):
            self._flush(client, now_s)

    def _accept(self) -> None:
        try:
            sock, _ = self._server.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:
            if exc.errno in _FD_ERRORS and self._shed():
                return
            self._sel.unregister(self._server)  # out of fds (or worse): pause, then try again
            self._accept_resume_s = self._clock_s() + ACCEPT_BACKOFF_S
            return
        if len(self._clients) >= self.max_clients:
            self._refuse(sock, f"too many clients (this agent serves at most {self.max_clients})")
            return
        sock.setblocking(False)
        first = self._header_line + self._setup_lines.joined()
        client = _Client(sock, first, self._clock_s())
        self._clients[sock] = client
        client.mask = selectors.EVENT_READ
        self._sel.register(sock, client.mask, client)

    def _shed(self) -> bool:
        """Out of fds: free the reserve descriptor to accept and refuse the pending client."""
        if self._reserve_fd is None:
            return False
        os.close(self._reserve_fd)
        self._reserve_fd = None
        try:
            sock, _ = self._server.accept()
            self._refuse(sock, "the agent's process is out of file descriptors")
        except OSError:
            pass
        self._reserve_fd = self._open_reserve()
        return self._reserve_fd is not None

    def _refuse(self, sock: socket.socket, reason: str) -> None:
        self.refused_clients += 1
        try:
            sock.setblocking(False)
            sock.send(self._encoder.encode({"refused": reason}) + b"\n")
        except OSError:
            pass
        sock.close()

    @staticmethod
    def _open_reserve() -> Optional[int]:
        try:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    def _read(self, client: _Client) -> None:
        """Clients send nothing: data is discarded, end of stream or an error drops them."""
        try:
            if client.sock.recv(4096):
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._drop(client)

    def _dispatch(self, now_s: float) -> None:
        """Encode what was recorded into chunks and queue them for every client."""
        self._woken = False
        chunks: list[tuple[bytes, int, int, int]] = []
        if self.dropped_events > self._reported_dropped:
            lost = self.dropped_events - self._reported_dropped
            self._reported_dropped = self.dropped_events
            now_ns = time.time_ns()
            gap = CollectorGap(ts_ns=now_ns, collector="agent-socket", start_ns=now_ns, end_ns=now_ns,
                               dropped_events=lost)
            chunks.append((self._encoder.encode(gap) + b"\n", 0, 0, 0))
        pending = self._pending
        while pending:
            lines, size, first_ns, last_ns = [], 0, 0, 0
            while pending and size < CHUNK_BYTES:
                ev = pending.popleft()
                try:
                    line = self._encoder.encode(ev)
                except Exception:
                    continue
                if not lines:
                    first_ns = ev.ts_ns
                lines.append(line)
                size += len(line) + 1
                last_ns = ev.ts_ns
            if lines:
                chunks.append((b"\n".join(lines) + b"\n", len(lines), first_ns, last_ns))
        if not chunks:
            return
        for client in list(self._clients.values()):
            for chunk, n, first_ns, last_ns in chunks:
                if n and client.out and client.out_bytes + len(chunk) > self.client_queue_bytes:
                    self._send(client, now_s)  # a reading client makes room in its socket buffer
                if n and client.out and client.out_bytes + len(chunk) > self.client_queue_bytes:
                    if not client.dropped:
                        client.gap_ns = (first_ns, first_ns)
                    client.dropped += n
                    client.gap_ns = (client.gap_ns[0], last_ns)
                    self.client_dropped_events += n
                else:
                    client.push(chunk, now_s)

    def _send(self, client: _Client, now_s: float) -> bool:
        """Send what the client's socket takes now; False when the client is gone."""
        while client.out:
            head = client.out[0]
            try:
                sent = client.sock.send(memoryview(head)[client.offset:])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(client)
                return False
            client.progress_s = client.sent_s = now_s
            client.offset += sent
            if client.offset == len(head):
                client.out.popleft()
                client.out_bytes -= len(head)
                client.offset = 0
        return True

    def _flush(self, client: _Client, now_s: float) -> None:
        """Send what the client's socket takes now; tell it of drops, keep it alive, or drop it."""
        if client.sock not in self._clients or not self._send(client, now_s):
            return
        if client.dropped and client.out_bytes <= self.client_queue_bytes // 2:
            start_ns, end_ns = client.gap_ns
            gap = CollectorGap(ts_ns=time.time_ns(), collector="agent-socket", start_ns=start_ns, end_ns=end_ns,
                               dropped_events=client.dropped)
            client.dropped = 0
            client.push(self._encoder.encode(gap) + b"\n", now_s)
        elif not client.out and now_s - client.sent_s >= KEEPALIVE_S:
            client.push(b"\n", now_s)
        if client.out and now_s - client.progress_s > self.client_stall_s:
            self._drop(client)
            return
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.out else 0)
        if mask != client.mask:
            client.mask = mask
            self._sel.modify(client.sock, mask, client)

    def _drop(self, client: _Client) -> None:
        if self._clients.pop(client.sock, None) is None:
            return
        try:
            self._sel.unregister(client.sock)
        except (KeyError, ValueError):
            pass
        try:
            client.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        client.sock.close()

    def close(self) -> None:
        """Send what is pending (for up to a second), close every client and remove the socket."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(timeout=3)
        if not self._thread.is_alive():
            wake_w, self._wake_w = self._wake_w, None
            for fd in (self._wake_r, wake_w, self._reserve_fd):
                if fd is not None:
                    os.close(fd)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
