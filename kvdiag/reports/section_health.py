"""The report's collector health section: what was not observed (collectors' status, gaps,
errors, unreadable lines)."""

from __future__ import annotations

import pandas as pd

from kvdiag.diagnosis.frames import Logs
from kvdiag.events.schema import CollectorError, CollectorGap, CollectorStatus
from kvdiag.reports.document import Section, Table, Text


def health(logs: Logs, problems: list[str]) -> Section:
    sec = Section("health", "Collector health", "Can these numbers be trusted: what was not observed?")
    st = logs.frame(CollectorStatus)
    if len(st):
        sec.blocks.append(Table("Collectors", st[["node", "collector", "available", "hint"]]
                                .drop_duplicates(["node", "collector"], keep="last")))
    gaps = logs.frame(CollectorGap)
    if len(gaps):
        g = gaps.assign(gap_s=(gaps["end_ns"] - gaps["start_ns"]) / 1e9).groupby(["node", "collector"]).agg(
            gaps=("gap_s", "size"), seconds=("gap_s", "sum"), dropped_events=("dropped_events", "sum"))
        sec.blocks.append(Table("Gaps (events dropped)", g.round(2).reset_index()))
    errs = logs.frame(CollectorError)
    if len(errs):
        e = errs.groupby(["node", "collector", "message"]).agg(count=("count", "sum")).reset_index()
        sec.blocks.append(Table("Errors caught in collectors and shadow tasks", e))
    if problems:
        sec.blocks.append(Table("Unreadable log lines (skipped)", pd.DataFrame({"problem": problems[:20]}),
                                note=f"{len(problems)} in all"))
    if not (len(st) or len(gaps) or len(errs) or problems):
        sec.blocks.append(Text("No collector reported its status, a gap or an error; every log line was read."))
    return sec
