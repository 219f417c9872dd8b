"""Fragmentation of a KV block pool, from engine events: the empty token slots of used blocks
(``KVPoolSample``) and the free list replayed from block events.

From ``KVPoolSample`` events: block occupancy = blocks used / pool blocks; token occupancy =
tokens held / (blocks used x block size); the empty token slots of partially filled blocks are
the pool's internal fragmentation (1 - token occupancy). The free list's fragmentation is
1 - longest run of consecutive free block ids / free blocks. The CUDA allocator's
fragmentation is :mod:`kvdiag.diagnosis.fragmentation`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import pandas as pd

from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.fragmentation import external_fragmentation
from kvdiag.diagnosis.rules import FRAGMENTATION_LIMIT, fragmentation_status
from kvdiag.events.schema import Event
from kvdiag.pool.blockledger import BlockLedger


KV_POOL_COLUMNS = [
    "ts_ns", "num_blocks", "blocks_used", "blocks_cached", "blocks_free", "tokens_held",
    "token_slots", "empty_slots_tokens", "empty_slots_bytes", "block_occupancy", "token_occupancy",
    "running_requests",
]


def kv_pool_frame(samples: pd.DataFrame, block_size_tokens: int,
                  bytes_per_token: Optional[int] = None) -> pd.DataFrame:
    """From ``KVPoolSample`` rows: token slots = blocks used x block size; empty slots =
    token slots - tokens held (internal fragmentation, also in bytes when ``bytes_per_token``
    is known); block occupancy = blocks used / pool blocks; token occupancy = tokens held /
    token slots (NaN when no block is used). A sample whose tokens held exceed its token slots
    (an adapter counting a shared prefix block once per request) contradicts that definition:
    its empty slots and token occupancy are NaN, not negative."""
    if samples is None or samples.empty:
        return pd.DataFrame(columns=KV_POOL_COLUMNS)
    out = samples[["ts_ns", "num_blocks", "blocks_used", "blocks_cached", "blocks_free",
                   "tokens_held", "running_requests"]].copy()
    out["token_slots"] = out["blocks_used"] * block_size_tokens
    out["empty_slots_tokens"] = (out["token_slots"] - out["tokens_held"]).where(
        out["tokens_held"] <= out["token_slots"]).astype("float64")
    out["empty_slots_bytes"] = (out["empty_slots_tokens"] * bytes_per_token) if bytes_per_token else float("nan")
    out["block_occupancy"] = out["blocks_used"] / out["num_blocks"].where(out["num_blocks"] > 0)
    out["token_occupancy"] = (out["tokens_held"] / out["token_slots"].where(out["token_slots"] > 0)).where(
        out["empty_slots_tokens"].notna())
    return out[KV_POOL_COLUMNS]


@dataclass(frozen=True, slots=True)
class FreeListState:
    """The free list of a block pool replayed from block events: ``free_blocks`` count, the
    longest run of consecutive free block ids, and the free-list fragmentation 1 - longest
    run / free blocks (matters only to engines that need contiguous blocks)."""

    num_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    longest_free_run_blocks: int
    free_list_fragmentation: float


def replay_free_list(events: Iterable[Event]) -> Optional[FreeListState]:
    """Replay ``KVPoolInfo`` + block events through the pool ledger
    (:class:`kvdiag.pool.blockledger.BlockLedger`: used while some request holds a block, cached
    when released with ``cached`` until evicted or hit again, free otherwise, bad releases as
    it defines them). None without a ``KVPoolInfo``."""
    ledger = BlockLedger()
    max_id = -1
    apply = ledger.apply
    for ev in events:
        block_id = getattr(ev, "block_id", None)
        if block_id is not None and block_id > max_id:
            max_id = block_id
        apply(ev)
    return free_list_state(ledger, max_id)


def free_list_state(ledger: BlockLedger, max_block_id: int) -> Optional[FreeListState]:
    """The free list of ``ledger`` now (None before a ``KVPoolInfo``). Block ids are taken to
    be ``num_blocks`` consecutive integers starting at 0, or ending at ``max_block_id`` (the
    largest id seen) when that is beyond ``num_blocks - 1`` (transformers' paged cache numbers
    its pages after two reserved "trash" pages)."""
    num_blocks = ledger.num_blocks
    if num_blocks is None:
        return None
    busy = [*ledger.holders, *ledger.cached]
    first_id = max(0, max_block_id + 1 - num_blocks)
    end_id = first_id + num_blocks
    bounds = [first_id - 1, *sorted(b for b in busy if first_id <= b < end_id), end_id]
    longest = max(b - a - 1 for a, b in zip(bounds, bounds[1:]))  # the longest free run
    free = ledger.free_blocks
    return FreeListState(num_blocks, free, ledger.cached_blocks, ledger.held_blocks, longest,
                         external_fragmentation(free, longest))


# ---------------------------------------------------------------- the 15% rule


def kv_pool_fragmentation_finding(pool: pd.DataFrame, limit: float = FRAGMENTATION_LIMIT) -> Finding:
    """Rule ``fragmentation.kv_pool``: empty token slots in blocks held by live requests as a
    share of their slots (1 - token occupancy), summed over the samples, against ``limit``."""
    title = f"KV pool fragmentation (empty slots in used blocks) under {limit:.0%}"
    used = pool[pool["token_slots"] > 0] if not pool.empty else pool
    if used.empty:
        return Finding("fragmentation.kv_pool", "n/a", title, "no KV pool samples with blocks in use",
                       {"limit": limit})
    bad = int(used["empty_slots_tokens"].isna().sum())
    used = used[used["empty_slots_tokens"].notna()]
    if used.empty:
        return Finding("fragmentation.kv_pool", "n/a", title,
                       f"tokens held exceed the token slots of used blocks in all {bad} samples "
                       "(shared prefix blocks counted once per request?)", {"limit": limit, "inconsistent_samples": bad})
    slots = int(used["token_slots"].sum())
    empty = int(used["empty_slots_tokens"].sum())
    value = empty / slots
    worst = used.loc[(used["empty_slots_tokens"] / used["token_slots"]).idxmax()]
    evidence = {"value": value, "empty_slots_tokens": empty, "token_slots": slots,
                "samples": int(len(used)), "worst_ts_ns": int(worst["ts_ns"]),
                "worst_value": float(worst["empty_slots_tokens"] / worst["token_slots"]), "limit": limit,
                "inconsistent_samples": bad}
    status = fragmentation_status(value, limit)
    return Finding("fragmentation.kv_pool", status, title,
                   f"empty slots {value:.1%} of used token slots over {len(used)} samples (limit {limit:.0%})",
                   evidence)
