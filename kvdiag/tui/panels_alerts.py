"""The alerts panel of ``kvdiag top``: the doctor's rules over the events seen, failing first."""

from __future__ import annotations


from rich.text import Text

from kvdiag.live.snapshot import Snapshot
from kvdiag.tui.render import line
from kvdiag.tui.panel_base import BAD, DIM, GOOD, WARN, Panel, join_lines, reason


class AlertsPanel(Panel):
    TITLE = "Alerts"
    VIEW = "alerts"
    MARKS = {"fail": ("✗", BAD), "warn": ("!", WARN), "n/a": ("·", DIM), "pass": ("✓", GOOD)}

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        """Failures and warnings with their messages, then collector health (why data is
        missing), then the rules that had no data folded into one line, then the passes."""
        if not snap.alerts:
            return reason("no findings yet", width)
        no_data = [f for f in snap.alerts if f.status == "n/a" and not f.rule.startswith("collector.")]
        shown = [f for f in snap.alerts if f not in no_data]
        two_lines = sum(1 for f in shown if f.status != "pass") * 2 + bool(no_data) <= height
        rows = []
        for f in shown:
            if f.status == "pass" and no_data:
                rows.append(line(("· ", DIM), (f"{len(no_data)} checks without data: "
                                               + ", ".join(g.rule for g in no_data), DIM)))
                no_data = []
            mark, style = self.MARKS[f.status]
            loud = f.status in ("fail", "warn")
            rows.append(line((mark + " ", style), (f.title, "bold" if loud else "")))
            if two_lines or loud:
                rows.append(line("  ", (f.message, "" if loud else DIM)))
        if no_data:
            rows.append(line(("· ", DIM), (f"{len(no_data)} checks without data: "
                                           + ", ".join(g.rule for g in no_data), DIM)))
        return rows

    def detail(self, snap: Snapshot) -> Text:
        rows = []
        for f in snap.alerts:
            mark, style = self.MARKS[f.status]
            rows.append(line((f"{mark} {f.rule}", style), f"  {f.title}"))
            rows.append(line(f"    {f.message}"))
            if f.evidence:
                rows.append(line((f"    evidence: {f.evidence}", DIM)))
        return join_lines(rows) if rows else Text("no findings yet")
