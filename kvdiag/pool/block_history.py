"""What each request and each block allocation did to a KV pool, over a finite log.

Kept by a :class:`~kvdiag.pool.blockledger.BlockLedger` built with ``keep_history=True`` (the
ledger decides what is held; this only remembers it): one :class:`RequestRecord` per request and
one :class:`Episode` per block allocation, for :mod:`kvdiag.diagnosis.leaks`' request and episode
frames. It grows with the log, which is why a live ledger keeps none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvdiag.events.schema import (BlockAllocated, BlockDeduplicated, BlockEvicted, BlockId, BlockReleased,
                                  PrefixHit, RequestFinished, RequestId)


@dataclass(slots=True)
class RequestRecord:
    """What one request did to the pool. Counts are events, not distinct block ids."""

    request_id: RequestId
    arrived_ns: Optional[int] = None
    finished_ns: Optional[int] = None
    status: Optional[str] = None
    blocks_allocated: int = 0
    blocks_prefix_hit: int = 0
    blocks_deduplicated: int = 0  # adopted an identical cached block in place of its own
    blocks_released: int = 0
    blocks_released_cached: int = 0
    blocks_evicted_later: int = 0  # released by it as cached, later evicted
    double_releases: int = 0


@dataclass(slots=True)
class Episode:
    """One allocation of a block, from ``BlockAllocated`` until its last holder let it go
    (``released_ns``) and, for cached blocks, until eviction (``evicted_ns``)."""

    block_id: BlockId
    request_id: RequestId
    allocated_ns: int
    released_ns: Optional[int] = None
    cached: bool = False
    evicted_ns: Optional[int] = None
    hits: int = 0


class BlockHistory:
    """Records and episodes, told each event by the ledger after it folded it."""

    def __init__(self) -> None:
        self.requests: dict[RequestId, RequestRecord] = {}
        self.episodes: list[Episode] = []
        self._open: dict[BlockId, Episode] = {}  # block -> its allocation's episode while held
        self._cached_ep: dict[BlockId, Episode] = {}  # cached block -> its episode until evicted
        self._cached_by: dict[BlockId, RequestId] = {}  # cached block -> the request that released it

    def record(self, rid: RequestId) -> RequestRecord:
        """The record of ``rid``, created on first use."""
        rec = self.requests.get(rid)
        if rec is None:
            rec = self.requests[rid] = RequestRecord(rid)
        return rec

    def allocated(self, ev: BlockAllocated) -> None:
        stale = self._cached_ep.pop(ev.block_id, None)
        if stale is not None:  # reused without an eviction event: treat as evicted now
            stale.evicted_ns = ev.ts_ns
        self._cached_by.pop(ev.block_id, None)
        self.record(ev.request_id).blocks_allocated += 1
        ep = Episode(ev.block_id, ev.request_id, ev.ts_ns)
        self.episodes.append(ep)
        self._open[ev.block_id] = ep

    def hit(self, ev: PrefixHit | BlockDeduplicated) -> None:
        rec = self.record(ev.request_id)
        if isinstance(ev, PrefixHit):
            rec.blocks_prefix_hit += 1
        else:
            rec.blocks_deduplicated += 1
        ep = self._cached_ep.pop(ev.block_id, None) or self._open.get(ev.block_id)
        if ep is not None:
            ep.hits += 1
            self._open[ev.block_id] = ep

    def released(self, ev: BlockReleased, last: bool) -> None:
        """``last``: the block's last holder let it go."""
        rec = self.record(ev.request_id)
        rec.blocks_released += 1
        rec.blocks_released_cached += int(ev.cached)
        if not last:
            return
        ep = self._open.pop(ev.block_id, None)
        if ep is not None:
            ep.released_ns, ep.cached = ev.ts_ns, ev.cached
            if ev.cached:
                self._cached_ep[ev.block_id] = ep
        if ev.cached:
            self._cached_by[ev.block_id] = ev.request_id

    def evicted(self, ev: BlockEvicted) -> None:
        ep = self._cached_ep.pop(ev.block_id, None)
        if ep is not None:
            ep.evicted_ns = ev.ts_ns
        owner = self._cached_by.pop(ev.block_id, None)
        if owner is not None:
            self.record(owner).blocks_evicted_later += 1

    def finished(self, ev: RequestFinished) -> None:
        rec = self.record(ev.request_id)
        rec.finished_ns, rec.status = ev.ts_ns, ev.status
