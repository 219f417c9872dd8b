"""Build a report from merged logs: one section per question users ask, in the order the
report shows them (the summary first, then memory, fragmentation, sharing, the shadow
measurements, latency, requests and collector health; the platforms when they differ).

Each section family has its module (``section_*``); they call analyses and shape their frames
for display (:mod:`kvdiag.reports.shaping`); nothing here plots.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd

from kvdiag.diagnosis import latency
from kvdiag.diagnosis.doctor import run_rules
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.frames import Logs
from kvdiag.diagnosis.requests import request_table
from kvdiag.reports.document import Report
from kvdiag.reports.hardware import kv_bandwidth_blocks, platform_section
from kvdiag.reports.section_health import health
from kvdiag.reports.section_latency import latency_section
from kvdiag.reports.section_memory import forecast, fragmentation, memory
from kvdiag.reports.section_requests import requests
from kvdiag.reports.section_shadow import compression, differential, locality
from kvdiag.reports.section_sharing import sharing, with_curves
from kvdiag.reports.section_summary import summary
from kvdiag.reports.shaping import fmt_ns, thin


def build(logs: Logs, baseline: Optional[Logs] = None, problems: Optional[list[str]] = None,
          title: str = "kvdiag report", fleet: Optional[pd.DataFrame] = None
          ) -> tuple[Report, list[Finding]]:
    """The whole report, and the findings behind its summary; ``fleet``: the per-node table
    of ``diagnosis.fleet`` when the input holds Parquet datasets."""
    problems = problems or []
    findings, comps = run_rules(logs, baseline)
    t0 = logs.time_range_ns()[0]
    lat = latency.request_latency(logs)
    req = request_table(logs, lat)
    mem = memory(logs, t0)
    fc = forecast(logs, t0)
    if fc is not None:
        mem.blocks.append(fc)
    t_lo, t_hi = logs.time_range_ns()
    sub = (f"{len(logs.nodes)} node(s): {', '.join(logs.nodes)}; {logs.num_events():,} events from "
           f"{fmt_ns(t_lo)} to {fmt_ns(t_hi)}"
           + (f"; baseline: {', '.join(baseline.paths.values())}" if baseline is not None else ""))
    lat_sec = latency_section(logs, t0, lat, comps, baseline)
    lat_sec.blocks += kv_bandwidth_blocks(logs, t0, thin)  # beside P99: the checklist's bandwidth item
    sections = [summary(logs, findings, problems, lat, fleet), mem, fragmentation(logs, t0, findings),
                with_curves(sharing(logs, t0, req), logs), compression(logs), differential(logs),
                locality(logs), lat_sec, requests(req), health(logs, problems)]
    platforms = platform_section(logs, baseline)
    if platforms is not None:
        sections.insert(1, platforms)
    return Report(title, sub, sections), findings
