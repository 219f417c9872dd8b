"""Per-head attention locality from ShadowLocality events, shaped for layers x heads heatmaps.

Event definitions (kvdiag.kernels.attention): for a decode query over T positions,
``recent_mass`` = attention on the last ceil(0.2 T) positions, ``sink_mass`` = on the first
min(4, T - recent) positions, ``other_mass`` = the rest, ``entropy_nats`` = -sum p log p,
``outside_share`` = the head's share of its layer's attention outside the recent window,
``distance_hist`` = attention mass per distance bin (edges 0, 1, 2, 4, ..., 8192, open end).
Every function averages over sampled steps (each event = one step, layer, query head).
Layers and heads are 0-based as in the events.
"""

from __future__ import annotations

import pandas as pd

from kvdiag.events.schema import DISTANCE_EDGES

METRICS = ["recent_mass", "sink_mass", "other_mass", "entropy_nats", "outside_share"]
HEAD_COLUMNS = ["layer", "head", "samples", "seq_len_tokens"] + METRICS


def by_head(events: pd.DataFrame) -> pd.DataFrame:
    """Mean of each metric per (layer, head); ``samples`` = events averaged,
    ``seq_len_tokens`` = their mean sequence length."""
    if events is None or events.empty:
        return pd.DataFrame(columns=HEAD_COLUMNS)
    g = events.groupby(["layer", "head"])
    out = g[METRICS].mean()
    out.insert(0, "samples", g.size())
    out.insert(1, "seq_len_tokens", g["seq_len_tokens"].mean())
    return out.reset_index()[HEAD_COLUMNS]


def heatmap(events: pd.DataFrame, metric: str = "recent_mass") -> pd.DataFrame:
    """layers (index) x heads (columns) of the mean ``metric``."""
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r}: expected one of {', '.join(METRICS)}")
    heads = by_head(events)
    if heads.empty:
        return pd.DataFrame()
    return heads.pivot(index="layer", columns="head", values=metric)


def top_heads(events: pd.DataFrame, k: int = 3) -> pd.DataFrame:
    """Per layer: the ``k`` heads with the largest mean ``outside_share`` and their summed share
    (``top_share``: fraction of the layer's non-recent attention that those heads account for),
    next to the layer's mean recent mass."""
    cols = ["layer", "top_heads", "top_share", "recent_mass", "heads"]
    heads = by_head(events)
    if heads.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for layer, sub in heads.groupby("layer"):
        best = sub.nlargest(k, "outside_share")
        rows.append({"layer": int(layer), "top_heads": [int(h) for h in best["head"]],
                     "top_share": float(best["outside_share"].sum()),
                     "recent_mass": float(sub["recent_mass"].mean()), "heads": len(sub)})
    return pd.DataFrame(rows, columns=cols)


def distance_profile(events: pd.DataFrame) -> pd.DataFrame:
    """Per layer, mean attention mass per distance bin; columns labelled ``"[lo,hi)"`` tokens."""
    labels = [f"[{lo},{hi})" for lo, hi in zip(DISTANCE_EDGES, DISTANCE_EDGES[1:])] + [f"[{DISTANCE_EDGES[-1]},inf)"]
    if events is None or events.empty:
        return pd.DataFrame(columns=["layer"] + labels)
    hist = pd.DataFrame(events["distance_hist"].tolist(), columns=labels[: len(events["distance_hist"].iloc[0])])
    hist.insert(0, "layer", events["layer"].to_numpy())
    return hist.groupby("layer").mean().reset_index()


def summary(events: pd.DataFrame, recent_threshold: float = 0.8) -> dict[str, float]:
    """Whole-model figures: mean recent, sink and other mass over all heads and steps, and the
    fraction of (layer, head) pairs whose mean recent mass is >= ``recent_threshold``."""
    heads = by_head(events)
    if heads.empty:
        return {}
    return {"recent_mass": float(heads["recent_mass"].mean()), "sink_mass": float(heads["sink_mass"].mean()),
            "other_mass": float(heads["other_mass"].mean()),
            "heads_recent_ge_threshold": float((heads["recent_mass"] >= recent_threshold).mean()),
            "recent_threshold": recent_threshold}
