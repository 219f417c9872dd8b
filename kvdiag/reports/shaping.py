"""Shaping frames for display, shared by the report's sections: time in seconds since the first
event, MiB, histograms, and thinning of long series (peaks kept) so charts stay light."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import pandas as pd

MAX_POINTS = 1500  # per series: charts stay light for million-event logs
MIB = 2 ** 20


def secs(ts_ns, t0: int) -> np.ndarray:
    return (np.asarray(ts_ns, dtype="float64") - t0) / 1e9


def thin(df: pd.DataFrame, by: Optional[str], y: str, n: int = MAX_POINTS) -> pd.DataFrame:
    """At most about ``n`` rows per ``by`` group: the group's rows in ``n / 2`` consecutive
    buckets, each bucket kept as its lowest and highest ``y`` (so peaks survive thinning)."""
    groups = [df] if by is None else [g for _, g in df.groupby(by, sort=False)]
    out = []
    for g in groups:
        if len(g) > n:
            g = g.reset_index(drop=True)
            bucket = (np.arange(len(g)) * (n // 2)) // len(g)
            yv = pd.Series(pd.to_numeric(g[y], errors="coerce").to_numpy(), index=g.index)
            keys = yv.groupby(bucket)
            keep = np.unique(np.r_[keys.idxmin().dropna().to_numpy(), keys.idxmax().dropna().to_numpy()]).astype(int)
            g = g.iloc[keep]
        out.append(g)
    return pd.concat(out, ignore_index=True) if out else df


def hist(values: np.ndarray, bins: int = 50) -> tuple[np.ndarray, np.ndarray]:
    v = np.asarray(values, dtype="float64")
    v = v[np.isfinite(v)]
    counts, edges = np.histogram(v, bins=bins)
    return (edges[:-1] + edges[1:]) / 2, counts


def fmt_ns(ns: Optional[int]) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + " UTC" if ns else "?"
