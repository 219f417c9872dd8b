"""A recorded log replayed as if live, at a chosen speed: the source of ``kvdiag top --log``
(the source interface: :mod:`kvdiag.live.sources`)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional

from kvdiag.events import schema as s
from kvdiag.live.sources import Clock


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
