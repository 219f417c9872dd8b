"""The rules (``kvdiag.analysis.doctor.run_rules``) run live over the events seen so far, for
the alerts of ``kvdiag top``: the first run as soon as events arrive, then every ``period_s``,
and once more when a replayed log ends, so that top's final verdict is the doctor's. Its cost
is measured on each run and the period grows so that it stays under ``max_share`` of one core.
A failing run becomes a finding, never an exception. Pure: no UI library is imported here.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

import msgspec

from kvdiag import schema as s
from kvdiag.analysis import doctor, logs
from kvdiag.analysis.findings import Finding


class LiveRules:
    """Runs :func:`kvdiag.analysis.doctor.run_rules` over every event seen so far (up to
    ``max_events``; beyond, over the latest ones, and a ``collector.doctor_window`` finding
    says so), so that at the end of a log top's alerts are the doctor's findings on that log."""

    def __init__(self, max_events: int = 2_000_000, period_s: float = 15.0, max_share: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.buffer: deque[s.Event] = deque(maxlen=max_events)
        self.period_s = period_s
        self.max_share = max_share
        self.last_run_s: Optional[float] = None  # duration of the last run
        self.findings: tuple[Finding, ...] = ()
        self._clock = clock
        self._next = clock()  # the first verdict as soon as there are events
        self._seen = 0
        self._recorded = 0

    def record(self, events: list[s.Event]) -> None:
        self.buffer.extend(events)
        self._seen += len(events)
        self._recorded += len(events)

    def due(self, finished: bool = False) -> bool:
        """New events and the period is over, or the source has ended (the final verdict)."""
        return self._seen > 0 and (finished or self._clock() >= self._next)

    def take(self) -> list[s.Event]:
        """The buffered events to run on (copy them under the caller's lock, run outside it)."""
        self._seen = 0
        return list(self.buffer)

    def run(self, header: Optional[s.LogHeader], events: list[s.Event]) -> tuple[Finding, ...]:
        """Run every rule over ``events``; returns (and keeps) the findings."""
        start = self._clock()
        try:
            findings, _ = doctor.run_rules(self._frames(header, events))
            dropped = self._recorded - len(events)
            if dropped > 0:
                findings.append(Finding("collector.doctor_window", "n/a", "rules judged recent events only",
                                        f"the {len(events)} latest events; {dropped} earlier ones are not "
                                        "kept live (kvdiag doctor LOG judges the whole log; top's release-path "
                                        "and double-release verdicts come from its block ledger, over every event)",
                                        {"events": len(events), "dropped": dropped}))
            self.findings = tuple(findings)
        except Exception as exc:  # a rule that breaks on partial live data must not stop top
            self.findings = (Finding("doctor.error", "n/a", "doctor rules failed on live data",
                                     f"{type(exc).__name__}: {exc}"),)
        self.last_run_s = self._clock() - start
        self.period_s = max(self.period_s, self.last_run_s / self.max_share)
        self._next = self._clock() + self.period_s
        return self.findings

    def _frames(self, header: Optional[s.LogHeader], events: list[s.Event]):
        import pandas as pd

        node = (header.node or header.host) if header else ""
        node = node or "live"
        by_tag: dict[str, list] = {}
        for ev in events:
            by_tag.setdefault(s.event_tag(ev), []).append(msgspec.structs.astuple(ev))
        frames = {}
        for tag, rows in by_tag.items():
            df = pd.DataFrame.from_records(rows, columns=s.fields_of(s.TAGS[tag]))
            df["node"] = node
            frames[tag] = df
        hdr = header or s.LogHeader(schema_version=s.SCHEMA_VERSION)
        return logs.Logs(headers={node: hdr}, frames=frames)
