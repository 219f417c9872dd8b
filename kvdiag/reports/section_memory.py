"""The report's memory sections: memory over time and where it goes, the forecast of blocks
still needed, and block occupancy and fragmentation (KV pool and allocator)."""

from __future__ import annotations

from typing import Optional

import pandas as pd

from kvdiag.diagnosis.pressure_rules import forecast_frame
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.frames import Logs
from kvdiag.diagnosis.memory import allocator_fragmentation, breakdown, memory_over_time, pool_occupancy
from kvdiag.reports.document import Absent, Chart, Section, Table, Text
from kvdiag.reports.shaping import MIB, secs, thin


def memory(logs: Logs, t0: int) -> Section:
    sec = Section("memory", "Memory over time",
                  "Why does memory keep growing, or why did we OOM: leak, fragmentation or demand?")
    mot = memory_over_time(logs)
    if mot.empty:
        sec.blocks.append(Absent("memory samples (NVML, torch allocator, KV pool, process RSS)",
                                 "record with `kvdiag demo` or `kvdiag attach PID`"))
        return sec
    multi = len(logs.nodes) > 1
    mot = mot.assign(series=(mot["node"] + ": " if multi else "") + mot["source"],
                     time_s=secs(mot["ts_ns"], t0), MiB=mot["bytes"] / MIB)
    summary_tbl = mot.groupby(["node", "source"], sort=False)["MiB"].agg(
        first="first", last="last", peak="max").round(1).reset_index()
    sec.blocks.append(Chart("Memory by source", "line", thin(mot, "series", "MiB"), "time_s", "MiB",
                            color="series", x_title="time (s)", y_title="MiB", table=summary_tbl))
    if not logs.has("nvml_sample"):
        sec.blocks.append(Absent("NVML (GPU) memory", "no GPU or no NVML where the log was recorded"))
    if not logs.has("allocator_sample"):
        sec.blocks.append(Absent("torch CUDA allocator statistics", "no CUDA device in the target"))
    for node in logs.nodes:
        bd = breakdown(logs, node)
        if bd.empty:
            continue
        bd = bd.assign(MiB=(bd["bytes"] / MIB).round(1))
        sec.blocks.append(Chart(f"Where memory goes ({node}, last sample)", "waterfall", bd,
                                "component", "MiB", y_title="MiB", options={"measure": "measure"},
                                table=bd[["component", "MiB", "measure"]]))
    return sec


def forecast(logs: Logs, t0: int) -> Optional[Chart]:
    fc = forecast_frame(logs)
    if fc.empty:
        return None
    long = fc.melt(id_vars=["ts_ns", "node"], value_vars=["needed_blocks", "free_blocks"],
                   var_name="blocks", value_name="count")
    long = long.assign(time_s=secs(long["ts_ns"], t0),
                       series=(long["node"] + ": " if len(logs.nodes) > 1 else "") + long["blocks"])
    return Chart("Forecast: blocks the active requests still need vs free blocks", "line",
                 thin(long, "series", "count"), "time_s", "count", color="series", x_title="time (s)",
                 y_title="blocks", table=fc[["needed_blocks", "free_blocks", "need_ratio"]].describe().round(2).reset_index())


def fragmentation(logs: Logs, t0: int, findings: list[Finding]) -> Section:
    sec = Section("fragmentation", "Block occupancy and fragmentation",
                  "How full are the KV blocks really (tokens, not just blocks)?")
    occ = pool_occupancy(logs)
    if occ.empty:
        sec.blocks.append(Absent("KV pool samples (KVPoolSample)", "the engine adapter emits them"))
    else:
        long = occ.melt(id_vars=["ts_ns", "node"],
                        value_vars=["block_occupancy", "token_occupancy", "fragmentation"],
                        var_name="measure", value_name="value").dropna(subset=["value"])
        long = long.assign(pct=long["value"] * 100, time_s=secs(long["ts_ns"], t0),
                           series=(long["node"] + ": " if len(logs.nodes) > 1 else "") + long["measure"])
        tbl = long.groupby(["node", "measure"])["pct"].agg(mean="mean", max="max").round(1).reset_index()
        sec.blocks.append(Chart("KV pool occupancy (%)", "line", thin(long, "series", "pct"), "time_s", "pct",
                                color="series", x_title="time (s)", y_title="%", table=tbl))
        sec.blocks.append(Text("block occupancy = blocks held by requests / pool blocks; token "
                               "occupancy = tokens held / (blocks held x block size); "
                               "fragmentation = 1 - token occupancy."))
    al = allocator_fragmentation(logs)
    if al.empty:
        sec.blocks.append(Absent("allocator fragmentation (torch CUDA allocator samples)",
                                 "no CUDA device in the target"))
    else:
        al = al.assign(pct=al["fragmentation"] * 100, time_s=secs(al["ts_ns"], t0),
                       series=al["node"] + " gpu" + al["device"].astype(str))
        sec.blocks.append(Chart("Allocator: reserved but not allocated (%)", "line", thin(al, "series", "pct"),
                                "time_s", "pct", color="series", x_title="time (s)", y_title="%",
                                table=al.groupby("series")["pct"].agg(mean="mean", max="max").round(1).reset_index()))
    frag = [f for f in findings if f.rule.startswith("fragmentation") or f.rule == "leak.fragmentation"]
    if frag:
        sec.blocks.append(Table("Fragmentation rules", pd.DataFrame(
            [{"status": f.status.upper(), "rule": f.rule, "measured": f.message} for f in frag])))
    return sec
