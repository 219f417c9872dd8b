"""Per-request and per-block accounting of a KV block pool, replayed from block events.

The one state machine behind the live release monitor (``kvdiag.collectors.release``) and the
offline leak analysis (``kvdiag.analysis.leaks``). A block is *held* while at least one request
holds it (``BlockAllocated`` or ``PrefixHit`` add a holder, ``BlockReleased`` removes one),
*cached* once its last holder released it with ``cached=True`` (until ``BlockEvicted`` or a new
hit), and *free* otherwise. Events that contradict that state are kept as anomalies instead of
being dropped or raising.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from kvdiag.schema import (BlockAllocated, BlockDeduplicated, BlockEvicted, BlockId, BlockReleased, Event, KVPoolInfo,
                           PrefixHit, RequestArrived, RequestFinished, RequestId)

AnomalyKind = Literal["double_release", "release_unheld", "alloc_in_use", "evict_held"]


@dataclass(slots=True)
class RequestRecord:
    """What one request did to the pool. Counts are blocks (events), not distinct ids."""

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
    held: set = field(default_factory=set)
    released: set = field(default_factory=set)


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


@dataclass(frozen=True, slots=True)
class Anomaly:
    kind: AnomalyKind
    ts_ns: int
    block_id: BlockId
    request_id: Optional[RequestId] = None


class BlockLedger:
    """Feed events with :meth:`apply` in time order; read ``requests``, ``episodes``,
    ``anomalies`` and :meth:`held_by_finished`."""

    def __init__(self) -> None:
        self.num_blocks: Optional[int] = None
        self.requests: dict[RequestId, RequestRecord] = {}
        self.episodes: list[Episode] = []
        self.anomalies: list[Anomaly] = []
        self.holders: dict[BlockId, set] = {}
        self.cached: dict[BlockId, Episode] = {}
        self._open: dict[BlockId, Episode] = {}
        self._cached_by: dict[BlockId, RequestId] = {}
        self.last_ts_ns = 0

    def _request(self, rid: RequestId) -> RequestRecord:
        rec = self.requests.get(rid)
        if rec is None:
            rec = self.requests[rid] = RequestRecord(rid)
        return rec

    def apply(self, ev: Event) -> None:
        self.last_ts_ns = max(self.last_ts_ns, ev.ts_ns)
        if isinstance(ev, BlockAllocated):
            self._allocated(ev)
        elif isinstance(ev, (PrefixHit, BlockDeduplicated)):
            rec = self._request(ev.request_id)
            if isinstance(ev, PrefixHit):
                rec.blocks_prefix_hit += 1
            else:
                rec.blocks_deduplicated += 1
            rec.held.add(ev.block_id)
            self.holders.setdefault(ev.block_id, set()).add(ev.request_id)
            ep = self.cached.pop(ev.block_id, None) or self._open.get(ev.block_id)
            if ep is not None:
                ep.hits += 1
                self._open[ev.block_id] = ep
        elif isinstance(ev, BlockReleased):
            self._released(ev)
        elif isinstance(ev, BlockEvicted):
            if self.holders.get(ev.block_id):
                self.anomalies.append(Anomaly("evict_held", ev.ts_ns, ev.block_id))
            ep = self.cached.pop(ev.block_id, None)
            if ep is not None:
                ep.evicted_ns = ev.ts_ns
            owner = self._cached_by.pop(ev.block_id, None)
            if owner is not None:
                self._request(owner).blocks_evicted_later += 1
        elif isinstance(ev, RequestArrived):
            self._request(ev.request_id).arrived_ns = ev.ts_ns
        elif isinstance(ev, RequestFinished):
            rec = self._request(ev.request_id)
            rec.finished_ns, rec.status = ev.ts_ns, ev.status
        elif isinstance(ev, KVPoolInfo):
            self.num_blocks = ev.num_blocks

    def _allocated(self, ev: BlockAllocated) -> None:
        if self.holders.get(ev.block_id):
            self.anomalies.append(Anomaly("alloc_in_use", ev.ts_ns, ev.block_id, ev.request_id))
        stale = self.cached.pop(ev.block_id, None)
        if stale is not None:  # reused without an eviction event: treat as evicted now
            stale.evicted_ns = ev.ts_ns
        self._cached_by.pop(ev.block_id, None)
        rec = self._request(ev.request_id)
        rec.blocks_allocated += 1
        rec.held.add(ev.block_id)
        rec.released.discard(ev.block_id)
        self.holders[ev.block_id] = {ev.request_id}
        ep = Episode(ev.block_id, ev.request_id, ev.ts_ns)
        self.episodes.append(ep)
        self._open[ev.block_id] = ep

    def _released(self, ev: BlockReleased) -> None:
        rec = self._request(ev.request_id)
        holders = self.holders.get(ev.block_id, set())
        if ev.request_id not in holders:
            kind = "double_release" if ev.block_id in rec.released else "release_unheld"
            self.anomalies.append(Anomaly(kind, ev.ts_ns, ev.block_id, ev.request_id))
            return
        holders.discard(ev.request_id)
        rec.held.discard(ev.block_id)
        rec.released.add(ev.block_id)
        rec.blocks_released += 1
        rec.blocks_released_cached += int(ev.cached)
        if holders:
            return
        del self.holders[ev.block_id]
        ep = self._open.pop(ev.block_id, None)
        if ep is not None:
            ep.released_ns, ep.cached = ev.ts_ns, ev.cached
            if ev.cached:
                self.cached[ev.block_id] = ep
        if ev.cached:
            self._cached_by[ev.block_id] = ev.request_id

    def held_by_finished(self, now_ns: int, grace_ns: int) -> dict[RequestId, list[BlockId]]:
        """Requests that finished at least ``grace_ns`` before ``now_ns`` and still hold
        blocks, with those blocks (sorted)."""
        return {r.request_id: sorted(r.held) for r in self.requests.values()
                if r.finished_ns is not None and r.held and r.finished_ns <= now_ns - grace_ns}

