"""Report blocks for memory bandwidth and hardware: the demanded KV bandwidth over time (shown
next to P99) and the platform comparison of several logs (:mod:`kvdiag.diagnosis.platform`)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis import bandwidth
from kvdiag.diagnosis.frames import Logs
from kvdiag.diagnosis.platform import NA, platform_table
from kvdiag.reports.document import Absent, Block, Chart, Section, Table, Text
from kvdiag.events.schema import NvmlSample


def kv_bandwidth_blocks(logs: Logs, t0: int, thin) -> list[Block]:
    """Per engine step: utilisation of the measured copy bandwidth (%), or the demanded KV
    read bandwidth (GB/s) where the log has no probe; NVML's memory-controller utilisation
    beside it. ``thin(df, by, y)``: the report's point thinning."""
    fr = bandwidth.kv_read_frame(logs)
    fr = fr[fr["duration_ns"] > 0]
    if fr.empty:
        return [Absent("KV bandwidth (engine steps with KV block events or pool samples)")]
    multi = len(logs.nodes) > 1
    has_peak = fr["utilisation"].notna().any()
    if has_peak:
        y, unit, value = "pct", "% of measured copy bandwidth", fr["utilisation"] * 100
    else:
        y, unit, value = "GB_per_s", "GB/s demanded", fr["kv_read_bytes_per_s"] / 1e9
    series = (fr["node"] + ": " if multi else pd.Series("", index=fr.index)) + f"KV read ({unit})"
    data = pd.DataFrame({"time_s": (fr["ts_ns"].to_numpy(dtype="float64") - t0) / 1e9, y: value.to_numpy(),
                         "series": series.to_numpy()})
    nv = logs.frame(NvmlSample)
    if has_peak and "memory_util_pct" in nv and pd.to_numeric(nv["memory_util_pct"], errors="coerce").notna().any():
        nv = nv[pd.to_numeric(nv["memory_util_pct"], errors="coerce").notna()]
        data = pd.concat([data, pd.DataFrame({
            "time_s": (nv["ts_ns"].to_numpy(dtype="float64") - t0) / 1e9,
            y: nv["memory_util_pct"].astype("float64").to_numpy(),
            "series": ((nv["node"] + ": " if multi else "") + "NVML memory controller gpu"
                       + nv["device"].astype(str)).to_numpy()})], ignore_index=True)
    rows = []
    for node in logs.nodes:
        sm = bandwidth.summarize(logs, fr[fr["node"] == node])
        if sm.steps:
            rows.append({"node": node, "steps": sm.steps, "demanded_GB_per_s": round(sm.kv_read_bytes_per_s / 1e9, 3),
                         "peak_copy_GB_per_s": round(sm.peak_copy_bytes_per_s / 1e9, 1) if np.isfinite(sm.peak_copy_bytes_per_s) else NA,
                         "utilisation_pct": round(sm.utilisation * 100, 1) if np.isfinite(sm.utilisation) else NA,
                         "highest_step_pct": round(sm.peak_step_utilisation * 100, 1) if np.isfinite(sm.peak_step_utilisation) else NA})
    blocks: list[Block] = [
        Chart(f"KV bandwidth per engine step ({unit})", "line", thin(data, "series", y), "time_s", y,
              color="series", x_title="time (s)", y_title=unit, table=pd.DataFrame(rows)),
        Text("Demanded KV read bandwidth = KV blocks held by live requests at the step's start x block "
             "bytes / step duration (what decode attention reads once per step); utilisation divides it by "
             "the copy bandwidth measured on the recording machine (bytes read + written per second)."
             + ("" if has_peak else " This log holds no bandwidth probe: utilisation is N/A."))]
    return blocks


def platform_section(logs: Logs, baseline: Optional[Logs]) -> Optional[Section]:
    """The hardware comparison, when there is more than one run to compare (several logs,
    or a baseline)."""
    if len(logs.nodes) < 2 and baseline is None:
        return None
    tbl = platform_table(logs, baseline)
    for col in ("tokens_per_s", "tokens_per_joule", "peak_kv_bandwidth_utilisation"):
        tbl[col] = tbl[col].map(lambda v: round(v, 3) if isinstance(v, float) else v)
    return Section("platforms", "Hardware comparison",
                   "How do these machines compare: throughput, energy, KV bandwidth?",
                   [Table("Platforms (one row per log; the article's rows for scale)", tbl,
                          note="tokens/s: output tokens of finished requests / first arrival to last "
                               "finish; tokens per joule: NVML energy counter on GPUs, else RAPL, else "
                               "N/A with the reason; the article's rows are another model and workload "
                               "(docs/bandwidth.md)")])
