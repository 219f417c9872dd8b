"""KV bandwidth: the KV bytes attention must read per second, against the machine's peak.

Per engine step (``EngineStep``, ``ts_ns`` = the start of its forward pass):

- ``blocks_held``: KV blocks held by requests when the step starts: the pool ledger's
  ``holdings`` (:class:`kvdiag.pool.blockledger.BlockLedger`, the state ``kvdiag top`` and the
  exporter read) after every block event with ``ts_ns`` <= the step's, as the block facts
  (:mod:`kvdiag.pool.blockfacts`) record it, live in top as offline here. A block shared by two
  requests counts twice: each request's attention reads it; a bad release (double, or of a
  block the request does not hold) changes nothing. Without block events, the last
  ``KVPoolSample.blocks_used`` at or before the step.
- ``kv_read_bytes`` = blocks_held x block bytes (the pool's ``block_bytes``; all layers, K
  and V): what decode attention reads once per step.
- ``kv_read_bytes_per_s`` = kv_read_bytes / the step's duration (the demanded bandwidth).
- ``utilisation`` = kv_read_bytes_per_s / the peak measured on the recording machine
  (``MemoryBandwidthProbe.copy_bandwidth_bytes_per_s``, STREAM Copy convention); NaN when
  the log holds no probe.

Over a window the demanded bandwidth is time-weighted: sum of kv_read_bytes / sum of step
durations. NVML's memory-controller utilisation (``NvmlSample.memory_util_pct``), where
recorded, is the GPU's own measure of the same pressure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis import block_facts
from kvdiag.diagnosis.frames import Logs
from kvdiag.pool.blockfacts import FACTS_TAG
from kvdiag.events.schema import EngineStep, KVPoolSample, MemoryBandwidthProbe, NvmlSample

COLUMNS = ["ts_ns", "node", "step_id", "batch_size", "duration_ns", "blocks_held", "block_bytes",
           "kv_read_bytes", "kv_read_bytes_per_s", "peak_copy_bytes_per_s", "utilisation"]

def peak_copy_bandwidth(logs: Logs, node: str) -> Optional[float]:
    """The copy bandwidth measured where ``node``'s log was recorded (its last probe), bytes
    read + written per second; None without a probe."""
    pr = logs.frame(MemoryBandwidthProbe)
    pr = pr[pr["node"] == node]
    return float(pr["copy_bandwidth_bytes_per_s"].iloc[-1]) if len(pr) else None


def _held_at(logs: Logs, node: str, t: np.ndarray) -> Optional[np.ndarray]:
    """Blocks held by requests at each time of ``t`` (a step's start): the block facts'
    ``blocks_held`` (:mod:`kvdiag.pool.blockfacts`, the ledger after the events at or before it);
    without block events, the last pool sample's ``blocks_used``; None without either."""
    facts = block_facts.frame(logs, FACTS_TAG)
    facts = facts[(facts["node"] == node) & (facts["kind"] == "step")]
    held = pd.to_numeric(facts["blocks_held"], errors="coerce")
    if held.notna().any():
        order = np.argsort(facts["ts_ns"].to_numpy(dtype="int64"), kind="stable")
        ft = facts["ts_ns"].to_numpy(dtype="int64")[order]
        fh = held.fillna(0.0).to_numpy(dtype="float64")[order]
        idx = np.searchsorted(ft, t, side="right") - 1
        return np.where(idx >= 0, fh[np.maximum(idx, 0)], 0.0)
    source = logs.whole if logs.whole is not None else logs
    kp = source.frame(KVPoolSample)
    kp = kp[kp["node"] == node]
    if kp.empty:
        return None
    kt = kp["ts_ns"].to_numpy(dtype="int64")
    used = kp["blocks_used"].to_numpy(dtype="float64")
    idx = np.searchsorted(kt, t, side="right") - 1
    return np.where(idx >= 0, used[np.maximum(idx, 0)], 0.0)


def kv_read_frame(logs: Logs) -> pd.DataFrame:
    """One row per engine step with its demanded KV read bandwidth (module docstring); a
    window of logs reads the blocks held from the logs it was cut from."""
    source = logs.whole if logs.whole is not None else logs
    steps = logs.frame(EngineStep)
    out = []
    for node in logs.nodes:
        st = steps[steps["node"] == node]
        block_bytes = source.block_bytes(node)
        if st.empty or not block_bytes:
            continue
        t = st["ts_ns"].to_numpy(dtype="int64")
        held = _held_at(logs, node, t)
        if held is None:
            continue
        dur = st["duration_ns"].to_numpy(dtype="float64")
        read = held * block_bytes
        with np.errstate(divide="ignore", invalid="ignore"):
            per_s = np.where(dur > 0, read / (dur / 1e9), np.nan)
        peak = peak_copy_bandwidth(source, node)
        out.append(pd.DataFrame({
            "ts_ns": t, "node": node, "step_id": st["step_id"].to_numpy(),
            "batch_size": st["batch_size"].to_numpy(), "duration_ns": dur, "blocks_held": held,
            "block_bytes": float(block_bytes), "kv_read_bytes": read, "kv_read_bytes_per_s": per_s,
            "peak_copy_bytes_per_s": np.nan if peak is None else peak,
            "utilisation": per_s / peak if peak else np.nan}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=COLUMNS)


@dataclass
class BandwidthSummary:
    """Demanded KV bandwidth over a window: ``kv_read_bytes_per_s`` = sum of KV bytes read /
    sum of step durations; ``utilisation`` the same over the peak (NaN without a probe);
    ``peak_step_utilisation`` the highest of a single step; ``nvml_memory_util_pct`` the mean
    memory-controller utilisation NVML reported (NaN without it)."""

    steps: int
    kv_read_bytes: float
    busy_s: float
    kv_read_bytes_per_s: float
    peak_copy_bytes_per_s: float
    utilisation: float
    peak_step_utilisation: float
    nvml_memory_util_pct: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def summarize(logs: Logs, frame: Optional[pd.DataFrame] = None) -> BandwidthSummary:
    """:class:`BandwidthSummary` of ``logs`` (``frame``: its :func:`kv_read_frame`, if at hand)."""
    fr = kv_read_frame(logs) if frame is None else frame
    fr = fr[fr["duration_ns"] > 0]
    busy_s = float(fr["duration_ns"].sum()) / 1e9
    read = float(fr["kv_read_bytes"].sum())
    rate = read / busy_s if busy_s > 0 else float("nan")
    peaks = fr["peak_copy_bytes_per_s"].dropna()
    peak = float(peaks.max()) if len(peaks) else float("nan")
    util = fr["utilisation"].dropna()
    nv = logs.frame(NvmlSample)
    mem = pd.to_numeric(nv["memory_util_pct"], errors="coerce").dropna() if "memory_util_pct" in nv else []
    return BandwidthSummary(
        steps=len(fr), kv_read_bytes=read, busy_s=busy_s, kv_read_bytes_per_s=rate,
        peak_copy_bytes_per_s=peak, utilisation=rate / peak if np.isfinite(peak) and peak > 0 else float("nan"),
        peak_step_utilisation=float(util.max()) if len(util) else float("nan"),
        nvml_memory_util_pct=float(np.mean(mem)) if len(mem) else float("nan"))


def describe(sm: BandwidthSummary) -> str:
    """One line: demanded GB/s, and utilisation of the measured peak where there is one."""
    if not sm.steps:
        return "no engine steps with KV blocks"
    text = f"{sm.kv_read_bytes_per_s / 1e9:.2f} GB/s of KV read demanded over {sm.steps} steps"
    if np.isfinite(sm.utilisation):
        text += (f", {sm.utilisation:.1%} of the measured {sm.peak_copy_bytes_per_s / 1e9:.1f} GB/s "
                 f"copy bandwidth (highest step {sm.peak_step_utilisation:.1%})")
    else:
        text += " (no bandwidth probe in the log: utilisation N/A)"
    if np.isfinite(sm.nvml_memory_util_pct):
        text += f"; NVML memory-controller utilisation {sm.nvml_memory_util_pct:.0f}%"
    return text
