"""The relay of a vLLM worker's events to its engine core's agent: :class:`WorkerLink` in a
worker process queues and sends JSON lines over a private Unix socket, :class:`WorkerInbox` in the
engine core decodes them into the agent's sink, so that a server keeps one log and one live socket
(:mod:`kvdiag.collectors.vllm_worker` says why)."""

from __future__ import annotations

import os
import time
from typing import Optional

from kvdiag.events.hooks import HookErrors
from kvdiag.events.sinks import Sink

ENV_WORKER_SOCKET = "KVDIAG_WORKER_SOCKET"
LINK_RETRY_S = 1.0  # the worker tries the engine core's inbox at most this often until it links
LINK_QUEUE_EVENTS = 20_000  # events the worker holds for the inbox; beyond, dropped and counted
LINK_BATCH_EVENTS = 512  # most events the link sends in one write


def choose_worker_socket() -> str:
    """The inbox path of this server, decided by the first vLLM process that loads the plugin
    (the API server) and inherited by the engine core and the workers it starts
    (``KVDIAG_WORKER_SOCKET``)."""
    path = os.environ.get(ENV_WORKER_SOCKET)
    if not path:
        from kvdiag.paths import worker_inbox_path
        path = str(worker_inbox_path())
        os.environ[ENV_WORKER_SOCKET] = path
    return path


class WorkerInbox:
    """In the engine core: a Unix socket (mode 0600, in the private runtime dir) where the
    worker processes send their events as JSON lines; each is decoded and recorded into the
    agent's ``sink``, so that one log and one live socket carry the server's events. A line
    that does not decode is counted (``errors``), reported once, and skipped."""

    def __init__(self, path: str, sink: Sink, errors: HookErrors) -> None:
        import socket
        import threading

        from kvdiag.paths import make_private_dirs

        self.path, self.sink, self.errors = path, sink, errors
        make_private_dirs(os.path.dirname(path))
        if os.path.exists(path):
            os.unlink(path)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._server.bind(path)
        finally:
            os.umask(old)
        self._server.listen(8)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self.connections = 0
        self._threads: list = []
        self._conns: list = []
        self._accepting = threading.Thread(target=self._accept, name="kvdiag-worker-inbox", daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._serve(conn)

    def _serve(self, conn) -> None:
        """Read ``conn`` on a thread of its own (registered before :meth:`close` can join it)."""
        import threading

        t = threading.Thread(target=self._read, args=(conn,), name="kvdiag-worker-inbox-conn", daemon=True)
        with self._lock:
            self.connections += 1
            self._conns.append(conn)
            t.start()
            self._threads.append(t)

    def _read(self, conn) -> None:
        import msgspec

        from kvdiag.events.schema import AnyEvent

        decoder = msgspec.json.Decoder(AnyEvent)
        rest = b""
        with conn:
            while True:
                try:
                    chunk = conn.recv(1 << 16)
                except OSError:
                    return
                if not chunk:
                    return
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    if self._closed:
                        return
                    try:
                        self.sink.record(decoder.decode(line))
                    except Exception as exc:
                        self.errors.failed("worker_inbox", exc)

    def close(self, drain_s: float = 2.0) -> None:
        """Stop accepting; give the open connections, and those still waiting to be accepted, up
        to ``drain_s`` to deliver what they sent."""
        import socket

        self._stop.set()
        self._server.setblocking(False)
        while True:  # a worker that connected and sent just before: its events are not lost
            try:
                conn, _ = self._server.accept()
            except OSError:  # none left waiting (or the socket is gone)
                break
            conn.setblocking(True)
            self._serve(conn)
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._server.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self._accepting.join(timeout=drain_s)
        deadline = time.monotonic() + drain_s
        with self._lock:
            threads, conns = list(self._threads), list(self._conns)
        for t in threads:  # workers that exit close their end: their last events arrive
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._closed = True  # what a live worker sends from now on is not recorded
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # the reader sees the end
            except OSError:
                pass


class WorkerLink:
    """In a worker process: the sink that sends events to the engine core's :class:`WorkerInbox`
    from a daemon thread (the engine's thread only queues them; a full queue drops and counts,
    ``dropped``, never blocks)."""

    def __init__(self, sock) -> None:
        import queue
        import threading

        import msgspec

        self._sock = sock
        self._encoder = msgspec.json.Encoder()
        self._queue: "queue.Queue" = queue.Queue(maxsize=LINK_QUEUE_EVENTS)
        self.dropped = 0
        self.closed = False
        self._thread = threading.Thread(target=self._send, name="kvdiag-worker-link", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, path: str) -> Optional["WorkerLink"]:
        """A link to the inbox at ``path``, or None when it is not listening (yet)."""
        import socket

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return None
        return cls(sock)

    def record(self, event) -> None:
        import queue

        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def flush(self) -> None:
        pass

    def _send(self) -> None:
        """Send what is queued, up to :data:`LINK_BATCH_EVENTS` lines per write."""
        import queue

        while True:
            batch = [self._queue.get()]
            while batch[-1] is not None and len(batch) < LINK_BATCH_EVENTS:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            last = batch[-1] is None
            lines = [self._encoder.encode(e) for e in (batch[:-1] if last else batch)]
            try:
                if lines:
                    self._sock.sendall(b"\n".join(lines) + b"\n")
            except OSError:  # the engine core went away: nothing more to deliver
                self.closed = True
                return
            if last:
                return

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``timeout_s``), then close."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except Exception:
            pass
        self._thread.join(timeout=timeout_s)
        self._sock.close()
