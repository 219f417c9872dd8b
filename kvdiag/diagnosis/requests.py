"""Per-request table: how much KV each request held and how it was served.

- ``kv_tokens`` = prompt_tokens + output_tokens; ``kv_bytes`` = kv_tokens x KV bytes per token
  (what the request's cache holds at its end, over all layers, K and V).
- ``blocks_allocated``: fresh blocks taken for it; ``blocks_reused``: prefix-cache hits;
  ``blocks_released``: blocks it gave back (BlockReleased), plus blocks freed by preemption.
- ``block_bytes_held`` = (blocks_allocated + blocks_reused) x block bytes (block granularity,
  shared blocks counted for every request that holds them).
- ``hit_rate`` = cached_prompt_tokens / prompt_tokens.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvdiag.diagnosis.latency import request_latency
from kvdiag.diagnosis.frames import Logs
from kvdiag.events.schema import BlockAllocated, BlockReleased, PrefixHit, RequestPreempted

COLUMNS = ["node", "request_id", "status", "arrived_ns", "finished_ns", "prompt_tokens",
           "output_tokens", "cached_prompt_tokens", "hit_rate", "kv_tokens", "kv_bytes",
           "blocks_allocated", "blocks_reused", "blocks_released", "block_bytes_held",
           "preemptions", "ttft_ns", "e2e_ns", "per_token_ns"]


_COUNT_COLUMNS = ["blocks_allocated", "blocks_reused", "blocks_released", "preemptions"]


def _count(df: pd.DataFrame, name: str) -> pd.DataFrame:
    """Events per (node, request_id) as a frame with one column ``name``."""
    if df.empty:
        return pd.DataFrame(columns=["node", "request_id", name])
    return df.groupby(["node", "request_id"]).size().rename(name).reset_index()


def block_counts(logs: Logs) -> pd.DataFrame:
    """Per (node, request_id): blocks_allocated, blocks_reused, blocks_released, preemptions
    (definitions in the module docstring)."""
    parts = [_count(logs.frame(BlockAllocated), "blocks_allocated"),
             _count(logs.frame(PrefixHit), "blocks_reused"),
             _count(logs.frame("block_deduplicated"), "blocks_reused"),
             _count(logs.frame(BlockReleased), "blocks_released"),
             _count(logs.frame(RequestPreempted), "preemptions")]
    long = pd.concat([p.melt(id_vars=["node", "request_id"], var_name="what", value_name="n")
                      for p in parts if len(p)], ignore_index=True) if any(len(p) for p in parts) else None
    if long is None:
        return pd.DataFrame(columns=["node", "request_id", *_COUNT_COLUMNS])
    df = long.pivot_table(index=["node", "request_id"], columns="what", values="n", aggfunc="sum",
                          fill_value=0)
    return df.reindex(columns=_COUNT_COLUMNS, fill_value=0).reset_index().rename_axis(columns=None)


def request_table(logs: Logs, lat: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per finished request (columns ``COLUMNS``), in finish order. ``lat``: a
    precomputed :func:`~kvdiag.diagnosis.latency.request_latency` frame."""
    lat = request_latency(logs) if lat is None else lat
    if lat.empty:
        return pd.DataFrame(columns=COLUMNS)
    df = lat.merge(block_counts(logs), on=["node", "request_id"], how="left")
    for c in _COUNT_COLUMNS:
        df[c] = pd.to_numeric(df[c]).fillna(0).astype("int64")
    prompt = df["prompt_tokens"].astype("float64")
    df["hit_rate"] = np.where(prompt > 0, df["cached_prompt_tokens"] / prompt.where(prompt > 0), np.nan)
    df["kv_tokens"] = df["prompt_tokens"] + df["output_tokens"]
    bpt = df["node"].map({n: logs.bytes_per_token(n) for n in logs.nodes}).astype("float64")
    bb = df["node"].map({n: logs.block_bytes(n) for n in logs.nodes}).astype("float64")
    df["kv_bytes"] = df["kv_tokens"] * bpt
    df["block_bytes_held"] = (df["blocks_allocated"] + df["blocks_reused"]) * bb
    return df[COLUMNS]
