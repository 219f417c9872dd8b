"""Where events go: a two-method interface, ``record(event)`` and ``flush()``.

The hot path of an observed engine calls ``sink.record(event)`` unconditionally; when nothing
is listening the sink is a :class:`NullSink`, so no ``if enabled`` is scattered through hooks.
``record`` must never block and never raise into the caller.
"""

from __future__ import annotations

from typing import Iterable, Protocol

from kvdiag.events.schema import Event


class Sink(Protocol):
    def record(self, event: Event) -> None: ...

    def flush(self) -> None: ...


class NullSink:
    """Discards everything: the sink when recording is off."""

    def record(self, event: Event) -> None:
        pass

    def flush(self) -> None:
        pass


class ListSink:
    """Keeps events in memory (tests, in-process analyses)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def record(self, event: Event) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass


class FanoutSink:
    """Records every event into each of several sinks; one failing sink does not stop the others."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)

    def record(self, event: Event) -> None:
        for sink in self.sinks:
            try:
                sink.record(event)
            except Exception:  # a sink must never break the observed process
                pass

    def flush(self) -> None:
        for sink in self.sinks:
            try:
                sink.flush()
            except Exception:
                pass
