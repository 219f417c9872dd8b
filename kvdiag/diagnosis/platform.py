"""The hardware comparison of several runs: one row per log (node), the article's §4.2 table
from the user's own runs.

- ``device``: the device the recorder probed (``MemoryBandwidthProbe.device_name``: a GPU's
  name, else the CPU model), else the header's ``extra["device"]``.
- ``tokens_per_s``: output tokens of finished requests / seconds from the first request's
  arrival to the last request's finish.
- ``tokens_per_joule``: output tokens of the requests that finished between the first and the
  last energy reading / the energy between them: NVML's total energy counter summed over the
  node's GPUs (``NvmlSample.energy_mj``), else RAPL's counters summed over the host's zones
  (``HostEnergySample.energy_uj``, a wrap between two readings counted once). N/A with the
  reason (the collectors' status) when the log has neither.
- ``kv_bytes_per_token``: KV bytes of one token over all layers (header or pool).
- ``peak_kv_bandwidth_utilisation``: the highest per-step KV bandwidth utilisation
  (:mod:`kvdiag.diagnosis.bandwidth`); N/A without a bandwidth probe in the log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis import bandwidth
from kvdiag.diagnosis.frames import Logs
from kvdiag.events.schema import (CollectorStatus, HostEnergySample, MemoryBandwidthProbe, NvmlSample,
                           RequestArrived, RequestFinished)

NA = "N/A"

REFERENCE_ROWS = (
    {"node": "article: A100", "device": "NVIDIA A100", "tokens_per_s": 12_500.0, "tokens_per_joule": 58.0},
    {"node": "article: H100", "device": "NVIDIA H100", "tokens_per_s": 18_700.0, "tokens_per_joule": 82.0},
)
"""The article's §4.2 figures (as quoted in kvdiag's issue 19), shown beside the user's rows
for scale; its model and workload are not the user's (docs/bandwidth.md)."""


@dataclass
class Energy:
    """Energy between two readings: ``joules``, over [start_ns, end_ns], from ``source``;
    ``joules`` None and ``reason`` set when it cannot be known."""

    joules: Optional[float]
    start_ns: int = 0
    end_ns: int = 0
    source: str = ""
    reason: str = ""


def _counter_delta(values: np.ndarray, wrap: Optional[float]) -> float:
    """Increase of a counter over its readings; a decrease is a wrap at ``wrap`` (else a reset:
    the increase after it counts from 0)."""
    d = np.diff(values.astype("float64"))
    if wrap:
        d = np.where(d < 0, d + wrap, d)
    else:
        d = np.where(d < 0, values[1:], d)
    return float(d.sum())


def energy(logs: Logs, node: str) -> Energy:
    """Energy used on ``node`` over its energy readings (module docstring)."""
    nv = logs.frame(NvmlSample)
    nv = nv[(nv["node"] == node)]
    nv = nv[pd.to_numeric(nv["energy_mj"], errors="coerce").notna()] if len(nv) else nv
    groups = [(g["ts_ns"].to_numpy(), pd.to_numeric(g["energy_mj"]).to_numpy() / 1e3, None)
              for _, g in nv.groupby("device") if len(g) >= 2]
    source = "NVML energy counter"
    if not groups:
        he = logs.frame(HostEnergySample)
        he = he[he["node"] == node]
        groups = [(g["ts_ns"].to_numpy(), g["energy_uj"].to_numpy(dtype="float64") / 1e6,
                   None if pd.isna(g["max_energy_uj"].iloc[-1]) else float(g["max_energy_uj"].iloc[-1]) / 1e6)
                  for _, g in he.groupby("domain") if len(g) >= 2]
        source = "RAPL"
    if not groups:
        return Energy(None, reason=_why_no_energy(logs, node))
    joules = sum(_counter_delta(v, wrap) for _, v, wrap in groups)
    return Energy(joules, int(max(t[0] for t, _, _ in groups)), int(min(t[-1] for t, _, _ in groups)), source)


def _why_no_energy(logs: Logs, node: str) -> str:
    st = logs.frame(CollectorStatus)
    st = st[(st["node"] == node) & st["collector"].isin(["nvml", "rapl"]) & ~st["available"].astype(bool)]
    hints = st.drop_duplicates("collector", keep="last")
    if len(hints):
        return "; ".join(f"{r.collector}: {r.hint}" for r in hints.itertuples())
    return "no energy readings in the log (neither NVML's energy counter nor RAPL was recorded)"


def device_of(logs: Logs, node: str) -> str:
    pr = logs.frame(MemoryBandwidthProbe)
    pr = pr[pr["node"] == node]
    if len(pr) and pr["device_name"].iloc[-1]:
        return str(pr["device_name"].iloc[-1])
    return str(logs.headers[node].extra.get("device", "")) or "not recorded"


def platform_rows(logs: Logs, label: str = "") -> list[dict]:
    """One row per node of ``logs`` (``label`` appended to the node's name)."""
    fin, arr = logs.frame(RequestFinished), logs.frame(RequestArrived)
    kv = bandwidth.kv_read_frame(logs)
    rows = []
    for node in logs.nodes:
        f = fin[(fin["node"] == node) & (fin["status"] == "finished")]
        a = arr[arr["node"] == node]
        start = a["ts_ns"].min() if len(a) else (f["ts_ns"] - f["e2e_ns"].fillna(0)).min() if len(f) else None
        span_s = (f["ts_ns"].max() - start) / 1e9 if len(f) and start is not None else 0.0
        tokens = float(f["output_tokens"].sum())
        e = energy(logs, node)
        if e.joules:
            inside = f[(f["ts_ns"] >= e.start_ns) & (f["ts_ns"] <= e.end_ns)]
            tpj: object = float(inside["output_tokens"].sum()) / e.joules
        else:
            tpj = NA
        util = kv["utilisation"][kv["node"] == node].dropna()
        rows.append({
            "node": f"{node}{label}", "host": logs.headers[node].host, "device": device_of(logs, node),
            "tokens_per_s": tokens / span_s if span_s > 0 else NA,
            "tokens_per_joule": tpj,
            "energy_source": e.source if e.joules else f"N/A: {e.reason}",
            "kv_bytes_per_token": logs.bytes_per_token(node) or NA,
            "peak_kv_bandwidth_utilisation": float(util.max()) if len(util) else NA})
    return rows


def platform_table(logs: Logs, baseline: Optional[Logs] = None, reference: bool = True) -> pd.DataFrame:
    """The comparison table: each node of ``logs``, then of ``baseline``, then (``reference``)
    the article's rows."""
    rows = platform_rows(logs) + (platform_rows(baseline, " (baseline)") if baseline is not None else [])
    if reference:
        rows += [{**r, "host": "", "energy_source": "the article, §4.2", "kv_bytes_per_token": NA,
                  "peak_kv_bandwidth_utilisation": NA} for r in REFERENCE_ROWS]
    return pd.DataFrame(rows)
