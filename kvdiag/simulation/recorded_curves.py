"""Capacity curves of a recorded stream: the live fold's rows and curve
(:mod:`kvdiag.simulation.curve_rows`, :class:`kvdiag.simulation.capacity_curve.ReuseCurve`)
replayed over a log's events or one node's event frames, one curve per tier.
"""

from __future__ import annotations

from typing import Iterable, Optional

from kvdiag.simulation.capacity_curve import MAX_KEYS_CAP, ReuseCurve
from kvdiag.simulation.curve_rows import RequestRows, StoreRows
from kvdiag.simulation.lru_curve import HitRateCurve
from kvdiag.traces.trace import DEFAULT_BLOCK_TOKENS


def curve_of_events(events: Iterable, block_size_tokens: Optional[int] = None,
                    max_keys: int = MAX_KEYS_CAP, hash_algorithm: str = "fast") -> dict[str, HitRateCurve]:
    """The curves of a recorded event stream (what the live fold computes), by tier: "pool"
    for request content, the KV events' ``medium`` for their tiers ("default" without one).
    ``block_size_tokens``: the request rows' block size (default: the pool's or the header's,
    else 16)."""
    from kvdiag.events.schema import (BlockStored, KVPoolInfo, LogHeader, PrefixCacheCleared,
                               PrefixCacheRemoved, PrefixCacheStored, RequestArrived,
                               RequestFinished)

    bs = block_size_tokens
    req: Optional[RequestRows] = None
    tiers: dict[str, StoreRows] = {}
    for ev in events:
        if isinstance(ev, LogHeader):
            bs = bs or ev.block_size_tokens
        elif isinstance(ev, KVPoolInfo):
            bs = bs or ev.block_size_tokens
        elif isinstance(ev, RequestArrived):
            if req is None:
                req = RequestRows(ReuseCurve(bs or DEFAULT_BLOCK_TOKENS, max_keys), hash_algorithm)
            req.arrived(ev)
        elif isinstance(ev, BlockStored) and req is not None:
            req.stored(ev)
        elif isinstance(ev, RequestFinished) and req is not None:
            req.finished(ev)
        elif isinstance(ev, PrefixCacheStored):
            tier = ev.medium or "default"
            if tier not in tiers:
                tiers[tier] = StoreRows(ReuseCurve(ev.block_size_tokens or DEFAULT_BLOCK_TOKENS,
                                                   max_keys), hash_algorithm)
            tiers[tier].stored(ev)
        elif isinstance(ev, PrefixCacheRemoved) and (ev.medium or "default") in tiers:
            tiers[ev.medium or "default"].removed(ev)
        elif isinstance(ev, PrefixCacheCleared):
            for rows in tiers.values():
                rows.cleared()
    out = {} if req is None else {"pool": req.curve.curve()}
    out.update({t: rows.curve.curve() for t, rows in tiers.items()})
    return out


def _row_object(row: dict):
    from types import SimpleNamespace

    return SimpleNamespace(**{k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()})


def curves_of_frames(frames: dict, block_size_tokens: Optional[int],
                     max_keys: int = MAX_KEYS_CAP, hash_algorithm: str = "fast") -> dict[str, HitRateCurve]:
    """:func:`curve_of_events` over one node's event frames (``frames[tag]``: rows with
    ``ts_ns``, as :class:`kvdiag.diagnosis.frames.Logs` holds them), rows merged in time order
    (stable: a frame's own order at equal times)."""
    tags = ("request_arrived", "block_stored", "request_finished", "prefix_cache_stored",
            "prefix_cache_removed", "prefix_cache_cleared")
    merged = []
    for order, tag in enumerate(tags):
        df = frames.get(tag)
        if df is None or not len(df):
            continue
        for i, row in enumerate(df.to_dict("records")):
            merged.append((int(row["ts_ns"]), i, order, tag, row))
    merged.sort(key=lambda m: (m[0], m[2], m[1]))  # at equal times: arrival, store, finish
    req: Optional[RequestRows] = None
    tiers: dict[str, StoreRows] = {}
    for _, _, _, tag, row in merged:
        ev = _row_object(row)
        if tag == "request_arrived":
            if req is None and (ev.token_ids is not None or ev.chunk_hashes is not None):
                req = RequestRows(ReuseCurve(block_size_tokens or DEFAULT_BLOCK_TOKENS, max_keys),
                                  hash_algorithm)
            if req is not None:
                req.arrived(ev)
        elif tag == "block_stored" and req is not None:
            req.stored(ev)
        elif tag == "request_finished" and req is not None:
            req.finished(ev)
        elif tag == "prefix_cache_stored":
            tier = ev.medium or "default"
            if tier not in tiers:
                tiers[tier] = StoreRows(ReuseCurve(int(ev.block_size_tokens or DEFAULT_BLOCK_TOKENS),
                                                   max_keys), hash_algorithm)
            tiers[tier].stored(ev)
    out = {} if req is None else {"pool": req.curve.curve()}
    out.update({t: rows.curve.curve() for t, rows in tiers.items()})
    return out
