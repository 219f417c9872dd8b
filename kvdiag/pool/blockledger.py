"""The one owner of a KV block pool's state, folded incrementally from block events.

Every view reads this ledger: ``kvdiag top`` (:mod:`kvdiag.live.state`), the Prometheus
exporter, the release monitor (:mod:`kvdiag.collectors.release`) and the doctor's leak,
free-list and bandwidth analyses, so that they count one stream the same way.

State (updated in O(1) per event; every counter read in O(1)):

- a block is *held* while at least one request holds it (``BlockAllocated``, ``PrefixHit`` and
  ``BlockDeduplicated`` add the request as a holder, ``BlockReleased`` removes it);
- *cached* once its last holder released it with ``cached=True``, until ``BlockEvicted``, a new
  allocation or a hit; *free* otherwise: ``free_blocks = num_blocks - held_blocks - cached_blocks``;
- ``holdings``: the sum over requests of the blocks each holds (a shared block counts once
  per holder: what attention reads per step);
- finished requests that still hold blocks, and how many blocks they hold.

Bad events, defined once here (counted in ``anomaly_counts`` by kind, never raised):

- ``double_release``: a request releases a block it does not hold and released earlier in the
  block's current allocation (since its last ``BlockAllocated``; the last
  :data:`RELEASERS_KEPT` releasers of a block are remembered); nothing else changes;
- ``release_unheld``: a request releases a block it does not hold and did not release before
  (also normal for blocks allocated before the stream was joined). When no request holds the
  block it takes the released state (cached with ``cached=True``: the engine says so);
- ``alloc_in_use``: a block is allocated while requests hold it: the engine reassigned it, so
  the previous holders lose it;
- ``evict_held``: a held block is evicted; it stays held (and leaves the cache).

Also, for the block facts (:mod:`kvdiag.pool.blockfacts`) and the forecast:

- ``evictions``: ``BlockEvicted`` events so far;
- *open* requests (``RequestArrived`` seen, no ``RequestFinished`` yet) with their
  ``BlockAllocated`` and ``PrefixHit`` events so far, summed in ``open_allocated`` /
  ``open_hits`` (the blocks the forecast counts as already taken by active requests);
- with :meth:`BlockLedger.track_holdings`, ``holdings`` after each of the latest block events
  (``ring_ts`` / ``ring_held``), for the holdings at an instant already passed.

:meth:`BlockLedger.apply_all` folds a batch in one loop (the common cases of the three block
events that make up ~97% of a busy engine's stream inlined; every other case goes through the
per-event methods, which define the rules) and hands every other event, after folding it,
to the caller's ``other``: ``kvdiag top``'s whole fold is this one loop. Long: that loop
repeats the per-event rules it inlines, and they stay beside each other, in one file, so that a
change to a rule is seen next to its copy (``tests/unit/test_ledger_batch.py`` holds the two
equal); the history offline analyses keep is :mod:`kvdiag.pool.block_history`.

Memory is flat over a long session: a request's entry goes when it holds nothing, anomalies
are counted (the first :data:`EXAMPLES_KEPT` of each kind are kept as examples). With
``keep_history=True`` (offline analyses of a finite log) the ledger also keeps a
:class:`~kvdiag.pool.block_history.BlockHistory` (``history``): one record per request and one
episode per block allocation, for ``kvdiag.diagnosis.leaks``' request and episode frames.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Optional

from kvdiag.events.schema import (BlockAllocated, BlockDeduplicated, BlockEvicted, BlockId, BlockReleased, Event, KVPoolInfo,
                           PrefixHit, RequestArrived, RequestFinished, RequestId)
from kvdiag.pool.block_history import BlockHistory

AnomalyKind = Literal["double_release", "release_unheld", "alloc_in_use", "evict_held"]
ANOMALY_KINDS: tuple[str, ...] = ("double_release", "release_unheld", "alloc_in_use", "evict_held")
EXAMPLES_KEPT = 20
"""Anomalies kept as examples per kind (the rest are counted)."""
RELEASERS_KEPT = 64
"""Releasers remembered per block allocation, to tell a double release from a release of an
unheld block (a block shared by more requests than this forgets its oldest releasers)."""
NEVER_NS = 1 << 63
"""``watch_ts`` when nothing is watched (later than any int64 event time)."""


@dataclass(frozen=True, slots=True)
class Anomaly:
    kind: AnomalyKind
    ts_ns: int
    block_id: BlockId
    request_id: Optional[RequestId] = None


class BlockLedger:
    """Feed events in time order with :meth:`apply` (one) or :meth:`apply_all` (a batch);
    read the counters and :meth:`held_by_finished`."""

    def __init__(self, keep_history: bool = False) -> None:
        self.keep_history = keep_history
        self.num_blocks: Optional[int] = None
        self.held: dict[RequestId, set] = {}  # request -> blocks it holds (requests holding >= 1)
        self.holders: dict[BlockId, object] = {}  # block -> its holder (a request id) or a set of them
        self.cached: dict[BlockId, None] = {}  # blocks held only by the prefix cache
        self.holdings = 0  # sum over requests of len(held[request])
        self.finished_holding: dict[RequestId, int] = {}  # finished requests still holding -> finished_ns
        self.finished_holding_blocks = 0  # sum of len(held[r]) over finished_holding
        self.finished_requests = 0  # RequestFinished events
        self.block_events = 0
        self.anomaly_counts: dict[str, int] = dict.fromkeys(ANOMALY_KINDS, 0)
        self.anomalies: list[Anomaly] = []  # all of them with keep_history, else EXAMPLES_KEPT per kind
        self.double_release_requests: set = set()  # requests that released a block twice
        self._released_by: dict[BlockId, object] = {}  # block -> releasers since its allocation
        self.last_ts_ns = 0  # the latest event folded by apply/apply_all
        self.evictions = 0  # BlockEvicted events
        self.bad_events = 0  # events apply_all could not fold (raised): counted and skipped
        self.open: dict[RequestId, list[int]] = {}  # arrived, not finished: [allocations, prefix hits]
        self.open_allocated = 0  # sums over self.open
        self.open_hits = 0
        self.ring_ts: Optional[deque] = None  # track_holdings: ts_ns and holdings after each block event
        self.ring_held: Optional[deque] = None
        # hooks: on_watch(ts) before the first block event, arrival or finish with ts_ns > watch_ts
        # (then watch_ts is read again); on_new_holder(request_id, ts) when a BlockAllocated makes
        # a request that held nothing a holder
        self.watch_ts = NEVER_NS
        self.on_watch: Optional[Callable[[int], None]] = None
        self.on_new_holder: Optional[Callable[[RequestId, int], None]] = None
        self.history: Optional[BlockHistory] = BlockHistory() if keep_history else None
        self._handlers = {
            BlockAllocated: self.allocated, PrefixHit: self.hit, BlockDeduplicated: self.hit,
            BlockReleased: self.released, BlockEvicted: self.evicted, RequestFinished: self.finished,
            KVPoolInfo: self._pool_info, RequestArrived: self._arrived}

    def track_holdings(self, ring_block_events: int) -> None:
        """Remember ``holdings`` after each of the latest ``ring_block_events`` block events."""
        self.ring_ts = deque(maxlen=ring_block_events)
        self.ring_held = deque(maxlen=ring_block_events)

    # ------------------------------------------------------------------ counters

    @property
    def held_blocks(self) -> int:
        """Distinct blocks held by at least one request."""
        return len(self.holders)

    @property
    def cached_blocks(self) -> int:
        """Blocks held only by the prefix cache."""
        return len(self.cached)

    @property
    def free_blocks(self) -> Optional[int]:
        """num_blocks - held - cached (None before a ``KVPoolInfo``)."""
        return None if self.num_blocks is None else self.num_blocks - len(self.holders) - len(self.cached)

    def blocks_of(self, request_id: RequestId) -> set:
        """The blocks ``request_id`` holds now (empty when none; do not modify)."""
        return self.held.get(request_id, _EMPTY)

    def held_by_finished(self, now_ns: int, grace_ns: int) -> dict[RequestId, list[BlockId]]:
        """Requests that finished at least ``grace_ns`` before ``now_ns`` and still hold
        blocks, with those blocks (sorted). O(such requests)."""
        cutoff = now_ns - grace_ns
        return {r: sorted(self.held[r]) for r, t in self.finished_holding.items() if t <= cutoff}

    def finished_holding_count(self, now_ns: int, grace_ns: int) -> tuple[int, int]:
        """(requests, blocks) of :meth:`held_by_finished` without building it."""
        cutoff = now_ns - grace_ns
        n = blocks = 0
        for r, t in self.finished_holding.items():
            if t <= cutoff:
                n += 1
                blocks += len(self.held[r])
        return n, blocks

    # ------------------------------------------------------------------ folding

    def apply(self, ev: Event) -> None:
        """Fold one event (other event types are ignored)."""
        t = type(ev)
        h = self._handlers.get(t)
        if h is not None:
            ts = ev.ts_ns
            if ts > self.watch_ts and t in _SETTLING:
                self.on_watch(ts)
            h(ev)
            if ts > self.last_ts_ns:
                self.last_ts_ns = ts

    def apply_all(self, events: Iterable[Event], other: Optional[Callable[[Event], None]] = None,
                  bucket_ns: int = 0, on_bucket: Optional[Callable[[int, int], None]] = None) -> None:
        """Fold a batch of events in order, as :meth:`apply` on each; ``other(ev)``: called after
        the ledger folded ``ev``, for every event but ``BlockAllocated``, ``BlockReleased`` and
        ``BlockEvicted``; ``on_bucket(idx, n)``: ``n`` consecutive events had ``ts_ns //
        bucket_ns == idx`` (called when the bucket changes and at the end). An event that
        raises is counted in ``bad_events`` and skipped (the rest of it unfolded).

        The common case of each of those three block events is inlined (the per-event methods
        handle every other case and define the rules; tests check the two agree), and the
        counters they move are kept in locals, written back before anything else runs
        (a method, a hook, ``other``, ``on_bucket``): that is what makes the loop cheap. Long:
        one loop with its locals is the point (a call per event would cost what it saves; the
        live fold's goal is 1 M events/s on one core)."""
        ALLOC, REL, EVICT = BlockAllocated, BlockReleased, BlockEvicted
        settling = _SETTLING
        handlers = self._handlers
        holders, held, cached, released_by = self.holders, self.held, self.cached, self._released_by
        fh, opened = self.finished_holding, self.open
        ring = self.ring_ts is not None
        if ring:
            ring_ts, ring_held = self.ring_ts.append, self.ring_held.append
        slow = self.keep_history  # the history is written by the per-event methods
        watch = self.watch_ts
        bucket_ns = bucket_ns or NEVER_NS
        cur, run = None, 0
        lo = hi = 0  # the current bucket's [lo, hi)
        last = self.last_ts_ns
        hold = self.holdings  # written back before any call out
        nb = nev = noa = 0  # block events, evictions, open requests' allocations not yet added
        for ev in events:
            try:
                t = type(ev)
                ts = ev.ts_ns
                if not lo <= ts < hi:  # another bucket (one division per bucket, not per event)
                    idx = ts // bucket_ns
                    lo = idx * bucket_ns
                    hi = lo + bucket_ns
                    if run and on_bucket is not None:
                        self.holdings, self.block_events, self.evictions, self.open_allocated = \
                            hold, self.block_events + nb, self.evictions + nev, self.open_allocated + noa
                        nb = nev = noa = 0
                        try:
                            on_bucket(cur, run)
                        finally:
                            hold = self.holdings
                    cur, run = idx, 0
                run += 1
                if ts > watch and t in settling:
                    self.holdings, self.block_events, self.evictions, self.open_allocated = \
                        hold, self.block_events + nb, self.evictions + nev, self.open_allocated + noa
                    nb = nev = noa = 0
                    try:
                        self.on_watch(ts)
                    finally:
                        hold = self.holdings
                        watch = self.watch_ts
                if t is REL:
                    if ts > last:  # the latest event the ledger folds
                        last = ts
                    b, rid, keep = ev.block_id, ev.request_id, ev.cached
                    prev = holders.get(b)
                    if slow or prev is None or prev != rid:  # shared, not held by it, history
                        self.holdings, self.block_events, self.evictions, self.open_allocated = \
                            hold, self.block_events + nb, self.evictions + nev, self.open_allocated + noa
                        nb = nev = noa = 0
                        try:
                            self.released(ev)
                        finally:
                            hold = self.holdings
                        continue
                    # its only holder lets it go (released(), _drop())
                    nb += 1
                    hold -= 1
                    blocks = held[rid]
                    blocks.discard(b)
                    if rid in fh:
                        self.finished_holding_blocks -= 1
                        if not blocks:
                            del fh[rid]
                    if not blocks:
                        del held[rid]
                    del holders[b]
                    if keep:
                        cached[b] = None
                    if b in released_by:
                        self._released(b, rid)
                    else:
                        released_by[b] = rid
                    if ring:
                        ring_ts(ts)
                        ring_held(hold)
                elif t is ALLOC:
                    if ts > last:  # the latest event the ledger folds
                        last = ts
                    b, rid = ev.block_id, ev.request_id
                    if slow or b in holders or rid not in held:  # reassigned while held, history, new holder
                        self.holdings, self.block_events, self.evictions, self.open_allocated = \
                            hold, self.block_events + nb, self.evictions + nev, self.open_allocated + noa
                        nb = nev = noa = 0
                        try:
                            self.allocated(ev)
                        finally:
                            hold = self.holdings
                        continue
                    # a block no request held, for a request that holds others (allocated())
                    nb += 1
                    hold += 1
                    cached.pop(b, None)
                    released_by.pop(b, None)
                    holders[b] = rid
                    held[rid].add(b)
                    if rid in fh:
                        self.finished_holding_blocks += 1
                    counts = opened.get(rid)
                    if counts is not None:
                        counts[0] += 1
                        noa += 1
                    if ring:
                        ring_ts(ts)
                        ring_held(hold)
                elif t is EVICT:
                    if ts > last:  # the latest event the ledger folds
                        last = ts
                    b = ev.block_id
                    if slow or b in holders:  # evict_held
                        self.holdings, self.block_events, self.evictions, self.open_allocated = \
                            hold, self.block_events + nb, self.evictions + nev, self.open_allocated + noa
                        nb = nev = noa = 0
                        try:
                            self.evicted(ev)
                        finally:
                            hold = self.holdings
                        continue
                    nb += 1  # (evicted())
                    nev += 1
                    cached.pop(b, None)
                    if ring:
                        ring_ts(ts)
                        ring_held(hold)
                else:
                    self.holdings, self.block_events, self.evictions, self.open_allocated = \
                        hold, self.block_events + nb, self.evictions + nev, self.open_allocated + noa
                    nb = nev = noa = 0
                    try:
                        h = handlers.get(t)
                        if h is not None:
                            h(ev)
                            if ts > last:
                                last = ts
                        if other is not None:
                            other(ev)
                    finally:
                        hold = self.holdings
                        watch = self.watch_ts
            except Exception:  # one malformed event costs its own figures, not the fold
                self.bad_events += 1
        self.holdings, self.block_events, self.evictions, self.open_allocated = \
            hold, self.block_events + nb, self.evictions + nev, self.open_allocated + noa
        if run and on_bucket is not None:
            on_bucket(cur, run)
        if last > self.last_ts_ns:
            self.last_ts_ns = last

    def _anomaly(self, kind: str, ts_ns: int, block_id: BlockId, request_id: Optional[RequestId]) -> None:
        n = self.anomaly_counts[kind]
        self.anomaly_counts[kind] = n + 1
        if n < EXAMPLES_KEPT or self.keep_history:
            self.anomalies.append(Anomaly(kind, ts_ns, block_id, request_id))

    def _arrived(self, ev: RequestArrived) -> None:
        self.open.setdefault(ev.request_id, [0, 0])
        if self.history is not None:
            self.history.record(ev.request_id).arrived_ns = ev.ts_ns

    def _pool_info(self, ev: KVPoolInfo) -> None:
        self.num_blocks = ev.num_blocks

    def _take(self, rid: RequestId, b: BlockId) -> bool:
        """Make ``rid`` a holder of ``b``; False when it already held it."""
        blocks = self.held.get(rid)
        if blocks is None:
            self.held[rid] = {b}
        elif b in blocks:
            return False
        else:
            blocks.add(b)
        self.holdings += 1
        if rid in self.finished_holding:
            self.finished_holding_blocks += 1
        return True

    def _drop(self, rid: RequestId, b: BlockId) -> None:
        """``rid`` no longer holds ``b`` (it did)."""
        blocks = self.held[rid]
        blocks.discard(b)
        self.holdings -= 1
        fh = self.finished_holding
        if rid in fh:
            self.finished_holding_blocks -= 1
            if not blocks:
                del fh[rid]
        if not blocks:
            del self.held[rid]

    def allocated(self, ev: BlockAllocated) -> None:
        b, rid, ts = ev.block_id, ev.request_id, ev.ts_ns
        self.block_events += 1
        prev = self.holders.get(b)
        if prev is not None:  # reassigned while held: the previous holders lose it
            self._anomaly("alloc_in_use", ts, b, rid)
            for r in (list(prev) if type(prev) is set else (prev,)):
                self._drop(r, b)
        self.cached.pop(b, None)
        self._released_by.pop(b, None)
        self.holders[b] = rid
        blocks = self.held.get(rid)
        if blocks is None:
            self.held[rid] = {b}
            self.holdings += 1
            if self.on_new_holder is not None:
                self.on_new_holder(rid, ts)
        elif b not in blocks:
            blocks.add(b)
            self.holdings += 1
        if rid in self.finished_holding:
            self.finished_holding_blocks += 1
        counts = self.open.get(rid)
        if counts is not None:
            counts[0] += 1
            self.open_allocated += 1
        self._ring(ts)
        if self.history is not None:
            self.history.allocated(ev)

    def _ring(self, ts_ns: int) -> None:
        if self.ring_ts is not None:
            self.ring_ts.append(ts_ns)
            self.ring_held.append(self.holdings)

    def hit(self, ev: PrefixHit | BlockDeduplicated) -> None:
        """``PrefixHit`` and ``BlockDeduplicated``: the request now holds ``block_id``."""
        b, rid = ev.block_id, ev.request_id
        self.block_events += 1
        if self._take(rid, b):
            prev = self.holders.get(b)
            if prev is None:
                self.holders[b] = rid
                self.cached.pop(b, None)
            elif type(prev) is set:
                prev.add(rid)
            else:
                self.holders[b] = {prev, rid}
        rel = self._released_by.get(b)
        if rel is not None:
            if type(rel) is dict:
                rel.pop(rid, None)
            elif rel == rid:
                del self._released_by[b]
        if type(ev) is PrefixHit:
            counts = self.open.get(rid)
            if counts is not None:
                counts[1] += 1
                self.open_hits += 1
        self._ring(ev.ts_ns)
        if self.history is not None:
            self.history.hit(ev)

    def released(self, ev: BlockReleased) -> None:
        b, rid = ev.block_id, ev.request_id
        self.block_events += 1
        holders = self.holders
        prev = holders.get(b)
        if prev is None or (prev != rid if type(prev) is not set else rid not in prev):
            self._bad_release(ev, prev)
            self._ring(ev.ts_ns)
            return
        self._drop(rid, b)
        if type(prev) is set:
            prev.discard(rid)
            if len(prev) == 1:
                holders[b] = next(iter(prev))
            last = False
        else:
            del holders[b]
            last = True
        if last and ev.cached:
            self.cached[b] = None
        self._released(b, rid)
        self._ring(ev.ts_ns)
        if self.history is not None:
            self.history.released(ev, last)

    def _released(self, b: BlockId, rid: RequestId) -> None:
        """Remember ``rid`` among the releasers of ``b``'s current allocation."""
        rel = self._released_by.get(b)
        if rel is None:
            self._released_by[b] = rid
        elif type(rel) is dict:
            rel[rid] = None
            if len(rel) > RELEASERS_KEPT:
                del rel[next(iter(rel))]
        else:
            self._released_by[b] = {rel: None, rid: None}

    def _bad_release(self, ev: BlockReleased, prev: object) -> None:
        b, rid = ev.block_id, ev.request_id
        rel = self._released_by.get(b)
        if rel is not None and (rel == rid if type(rel) is not dict else rid in rel):
            self._anomaly("double_release", ev.ts_ns, b, rid)
            self.double_release_requests.add(rid)
            if self.history is not None:
                self.history.record(rid).double_releases += 1
            return
        self._anomaly("release_unheld", ev.ts_ns, b, rid)
        if prev is None and ev.cached:  # not held by anyone we know of: the engine caches it
            self.cached[b] = None

    def evicted(self, ev: BlockEvicted) -> None:
        b = ev.block_id
        self.block_events += 1
        self.evictions += 1
        if b in self.holders:
            self._anomaly("evict_held", ev.ts_ns, b, None)
        self.cached.pop(b, None)
        self._ring(ev.ts_ns)
        if self.history is not None:
            self.history.evicted(ev)

    def finished(self, ev: RequestFinished) -> None:
        rid = ev.request_id
        self.finished_requests += 1
        counts = self.open.pop(rid, None)
        if counts is not None:
            self.open_allocated -= counts[0]
            self.open_hits -= counts[1]
        blocks = self.held.get(rid)
        if blocks and rid not in self.finished_holding:
            self.finished_holding[rid] = ev.ts_ns
            self.finished_holding_blocks += len(blocks)
        if self.history is not None:
            self.history.finished(ev)


_EMPTY: frozenset = frozenset()
_SETTLING = frozenset((BlockAllocated, PrefixHit, BlockDeduplicated, BlockReleased, BlockEvicted, RequestArrived,
                       RequestFinished))
"""The events that trigger ``on_watch``."""
