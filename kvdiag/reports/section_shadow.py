"""The report's sections on the shadow measurements: KV compression (error, ratio, decode time,
the recommendation, in vLLM's terms too), differential KV writes and attention locality."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis import compression as _compression  # aliases: sections of the same names
from kvdiag.diagnosis import delta_writes as _delta
from kvdiag.diagnosis import locality as _locality
from kvdiag.diagnosis.frames import Logs
from kvdiag.events.schema import KVPoolInfo, ShadowBudget, ShadowCompression, ShadowDelta, ShadowLocality, ShadowLogits
from kvdiag.reports.document import Absent, Block, Chart, Section, Table, Text
from kvdiag.reports.shaping import MIB


def _vllm_recommendation(logs: Logs, tbl: pd.DataFrame) -> Optional[Block]:
    """The recommendation as vLLM's ``--kv-cache-dtype`` and the capacity it frees on the
    server's own pool (:func:`kvdiag.diagnosis.compression.engine_recommendation`), for the first
    vLLM log; None without one."""
    node = next((n for n, h in logs.headers.items() if h.engine == "vllm"), None)
    if node is None:
        return None
    info = logs.frame(KVPoolInfo)
    rec = _compression.engine_recommendation_on_pool(tbl, "vllm", info[info["node"] == node])
    if rec.empty:
        return None
    rec = rec.assign(kv_MiB=pd.to_numeric(rec["kv_bytes"], errors="coerce") / MIB,
                     frees_MiB=pd.to_numeric(rec["frees_bytes"], errors="coerce") / MIB)
    return Table("In vLLM's terms: one --kv-cache-dtype for every layer, and the pool capacity it frees",
                 rec.drop(columns=["kv_bytes", "frees_bytes"]).round(4))


def compression(logs: Logs) -> Section:
    sec = Section("compression", "KV compression",
                  "Is KV compression safe for our model, layer by layer: what error, ratio, decode latency?")
    sc = logs.frame(ShadowCompression)
    if sc.empty:
        sec.blocks.append(Absent("shadow compression results (ShadowCompression events)",
                                 "record with shadow compression on (`kvdiag demo`)"))
        return sec
    sc = sc.copy()
    n_layers = int(sc["layer"].max()) + 1
    size = max(1, math.ceil(n_layers / 6))
    lo = (sc["layer"] // size) * size
    sc["layer_group"] = lo.astype(str) + "-" + np.minimum(lo + size - 1, n_layers - 1).astype(str)
    sc["error"] = pd.to_numeric(sc["attn_out_rel_error"], errors="coerce").fillna(
        sc[["k_rel_error", "v_rel_error"]].max(axis=1))
    sc["decode_us"] = pd.to_numeric(sc["decode_ns"], errors="coerce") / 1e3
    # optional fields that are null in every row arrive as objects
    tbl = _compression.compression_table(sc.drop(columns=["layer_group", "error", "decode_us"]).assign(
        **{c: pd.to_numeric(sc[c], errors="coerce") for c in
           ("attn_score_error", "attn_out_rel_error", "encode_ns", "decode_ns")}))
    rec = _compression.recommend(tbl)
    sampling = _compression.sampling_summary(logs.frame(ShadowBudget))
    if sampling:
        sec.blocks.append(Text(f"Sampling: {sampling}. Each figure below rests on the sampled steps "
                               "in its row (`steps`); attn_out_rel_error_lo/_hi bound its mean with a "
                               "95% interval resampling whole steps."))
    sec.blocks.append(Table("Per layer group and method (means)", tbl))
    pts = sc.groupby(["method", "layer"]).agg(ratio=("ratio", "mean"), error=("error", "mean")).reset_index()
    pts["error_pct"] = pts["error"] * 100
    sec.blocks.append(Chart("Error vs compression ratio (one point per method and layer)", "scatter",
                            pts, "ratio", "error_pct", color="method", x_title="ratio (x)",
                            y_title="relative error (%)",
                            table=pts.groupby("method")[["ratio", "error_pct"]].mean().round(3).reset_index()))
    sec.blocks.append(Table("Recommendation per layer group", rec))
    engine_rec = _vllm_recommendation(logs, tbl)
    if engine_rec is not None:
        sec.blocks.append(engine_rec)
    lg = logs.frame(ShadowLogits)
    if len(lg):
        g = lg.groupby("method")
        sec.blocks.append(Table("Whole model with compressed KV: next-token agreement (teacher forced)",
                                pd.DataFrame({"tokens": g["tokens"].sum(), "kl_divergence": g["kl_divergence"].mean(),
                                              "top1_agreement": g["top1_agreement"].mean()}).round(4).reset_index()))
    dec = sc.dropna(subset=["decode_us"])
    if len(dec):
        dec = dec.assign(seq=np.where(dec["seq_len_tokens"] > 512, "> 512 tokens", "<= 512 tokens"))
        sec.blocks.append(Table("Decode time by sequence length (median µs)",
                                dec.pivot_table(index="method", columns="seq", values="decode_us",
                                                aggfunc="median").round(1).reset_index()))
    return sec


def differential(logs: Logs) -> Section:
    sec = Section("differential", "Differential KV writes",
                  "How many bytes do KV blocks written out of the pool need: in full, deduplicated, "
                  "as a delta against a stored block or their previous version?")
    de = logs.frame(ShadowDelta)
    if de.empty:
        sec.blocks.append(Absent("differential write measurements (ShadowDelta events)",
                                 "record with `kvdiag shadow --delta --log FILE`"))
        return sec
    tbl = _delta.delta_table(de)
    bound = sorted({float(b) for b in de["error_bound"]})
    sec.blocks.append(Text(
        f"{len(de):,} block-layer writes; savings are fractions of the bytes written in full. Dedup is "
        f"lossless; delta and quantization-only keep every element within {', '.join(f'{b:g}' for b in bound)} "
        f"x the rms of its (K/V, head); quant_saving is quantization alone at that bound, and "
        f"delta_vs_quant_referenced what a stored reference saves beyond it where one was used."))
    sec.blocks.append(Table("Per layer group (1-based): savings, references used, errors, µs per block-layer",
                            tbl.round(4)))
    per = _delta.by_layer(de)
    long = per.melt(id_vars="layer", value_vars=["dedup_saving", "delta_saving", "quant_saving"],
                    var_name="encoding", value_name="saving")
    sec.blocks.append(Chart("Write-bandwidth saving per layer (0-based)", "line", long, "layer", "saving",
                            color="encoding", x_title="layer", y_title="fraction of full bytes saved",
                            table=per.round(4)))
    return sec


def locality(logs: Logs) -> Section:
    sec = Section("locality", "Attention locality",
                  "Where does attention go, head by head: recent window, sinks, heavy hitters?")
    lo = logs.frame(ShadowLocality)
    if lo.empty:
        sec.blocks.append(Absent("attention locality samples (ShadowLocality events)",
                                 "record with attention capture on (`kvdiag demo`)"))
        return sec
    for col, title in (("recent_mass", "Attention mass on the most recent 20% of positions"),
                       ("outside_share", "Each head's share of its layer's non-recent mass")):
        v = pd.to_numeric(lo[col], errors="coerce")
        if v.notna().any():
            m = lo.assign(v=v).pivot_table(index="layer", columns="head", values="v", aggfunc="mean")
            sec.blocks.append(Chart(title + " (layers x heads)", "heatmap", m, x_title="head",
                                    y_title="layer", table=m.round(3).reset_index()))
    per_layer = lo.groupby("layer")[["recent_mass", "sink_mass", "other_mass"]].mean()
    long = per_layer.reset_index().melt(id_vars="layer", var_name="mass", value_name="share")
    sec.blocks.append(Chart("Mean attention mass per layer", "line", long, "layer", "share", color="mass",
                            x_title="layer", y_title="share of attention", table=per_layer.round(3).reset_index()))
    sec.blocks.append(Table("Top-3 heads by share of the layer's non-recent attention",
                            _locality.top_heads(lo).astype({"top_heads": str})))
    prof = _locality.distance_profile(lo).set_index("layer")
    if prof.shape[1]:
        sec.blocks.append(Chart("Attention mass by distance (layers x distance bins, tokens)", "heatmap",
                                prof, x_title="distance", y_title="layer", table=prof.round(3).reset_index()))
    return sec
