"""Write bandwidth of KV blocks written out of the pool, per layer group, from ShadowDelta events.

Each event is one layer of one written block (kvdiag.kernels.delta). Savings are fractions of
the bytes written in full: ``dedup_saving`` = 1 - sum(dedup_bytes) / sum(full_bytes) (exact
duplicates stored once: lossless); ``delta_saving`` = 1 - sum(delta_bytes) / sum(full_bytes)
(quantized delta against the most similar stored block, within ``error_bound``);
``quant_saving`` = the same encoder against the zero block (what quantization alone at that
bound saves, to separate it from what the reference adds). On rewritten blocks only
(``rewrites`` = their events): ``prev_saving`` = 1 - sum(prev_bytes) / sum(full_bytes) (delta
against the block's previous version) next to ``delta_saving_rewrites`` (the best stored block)
on the same events. ``delta_vs_quant_referenced`` = 1 - sum(delta_bytes) / sum(quant_bytes)
over the events whose delta used a stored block (reference previous or other): what the
reference saves beyond quantizing the block alone, where one was found. Errors are means over events (``attn_out_rel_error_p95`` the 95th
percentile); ``encode_us`` / ``decode_us`` are means per written block and layer. Groups are
1-based as in :mod:`kvdiag.diagnosis.compression`; the last row, ``all``, covers every layer.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis.compression import ARTICLE_GROUPS, _group_of, parse_groups

TABLE_COLUMNS = ["group", "writes", "full_mib", "dedup_saving", "delta_saving", "quant_saving",
                 "delta_vs_quant_referenced", "rewrites", "prev_saving", "delta_saving_rewrites", "ref_duplicate", "ref_previous",
                 "ref_other", "ref_zero", "ref_full", "k_rel_error", "v_rel_error", "attn_out_rel_error",
                 "attn_out_rel_error_p95", "encode_us", "decode_us"]
REFERENCES = ("duplicate", "previous", "other", "zero", "full")


def _row(label: str, df: pd.DataFrame) -> dict:
    full = float(df["full_bytes"].sum())
    rw = df[df["rewrite"].astype(bool)]
    rw_full = float(rw["full_bytes"].sum())
    attn = pd.to_numeric(df["attn_out_rel_error"], errors="coerce")
    ref = df[df["reference"].isin(["previous", "other"])]
    row = {
        "group": label, "writes": len(df), "full_mib": full / 2**20,
        "dedup_saving": 1 - df["dedup_bytes"].sum() / full if full else np.nan,
        "delta_saving": 1 - df["delta_bytes"].sum() / full if full else np.nan,
        "quant_saving": 1 - df["quant_bytes"].sum() / full if full else np.nan,
        "delta_vs_quant_referenced": (1 - ref["delta_bytes"].sum() / ref["quant_bytes"].sum())
        if len(ref) else np.nan,
        "rewrites": len(rw),
        "prev_saving": (1 - pd.to_numeric(rw["prev_bytes"]).sum() / rw_full) if rw_full else np.nan,
        "delta_saving_rewrites": (1 - rw["delta_bytes"].sum() / rw_full) if rw_full else np.nan,
        "k_rel_error": df["k_rel_error"].mean(), "v_rel_error": df["v_rel_error"].mean(),
        "attn_out_rel_error": attn.mean(), "attn_out_rel_error_p95": attn.quantile(0.95),
        "encode_us": pd.to_numeric(df["encode_ns"], errors="coerce").mean() / 1e3,
        "decode_us": pd.to_numeric(df["decode_ns"], errors="coerce").mean() / 1e3,
    }
    counts = df["reference"].value_counts(normalize=True)
    for ref in REFERENCES:
        row[f"ref_{ref}"] = float(counts.get(ref, 0.0))
    return row


def delta_table(events: Optional[pd.DataFrame], groups: str = ARTICLE_GROUPS) -> pd.DataFrame:
    """One row per layer group and one for all layers (module docstring); ``events``: the
    ``shadow_delta`` frame of a log."""
    if events is None or events.empty:
        return pd.DataFrame(columns=TABLE_COLUMNS)
    spec = parse_groups(groups)
    df = events.copy()
    df["group"] = [_group_of(int(x), spec) for x in df["layer"]]
    rows = [_row(label, df[df["group"] == label]) for label, _, _ in spec if (df["group"] == label).any()]
    rows.append(_row("all", df))
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def by_layer(events: Optional[pd.DataFrame]) -> pd.DataFrame:
    """Per layer (0-based): dedup, delta and quantization-only savings and the mean attention
    output error, for the curve in the report."""
    cols = ["layer", "dedup_saving", "delta_saving", "quant_saving", "attn_out_rel_error"]
    if events is None or events.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for layer, sub in events.groupby("layer"):
        r = _row(str(layer), sub)
        rows.append({"layer": int(layer), **{c: r[c] for c in cols[1:]}})
    return pd.DataFrame(rows, columns=cols)
