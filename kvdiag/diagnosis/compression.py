"""Per-layer-group compression table and a recommendation, from ShadowCompression events.

Layers in events are 0-based; groups are written 1-based and inclusive, as people count
layers: the article's default is ``"1-6,7-12,13+"``. Every number in the table is a mean over
the events (one per sampled step, layer, kv head and method) of the group, except
``seq_len_tokens`` (median) and ``attn_out_rel_error_p95``. ``samples`` counts those events,
``steps`` the sampled decode steps they come from; since the layers and heads of one step share
its KV, the steps are the independent samples: ``attn_out_rel_error_lo``/``_hi`` bound the
mean with a 95% bootstrap interval that resamples whole steps
(:func:`kvdiag.diagnosis.intervals.cluster_bootstrap_mean`). Costs are per layer and sampled
step: ``encode_us`` / ``decode_us`` = mean over (step, layer) of the sum over kv heads of
``encode_ns`` / ``decode_ns``, in microseconds.

Recommendation per group: among the methods whose mean error (``attn_out_rel_error`` by
default) is within the budget (:data:`kvdiag.diagnosis.rules.COMPRESSION_ERROR_BUDGET`), the one with the highest ratio (fewest bytes), ties broken by
decode cost; sparse methods qualify only when the group's median sequence length is at least
``sparse_min_tokens`` (the article: 512).
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

import pandas as pd

from kvdiag.diagnosis.intervals import cluster_bootstrap_mean
from kvdiag.shadow.sampling import sampling_line
from kvdiag.diagnosis.rules import COMPRESSION_ERROR_BUDGET

ARTICLE_GROUPS = "1-6,7-12,13+"
SPARSE_METHODS = ("topk_norm", "h2o", "streaming")  # kvdiag.kernels.methods, without torch

TABLE_COLUMNS = ["group", "method", "sparse", "samples", "steps", "seq_len_tokens", "ratio",
                 "k_rel_error", "v_rel_error", "attn_score_error", "attn_out_rel_error",
                 "attn_out_rel_error_lo", "attn_out_rel_error_hi", "attn_out_rel_error_p95",
                 "encode_us", "decode_us"]
RECOMMEND_COLUMNS = ["group", "method", "ratio", "error", "decode_us", "reason"]


def parse_groups(text: str, num_layers: Optional[int] = None) -> list[tuple[str, int, Optional[int]]]:
    """``"1-6,7-12,13+"`` -> [(label, first, last)] 1-based inclusive (last None = open)."""
    groups = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+)|(\+))?", part)
        if not m:
            raise ValueError(f"layer group {part!r}: expected N, N-M or N+ (1-based layers)")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) else (None if m.group(3) else first)
        if first < 1 or (last is not None and last < first):
            raise ValueError(f"layer group {part!r}: expected 1 <= first <= last")
        if num_layers is not None and last is None:
            last = num_layers
        groups.append((part, first, last))
    return groups


def _group_of(layer0: int, groups) -> Optional[str]:
    layer = layer0 + 1
    for label, first, last in groups:
        if layer >= first and (last is None or layer <= last):
            return label
    return None


def compression_table(events: pd.DataFrame, groups: str = ARTICLE_GROUPS) -> pd.DataFrame:
    """One row per (group, method): see the module docstring. Layers outside every group are
    left out. ``events``: the ``shadow_compression`` frame of a log."""
    if events is None or events.empty:
        return pd.DataFrame(columns=TABLE_COLUMNS)
    spec = parse_groups(groups)
    df = events.copy()
    df["group"] = [_group_of(int(x), spec) for x in df["layer"]]
    df = df[df["group"].notna()]
    per_layer = (df.groupby(["group", "method", "ts_ns", "layer"], sort=False)
                 [["encode_ns", "decode_ns"]].sum().reset_index())
    cost = per_layer.groupby(["group", "method"])[["encode_ns", "decode_ns"]].mean() / 1e3
    g = df.groupby(["group", "method"])
    size = g.size()
    ci = pd.DataFrame([(e.lo, e.hi) for e in (cluster_bootstrap_mean(sub["attn_out_rel_error"], sub["ts_ns"])
                                                for _, sub in g)], index=size.index, columns=["lo", "hi"])
    out = pd.DataFrame({
        "samples": size,
        "steps": g["ts_ns"].nunique(),
        "seq_len_tokens": g["seq_len_tokens"].median(),
        "ratio": g["ratio"].mean(),
        "k_rel_error": g["k_rel_error"].mean(),
        "v_rel_error": g["v_rel_error"].mean(),
        "attn_score_error": g["attn_score_error"].mean(),
        "attn_out_rel_error": g["attn_out_rel_error"].mean(),
        "attn_out_rel_error_lo": ci["lo"],
        "attn_out_rel_error_hi": ci["hi"],
        "attn_out_rel_error_p95": g["attn_out_rel_error"].quantile(0.95),
        "encode_us": cost["encode_ns"],
        "decode_us": cost["decode_ns"],
    }).reset_index()
    out["sparse"] = [m.split(":")[0] in SPARSE_METHODS for m in out["method"]]
    order = {label: i for i, (label, _, _) in enumerate(spec)}
    out["_order"] = out["group"].map(order)
    out = out.sort_values(["_order", "ratio"])
    return out[TABLE_COLUMNS].reset_index(drop=True)


def recommend(table: pd.DataFrame, error_budget: float = COMPRESSION_ERROR_BUDGET, error: str = "attn_out_rel_error",
              sparse_min_tokens: int = 512) -> pd.DataFrame:
    """Per group, the cheapest method within ``error_budget`` (module docstring)."""
    rows = []
    for group, sub in table.groupby("group", sort=False):
        seq = float(sub["seq_len_tokens"].median())
        allowed = sub if seq >= sparse_min_tokens else sub[~sub["sparse"]]
        ok = allowed[allowed[error] <= error_budget]
        if ok.empty:
            rows.append({"group": group, "method": None, "ratio": 1.0, "error": 0.0, "decode_us": 0.0,
                         "reason": f"no method within {error} <= {error_budget:g}; keep full precision"})
            continue
        best = ok.sort_values(["ratio", "decode_us"], ascending=[False, True]).iloc[0]
        note = "" if seq >= sparse_min_tokens else f"; sparse off (median {seq:.0f} < {sparse_min_tokens} tokens)"
        hi = best.get(f"{error}_hi")
        if hi is not None and pd.notna(hi) and hi > error_budget:
            note += (f"; its 95% interval reaches {hi:.3g} over {int(best['steps'])} sampled steps: "
                     "more samples would settle it")
        rows.append({"group": group, "method": best["method"], "ratio": float(best["ratio"]),
                     "error": float(best[error]), "decode_us": float(best["decode_us"]),
                     "reason": f"highest ratio with {error} <= {error_budget:g}{note}"})
    return pd.DataFrame(rows, columns=RECOMMEND_COLUMNS)


def logits_table(events: pd.DataFrame) -> pd.DataFrame:
    """Mean KL (nats) and top-1 agreement per method from ``shadow_logits`` events."""
    cols = ["method", "tokens", "kl_divergence", "top1_agreement"]
    if events is None or events.empty:
        return pd.DataFrame(columns=cols)
    g = events.groupby("method")
    return pd.DataFrame({"tokens": g["tokens"].sum(), "kl_divergence": g["kl_divergence"].mean(),
                         "top1_agreement": g["top1_agreement"].mean()}).reset_index()[cols]


def frame_of(events: Iterable, cls) -> pd.DataFrame:
    """DataFrame of the events of class ``cls`` in an in-memory list (columns = its fields)."""
    from kvdiag.events.schema import fields_of

    rows = [{f: getattr(e, f) for f in fields_of(cls)} for e in events if isinstance(e, cls)]
    return pd.DataFrame(rows, columns=list(fields_of(cls)))



def sampling_summary(budgets: pd.DataFrame) -> Optional[str]:
    """:func:`sampling_line` of the last ``shadow_budget`` event of a log (the runner's counts
    are cumulative); None without one."""
    if budgets is None or budgets.empty:
        return None
    return sampling_line(budgets.sort_values("ts_ns").iloc[-1].to_dict())


VLLM_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
"""``--kv-cache-dtype`` values of vLLM (0.32) that kvdiag's methods realise: vLLM stores fp8
as a plain cast with one scale per tensor (1.0 unless calibrated), the methods
``fp8_e4m3:s=1`` and ``fp8_e5m2:s=1`` (``fp8`` is vLLM's name for ``fp8_e4m3``). vLLM's CPU
backend takes them on x86 with AVX-512 or AMX and a head size divisible by 32."""

ENGINE_COLUMNS = ["setting", "method", "ratio", "error", "worst_group", "kv_bytes", "frees_bytes",
                  "extra_tokens", "reason"]


def vllm_setting(method: Optional[str]) -> Optional[str]:
    """The vLLM flag that stores the KV cache as ``method`` does (``fp8_e4m3:s=1`` ->
    ``--kv-cache-dtype fp8_e4m3``), or None when vLLM has none (group-wise, integer and sparse
    methods; casts with another scale need calibrated scales, not a flag)."""
    if not method:
        return None
    base, _, options = method.partition(":")
    if base in ("fp8_e4m3", "fp8_e5m2") and options.replace(" ", "") in ("s=1", "s=1.0"):
        return f"--kv-cache-dtype {base}"
    return None


def engine_recommendation_on_pool(table: pd.DataFrame, engine: str, pool_info: pd.DataFrame) -> pd.DataFrame:
    """:func:`engine_recommendation` on the pool of the last ``KVPoolInfo`` row of ``pool_info``
    (its sizes unknown when there is none)."""
    last = pool_info.iloc[-1] if len(pool_info) else None
    return engine_recommendation(
        table, engine, num_blocks=int(last["num_blocks"]) if last is not None else None,
        block_bytes=int(last["block_bytes"]) if last is not None else None,
        block_size_tokens=int(last["block_size_tokens"]) if last is not None else None)


def engine_recommendation(table: pd.DataFrame, engine: str, num_blocks: Optional[int] = None,
                          block_bytes: Optional[int] = None, block_size_tokens: Optional[int] = None,
                          error_budget: float = COMPRESSION_ERROR_BUDGET,
                          error: str = "attn_out_rel_error") -> pd.DataFrame:
    """The recommendation in the engine's terms: one setting for every layer (vLLM's
    ``--kv-cache-dtype`` applies to the whole cache), so among the methods the engine realises
    (:func:`vllm_setting`), the one with the highest ratio whose mean ``error`` is within
    ``error_budget`` in every layer group of ``table`` (:func:`compression_table`). The capacity
    it frees is measured on the server's own pool (its ``KVPoolInfo``: ``num_blocks`` x
    ``block_bytes``, the KV tensors' size): ``frees_bytes`` = pool bytes x (1 - 1/ratio) at the
    same tokens, or ``extra_tokens`` = pool tokens x (ratio - 1) in the same memory. One row
    (``setting`` None with the reason when none qualifies); empty for engines without such
    settings."""
    if engine != "vllm" or table is None or table.empty:
        return pd.DataFrame(columns=ENGINE_COLUMNS)
    kv_bytes = num_blocks * block_bytes if num_blocks and block_bytes else None
    rows = []
    for method, sub in table.groupby("method", sort=False):
        setting = vllm_setting(method)
        if setting is None:
            continue
        worst = sub.sort_values(error, ascending=False).iloc[0]
        rows.append((setting, method, float(sub["ratio"].mean()), float(worst[error]), str(worst["group"])))
    if not rows:
        return pd.DataFrame([{"setting": None, "method": None, "ratio": 1.0, "error": None, "worst_group": None,
                              "kv_bytes": kv_bytes, "frees_bytes": None, "extra_tokens": None,
                              "reason": "no method vLLM realises was measured (record with fp8_e4m3:s=1 "
                                        "or fp8_e5m2:s=1 among the shadow's methods)"}], columns=ENGINE_COLUMNS)
    ok = [r for r in rows if r[3] <= error_budget]
    if not ok:
        best = min(rows, key=lambda r: r[3])
        return pd.DataFrame([{"setting": None, "method": best[1], "ratio": best[2], "error": best[3],
                              "worst_group": best[4], "kv_bytes": kv_bytes, "frees_bytes": None,
                              "extra_tokens": None,
                              "reason": f"keep the cache's dtype: vLLM's fp8 exceeds {error} <= "
                                        f"{error_budget:g} (best {best[1]}: {best[3]:.3g} in layers {best[4]})"}],
                            columns=ENGINE_COLUMNS)
    setting, method, ratio, err, group = max(ok, key=lambda r: (r[2], -r[3]))
    frees = kv_bytes * (1 - 1 / ratio) if kv_bytes and ratio > 0 else None
    extra = (num_blocks * block_size_tokens * (ratio - 1)) if num_blocks and block_size_tokens else None
    return pd.DataFrame([{"setting": setting, "method": method, "ratio": ratio, "error": err, "worst_group": group,
                          "kv_bytes": kv_bytes, "frees_bytes": frees, "extra_tokens": extra,
                          "reason": f"highest ratio vLLM realises with {error} <= {error_budget:g} in every "
                                    f"layer group (worst: layers {group})"}], columns=ENGINE_COLUMNS)
