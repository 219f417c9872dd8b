"""Writing the event log (:mod:`kvdiag.events.eventlog`): append-only JSONL, a header line first,
one event per line.

Writing never blocks the observed thread: ``LogWriter.record`` appends to a bounded queue
that a background thread drains every ``interval_s``. When the queue is full, events are
dropped, counted, and the count is written as a ``CollectorGap`` event. Because each interval
ends with a flush to the OS (and a gzip sync flush for ``.gz`` logs), a ``kill -9`` loses at
most the last interval; the reader skips the truncated last line with a warning.
"""

from __future__ import annotations

import atexit
import collections
import gzip
import os
import signal
import threading
import time
import warnings
import weakref
import zlib
from pathlib import Path
from typing import IO, Iterable

import msgspec

from kvdiag.events.schema import CollectorGap, Event, LogHeader


DEFAULT_INTERVAL_S = 1.0
DEFAULT_MAX_QUEUE = 100_000


_open_writers: "weakref.WeakSet[LogWriter]" = weakref.WeakSet()


class LogWriter:
    """A Sink that appends events to a JSONL log (gzip when the path ends in ``.gz``).

    ``record`` costs a deque append; encoding and I/O happen on the flusher thread. The queue
    holds at most ``max_queue`` events between flushes; beyond that events are dropped and
    reported as one ``CollectorGap(collector="eventlog")`` per flush.
    """

    def __init__(self, path: str | os.PathLike, header: LogHeader, *,
                 interval_s: float = DEFAULT_INTERVAL_S, max_queue: int = DEFAULT_MAX_QUEUE):
        self.path = Path(path)
        self.header = header
        self.interval_s = interval_s
        self.max_queue = max_queue
        self._queue: collections.deque[Event] = collections.deque()
        self._drop_lock = threading.Lock()
        self._dropped = 0
        self._drop_start_ns = 0
        self._drop_end_ns = 0
        self._io_lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()
        self._file = open_for_append(self.path)
        self._file.write(self._encoder.encode(header) + b"\n")
        self._sync()
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdiag-log-writer", daemon=True)
        self._thread.start()
        _open_writers.add(self)
        atexit.register(self.close)

    # Sink interface ------------------------------------------------------------------
    def record(self, event: Event) -> None:
        if len(self._queue) < self.max_queue:
            self._queue.append(event)
            return
        now = time.time_ns()
        with self._drop_lock:
            if not self._dropped:
                self._drop_start_ns = now
            self._dropped += 1
            self._drop_end_ns = now

    def flush(self) -> None:
        """Write everything queued so far and hand it to the OS."""
        with self._io_lock:
            if self._closed:
                return
            self._write_pending()
            self._sync()

    # lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Flush and close; idempotent, safe from atexit and signal handlers."""
        if self._closed:
            return
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        with self._io_lock:
            if self._closed:
                return
            self._write_pending()
            self._file.close()
            self._closed = True
        atexit.unregister(self.close)

    def __enter__(self) -> "LogWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def dropped_events(self) -> int:
        """Events dropped since the last flush (reset when their gap event is written)."""
        return self._dropped

    # internals -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception as exc:  # a full disk must not kill the observed process
                warnings.warn(f"kvdiag: writing {self.path} failed: {exc}")

    def _write_pending(self) -> None:
        queue = self._queue
        batch = [queue.popleft() for _ in range(len(queue))]
        if batch:
            self._file.write(self._encoder.encode_lines(batch))
        with self._drop_lock:
            dropped, self._dropped = self._dropped, 0
            start_ns, end_ns = self._drop_start_ns, self._drop_end_ns
        if dropped:
            gap = CollectorGap(ts_ns=time.time_ns(), collector="eventlog", start_ns=start_ns,
                               end_ns=end_ns, dropped_events=dropped)
            self._file.write(self._encoder.encode(gap) + b"\n")

    def _sync(self) -> None:
        if isinstance(self._file, gzip.GzipFile):
            self._file.flush(zlib.Z_SYNC_FLUSH)  # makes all bytes so far decompressible
        self._file.flush()


def open_for_append(path: Path) -> IO[bytes]:
    """The log opened for appending; created 0600 (folders 0700) when new (kvdiag.paths)."""
    from kvdiag.paths import create_private, open_private

    if path.suffix == ".gz":
        create_private(path)  # gzip opens by name: the file exists, private, before it does
        return gzip.open(path, "ab", compresslevel=3)
    return open_private(path, "ab")


def flush_all_writers() -> None:
    """Flush every open LogWriter of this process (used by signal handlers)."""
    for writer in list(_open_writers):
        try:
            writer.flush()
        except Exception:
            pass


def install_signal_handlers(signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Flush open logs on SIGTERM/SIGINT, then hand the signal to the previous handler.

    Only possible from the main thread; elsewhere this does nothing (atexit still flushes).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in signals:
        previous = signal.getsignal(signum)

        def handler(num, frame, previous=previous):
            flush_all_writers()
            if callable(previous):
                previous(num, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(num, signal.SIG_DFL)
                os.kill(os.getpid(), num)

        signal.signal(signum, handler)
