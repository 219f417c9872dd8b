"""The report's requests section: the KV each request held and how it was served."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvdiag.reports.document import Absent, Chart, Section, Table
from kvdiag.reports.shaping import MIB, hist, thin

MAX_REQUEST_ROWS = 200


def requests(req: pd.DataFrame) -> Section:
    sec = Section("requests", "Requests", "How much KV cache does each request hold, and how was it served?")
    if req.empty:
        sec.blocks.append(Absent("finished requests (RequestFinished events)"))
        return sec
    view = pd.DataFrame({
        "node": req["node"], "request_id": req["request_id"], "status": req["status"],
        "prompt_tokens": req["prompt_tokens"], "output_tokens": req["output_tokens"],
        "cached_tokens": req["cached_prompt_tokens"], "hit_rate_pct": (req["hit_rate"] * 100).round(1),
        "kv_MiB": (req["kv_bytes"] / MIB).round(2), "blocks": req["blocks_allocated"] + req["blocks_reused"],
        "block_MiB": (req["block_bytes_held"] / MIB).round(2), "preemptions": req["preemptions"],
        "ttft_ms": (req["ttft_ns"] / 1e6).round(1), "e2e_ms": (req["e2e_ns"] / 1e6).round(1),
        "per_token_ms": (req["per_token_ns"] / 1e6).round(2)})
    x, c = hist(view["kv_MiB"].to_numpy(), 30)
    if np.isfinite(view["kv_MiB"].to_numpy(dtype="float64")).any():
        sec.blocks.append(Chart("KV bytes per request (MiB)", "histogram",
                                pd.DataFrame({"kv_MiB": x.round(2), "requests": c}), "kv_MiB", "requests",
                                x_title="MiB", y_title="requests"))
    sec.blocks.append(Chart("Prompt length vs time to first token", "scatter",
                            thin(view, None, "ttft_ms"), "prompt_tokens", "ttft_ms", color="node" if view["node"].nunique() > 1 else None,
                            x_title="prompt tokens", y_title="TTFT (ms)",
                            table=view[["prompt_tokens", "ttft_ms"]].describe().round(1).reset_index()))
    top = view.sort_values("e2e_ms", ascending=False).head(MAX_REQUEST_ROWS)
    note = (f"{len(view)} requests; showing the {len(top)} slowest (end to end)"
            if len(view) > len(top) else f"{len(view)} requests, slowest first")
    sec.blocks.append(Table("Per-request KV and latency", top, note=note))
    return sec
