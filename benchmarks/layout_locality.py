"""Per-layer and per-kv-head attention locality from a log's ShadowLocality events, shaped for
the layout note (docs/layout-3d-memory.md): what a KV placement by head or by layer across
memory channels / tiers would see.

    python benchmarks/layout_locality.py LOG [--group-size 3]

``--group-size``: query heads per kv head (GQA; SmolLM2-135M: 9 query heads, 3 kv heads), so
that query heads are folded onto the kv head whose K/V they read. "hot" = attention mass on
the recent 20% of positions plus the first 4 (sinks): what a fast tier holding only those rows
would serve. Prints figures, computes nothing the analyses do not define.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from kvdiag.diagnosis import locality
from kvdiag.events.eventlog import read_log
from kvdiag.events.schema import DISTANCE_EDGES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--group-size", type=int, default=3)
    args = ap.parse_args()
    ev = read_log(args.log, types=["shadow_locality"]).frame("shadow_locality")
    if ev.empty:
        raise SystemExit(f"{args.log}: no shadow_locality events")
    ev = ev.assign(kv_head=ev["head"] // args.group_size, hot=ev["recent_mass"] + ev["sink_mass"])
    steps = ev["ts_ns"].nunique()
    print(f"{len(ev)} events, {steps} sampled decode steps, sequence length median "
          f"{ev['seq_len_tokens'].median():.0f} (min {ev['seq_len_tokens'].min()}, max {ev['seq_len_tokens'].max()})")
    s = locality.summary(ev)
    print("whole model: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()))

    per_kv = ev.groupby(["layer", "kv_head"])[["hot", "recent_mass", "sink_mass", "other_mass"]].mean()
    per_layer = ev.groupby("layer")[["hot", "recent_mass", "sink_mass", "other_mass", "entropy_nats"]].mean()
    # where the variation lives: between layers, or between the kv heads of a layer
    hot = per_kv["hot"].unstack()
    between_layers = float(hot.mean(axis=1).std(ddof=0))
    within_layers = float(hot.std(axis=1, ddof=0).mean())
    print(f"hot mass per (layer, kv head): mean {hot.values.mean():.3f}, min {hot.values.min():.3f}, "
          f"max {hot.values.max():.3f}; std of layer means {between_layers:.3f}, "
          f"mean std across a layer's kv heads {within_layers:.3f}")
    cold = 1 - hot
    print(f"(layer, kv head) pairs with >= 10% of their attention outside recent+sinks: "
          f"{int((cold >= 0.10).values.sum())} of {cold.size}; >= 25%: {int((cold >= 0.25).values.sum())}")
    groups = {"1-6": (0, 5), "7-12": (6, 11), "13+": (12, 10**6)}
    labels = [f"<{hi}" for hi in DISTANCE_EDGES[1:]]
    hist = pd.DataFrame(ev["distance_hist"].tolist()).to_numpy()
    cum = np.cumsum(hist, axis=1)
    rows = []
    for name, (lo, hi) in groups.items():
        m = (ev["layer"] >= lo) & (ev["layer"] <= hi)
        sub = per_layer.loc[(per_layer.index >= lo) & (per_layer.index <= hi)]
        kv = hot.loc[(hot.index >= lo) & (hot.index <= hi)]
        c = cum[m.to_numpy()].mean(axis=0)
        rows.append({"layers (1-based)": name, "recent": sub["recent_mass"].mean(), "sinks": sub["sink_mass"].mean(),
                     "other": sub["other_mass"].mean(), "hot min kv head": kv.values.min(),
                     "hot max kv head": kv.values.max(),
                     "mass <64": c[labels.index("<64")], "mass <256": c[labels.index("<256")]})
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(pd.DataFrame(rows).round(3).to_string(index=False))
        print("\nper layer (0-based) hot mass by kv head:")
        print(hot.round(3).to_string())
        top = locality.top_heads(ev)
        print("\ntop-3 query heads' share of their layer's non-recent attention, layers 12+ (1-based): "
              f"mean {top[top['layer'] >= 11]['top_share'].mean():.3f}, min {top[top['layer'] >= 11]['top_share'].min():.3f}"
              f", max {top[top['layer'] >= 11]['top_share'].max():.3f} (3 of 9 heads: 0.333 if uniform)")


if __name__ == "__main__":
    main()
