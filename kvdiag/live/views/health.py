"""Collector health: events dropped in gaps, collector errors, collectors not available."""

from __future__ import annotations

from kvdiag.events import schema as s
from kvdiag.live.snapshot import HealthView


class HealthFold:
    def __init__(self) -> None:
        self.dropped_events = 0
        self.gaps = 0
        self.errors: dict[str, list] = {}
        self.status: dict[str, s.CollectorStatus] = {}
        self.handlers = {s.CollectorGap: self.on_gap, s.CollectorError: self.on_error,
                         s.CollectorStatus: self.on_status}

    def on_gap(self, ev: s.CollectorGap, b, idx: int) -> None:
        self.gaps += 1
        self.dropped_events += ev.dropped_events

    def on_error(self, ev: s.CollectorError, b, idx: int) -> None:
        entry = self.errors.setdefault(ev.collector, [0, ""])
        entry[0] += ev.count
        entry[1] = ev.message

    def on_status(self, ev: s.CollectorStatus, b, idx: int) -> None:
        self.status[ev.collector] = ev

    def hint(self, keys: tuple[str, ...], default: str) -> str:
        """The hint of an unavailable collector whose name contains one of ``keys``."""
        for name, st in sorted(self.status.items()):
            if not st.available and any(k in name.lower() for k in keys):
                return st.hint or f"{name} unavailable"
        return default

    def view(self) -> HealthView:
        return HealthView(
            dropped_events=self.dropped_events, gaps=self.gaps,
            errors=tuple((c, e[0], e[1]) for c, e in sorted(self.errors.items())),
            unavailable=tuple((c, st.hint) for c, st in sorted(self.status.items()) if not st.available))
