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
  (``ring_ts`` / ``ring_held``), for the holdings at an instant already passed;
- with :meth:`BlockLedger.log_dropped`, the ids of blocks whose content left the prefix cache
  (``BlockEvicted``, and ``BlockReleased`` with ``cached`` false) until
  :meth:`BlockLedger.take_dropped` (the miss-cause fold's evidence that the engine let content go).

:meth:`BlockLedger.apply_all` folds a batch in one loop (the common cases of the three block
events that make up ~97% of a busy engine's stream inlined; every other case goes through the
per-event methods, which define the rules) and hands every other event, after folding it,
to the caller's ``other``: ``kvdiag top``'s whole fold is this one loop. Long: that loop
repeats the per-event rules it inlines, and they stay beside each other, in one file, so that a
change to a rule is seen next to its copy (``tests/unit/test_ledger_batch.py`` holds the two
equal); the history offline analyses keep is :mod:`kvdiag.pool.block_history`.

Block state is kept in lists indexed by block id (an engine's ids are its pool's indices
``0..num_blocks-1``): a list read is a fraction of a dict lookup's cost, and a pool of 20,000
blocks keeps each list in 160 KB. The lists grow as ids arrive; an id that is not such an index
(negative, not an int, or beyond :data:`DENSE_IDS`) switches the ledger to ids mapped to list
slots through a dict, every block event then taking the per-event methods. ``holders``,
``cached`` and ``released_by`` are dict views built on request (do not modify).

Memory is flat over a long session: a request's entry goes when it holds nothing, anomalies
are counted (the first :data:`EXAMPLES_KEPT` of each kind are kept as examples). With
``keep_history=True`` (offline analyses of a finite log) the ledger also keeps a
:class:`~kvdiag.pool.block_history.BlockHistory` (``history``): one record per request and one
episode per block allocation, for ``kvdiag.diagnosis.leaks``' request and episode frames.
"""

from __future__ import annotations

import operator
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
DENSE_IDS = 1 << 22
"""Block ids below this index the ledger's lists directly (4 M: more blocks than any pool); a
larger, negative or non-integer id maps every id through a dict from then on."""


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
        # by block slot (the block id itself, module docstring): None, its holder (a request
        # id) or a set of them; True while held only by the prefix cache; None, its releaser
        # since its allocation or a dict of them
        self._holder: list = []
        self._cached: list = []
        self._relby: list = []
        self._ids: Optional[dict] = None  # block id -> slot, once ids are mapped (else the id is the slot)
        self._id_of: list = []  # slot -> block id, once mapped
        self.held_blocks = 0  # distinct blocks held by at least one request
        self.cached_blocks = 0  # blocks held only by the prefix cache
        self.holdings = 0  # sum over requests of len(held[request])
        self.finished_holding: dict[RequestId, int] = {}  # finished requests still holding -> finished_ns
        self.finished_holding_blocks = 0  # sum of len(held[r]) over finished_holding
        self.finished_requests = 0  # RequestFinished events
        self.block_events = 0
        self.anomaly_counts: dict[str, int] = dict.fromkeys(ANOMALY_KINDS, 0)
        self.anomalies: list[Anomaly] = []  # all of them with keep_history, else EXAMPLES_KEPT per kind
        self.double_release_requests: set = set()  # requests that released a block twice
        self.last_ts_ns = 0  # the latest event folded by apply/apply_all
        self.evictions = 0  # BlockEvicted events
        self.bad_events = 0  # events apply_all could not fold (raised): counted and skipped
        self.open: dict[RequestId, list[int]] = {}  # arrived, not finished: [allocations, prefix hits]
        self.open_allocated = 0  # sums over self.open
        self.open_hits = 0
        self.ring_ts: Optional[deque] = None  # track_holdings: ts_ns and holdings after each block event
        self.dropped_log: Optional[list] = None  # log_dropped: block ids whose content left, not yet taken
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

    def log_dropped(self) -> None:
        """From now on, keep the block id of each ``BlockEvicted`` and of each ``BlockReleased``
        with ``cached`` false (the block left the prefix cache: transformers on a preemption)
        until :meth:`take_dropped` (the miss-cause fold's evidence that the engine let a block's
        content go)."""
        if self.dropped_log is None:
            self.dropped_log = []

    def take_dropped(self) -> list:
        """The block ids whose content left since the last call (oldest first), given up by the
        ledger."""
        log = self.dropped_log
        if not log:
            return []
        self.dropped_log = []
        return log

    def track_holdings(self, ring_block_events: int) -> None:
        """Remember ``holdings`` after each of the latest ``ring_block_events`` block events."""
        self.ring_ts = deque(maxlen=ring_block_events)
        self.ring_held = deque(maxlen=ring_block_events)

    # ------------------------------------------------------------------ counters

    @property
    def free_blocks(self) -> Optional[int]:
        """num_blocks - held - cached (None before a ``KVPoolInfo``)."""
        return None if self.num_blocks is None else self.num_blocks - self.held_blocks - self.cached_blocks

    @property
    def holders(self) -> dict[BlockId, object]:
        """Block -> its holder (a request id) or the set of them, for the blocks held (a view
        built now: O(blocks))."""
        return self._view(self._holder)

    @property
    def cached(self) -> dict[BlockId, None]:
        """The blocks held only by the prefix cache (a view built now: O(blocks))."""
        return dict.fromkeys(self._view(self._cached))

    @property
    def released_by(self) -> dict[BlockId, object]:
        """Block -> its releaser since its allocation or a dict of them (a view built now)."""
        return self._view(self._relby)

    def _view(self, column: list) -> dict:
        ids = self._id_of if self._ids is not None else range(len(column))
        return {ids[i]: v for i, v in enumerate(column) if v is not None and v is not False}

    # ------------------------------------------------------------------ block slots

    def _slot(self, block_id) -> int:
        """The lists' index of ``block_id``, grown to hold it (module docstring)."""
        ids = self._ids
        if ids is None:
            try:
                b = operator.index(block_id)
            except TypeError:
                b = -1
            if 0 <= b < len(self._holder):
                return b
            limit = self._dense_limit()
            if 0 <= b < limit:
                self._extend(min(max(b + 1, 2 * len(self._holder), 1024), limit) - len(self._holder))
                return b
            hash(block_id)  # an unhashable id raises here, before the switch (a bad event)
            ids = self._map_ids()
        slot = ids.get(block_id)
        if slot is None:
            slot = ids[block_id] = len(self._holder)
            self._id_of.append(block_id)
            self._extend(1)
        return slot

    def _extend(self, n: int) -> None:
        self._holder.extend([None] * n)
        self._cached.extend([False] * n)
        self._relby.extend([None] * n)

    def _dense_limit(self) -> int:
        """Ids below this are taken for pool indices: twice the pool (transformers numbers its
        pages after two reserved ones) and at least 65,536, at most :data:`DENSE_IDS`."""
        if self.num_blocks is None:
            return DENSE_IDS
        return min(DENSE_IDS, max(2 * self.num_blocks, 1 << 16))

    def _map_ids(self) -> dict:
        """From now on every id through a dict: the ids so far keep their slots (those of
        blocks with any state are mapped; an empty slot's id gets a new, empty one)."""
        holder, cached, relby = self._holder, self._cached, self._relby
        self._ids = {i: i for i in range(len(holder))
                     if holder[i] is not None or cached[i] or relby[i] is not None}
        self._id_of = list(range(len(holder)))
        return self._ids

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
        counters they move are kept in locals, written back (:meth:`_write_back`) before
        anything else runs (a method, a hook, ``other``, ``on_bucket``): that is what makes the
        loop cheap. Long: one loop with its locals is the point (a call per event would cost
        what it saves; the live fold's goal is 1 M events/s on one core)."""
        ALLOC, REL, EVICT, INT = BlockAllocated, BlockReleased, BlockEvicted, int
        settling = _SETTLING
        handlers = self._handlers
        holder, cached, relby, held = self._holder, self._cached, self._relby, self.held
        fh, opened = self.finished_holding, self.open
        ring = self.ring_ts is not None
        if ring:
            ring_ts, ring_held = self.ring_ts.append, self.ring_held.append
        slow = self.keep_history  # the history is written by the per-event methods
        elog = self.dropped_log  # log_dropped (re-read after any call out: take_dropped swaps it)
        n = self._fast_slots()  # block ids below n are their own slots
        watch = self.watch_ts
        bucket_ns = bucket_ns or NEVER_NS
        cur, run = None, 0
        lo = hi = 0  # the current bucket's [lo, hi)
        last = self.last_ts_ns
        hold = self.holdings  # written back before any call out
        # block events, evictions, open requests' allocations, held and cached blocks: not yet added
        nb = nev = noa = nh = nc = 0
        for ev in events:
            try:
                t = type(ev)
                ts = ev.ts_ns
                if not lo <= ts < hi:  # another bucket (one division per bucket, not per event)
                    idx = ts // bucket_ns
                    lo = idx * bucket_ns
                    hi = lo + bucket_ns
                    if run and on_bucket is not None:
                        self._write_back(hold, nb, nev, noa, nh, nc)
                        nb = nev = noa = nh = nc = 0
                        try:
                            on_bucket(cur, run)
                        finally:
                            hold = self.holdings
                            elog = self.dropped_log
                    cur, run = idx, 0
                run += 1
                if ts > watch and t in settling:
                    self._write_back(hold, nb, nev, noa, nh, nc)
                    nb = nev = noa = nh = nc = 0
                    try:
                        self.on_watch(ts)
                    finally:
                        hold = self.holdings
                        elog = self.dropped_log
                        watch = self.watch_ts
                if t is REL:
                    if ts > last:  # the latest event the ledger folds
                        last = ts
                    b, rid, keep = ev.block_id, ev.request_id, ev.cached
                    # shared, not held by it, history, or a block id that is not its own slot
                    if slow or type(b) is not INT or not 0 <= b < n or holder[b] is None or holder[b] != rid:
                        self._write_back(hold, nb, nev, noa, nh, nc)
                        nb = nev = noa = nh = nc = 0
                        try:
                            self.released(ev)
                        finally:
                            hold = self.holdings
                            elog = self.dropped_log
                            n = self._fast_slots()
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
                    holder[b] = None
                    nh -= 1
                    if keep and not cached[b]:
                        cached[b] = True
                        nc += 1
                    elif not keep and elog is not None:  # its content left the cache (released())
                        elog.append(b)
                    if relby[b] is None:
                        relby[b] = rid
                    else:
                        self._released(b, rid)
                    if ring:
                        ring_ts(ts)
                        ring_held(hold)
                elif t is ALLOC:
                    if ts > last:  # the latest event the ledger folds
                        last = ts
                    b, rid = ev.block_id, ev.request_id
                    # reassigned while held, history, a new holder, or an id that is not its slot
                    if slow or type(b) is not INT or not 0 <= b < n or holder[b] is not None or rid not in held:
                        self._write_back(hold, nb, nev, noa, nh, nc)
                        nb = nev = noa = nh = nc = 0
                        try:
                            self.allocated(ev)
                        finally:
                            hold = self.holdings
                            elog = self.dropped_log
                            n = self._fast_slots()
                        continue
                    # a block no request held, for a request that holds others (allocated())
                    nb += 1
                    hold += 1
                    if cached[b]:
                        cached[b] = False
                        nc -= 1
                    relby[b] = None
                    holder[b] = rid
                    nh += 1
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
                    if slow or type(b) is not INT or not 0 <= b < n or holder[b] is not None:  # evict_held
                        self._write_back(hold, nb, nev, noa, nh, nc)
                        nb = nev = noa = nh = nc = 0
                        try:
                            self.evicted(ev)
                        finally:
                            hold = self.holdings
                            elog = self.dropped_log
                            n = self._fast_slots()
                        continue
                    nb += 1  # (evicted())
                    nev += 1
                    if elog is not None:
                        elog.append(b)
                    if cached[b]:
                        cached[b] = False
                        nc -= 1
                    if ring:
                        ring_ts(ts)
                        ring_held(hold)
                else:
                    self._write_back(hold, nb, nev, noa, nh, nc)
                    nb = nev = noa = nh = nc = 0
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
                        elog = self.dropped_log
                        watch = self.watch_ts
                        n = self._fast_slots()
            except Exception:  # one malformed event costs its own figures, not the fold
                self.bad_events += 1
        self._write_back(hold, nb, nev, noa, nh, nc)
        if run and on_bucket is not None:
            on_bucket(cur, run)
        if last > self.last_ts_ns:
            self.last_ts_ns = last

    def _write_back(self, holdings: int, block_events: int, evictions: int, open_allocated: int,
                    held_blocks: int, cached_blocks: int) -> None:
        """:meth:`apply_all`'s locals into the counters (``holdings`` as is, the rest added)."""
        self.holdings = holdings
        self.block_events += block_events
        self.evictions += evictions
        self.open_allocated += open_allocated
        self.held_blocks += held_blocks
        self.cached_blocks += cached_blocks

    def _fast_slots(self) -> int:
        """Block ids below this are their own slots in the lists (0 once ids are mapped)."""
        return len(self._holder) if self._ids is None else 0

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
        i = self._slot(b)
        self.block_events += 1
        prev = self._holder[i]
        if prev is not None:  # reassigned while held: the previous holders lose it
            self._anomaly("alloc_in_use", ts, b, rid)
            for r in (list(prev) if type(prev) is set else (prev,)):
                self._drop(r, b)
        else:
            self.held_blocks += 1
        self._uncache(i)
        self._relby[i] = None
        self._holder[i] = rid
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

    def _cache(self, i: int) -> None:
        if not self._cached[i]:
            self._cached[i] = True
            self.cached_blocks += 1

    def _uncache(self, i: int) -> None:
        if self._cached[i]:
            self._cached[i] = False
            self.cached_blocks -= 1

    def hit(self, ev: PrefixHit | BlockDeduplicated) -> None:
        """``PrefixHit`` and ``BlockDeduplicated``: the request now holds ``block_id``."""
        b, rid = ev.block_id, ev.request_id
        i = self._slot(b)
        self.block_events += 1
        if self._take(rid, b):
            prev = self._holder[i]
            if prev is None:
                self._holder[i] = rid
                self.held_blocks += 1
                self._uncache(i)
            elif type(prev) is set:
                prev.add(rid)
            else:
                self._holder[i] = {prev, rid}
        rel = self._relby[i]
        if rel is not None:
            if type(rel) is dict:
                rel.pop(rid, None)
            elif rel == rid:
                self._relby[i] = None
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
        i = self._slot(b)
        self.block_events += 1
        if not ev.cached and self.dropped_log is not None:  # its content left the cache
            self.dropped_log.append(b)
        prev = self._holder[i]
        if prev is None or (prev != rid if type(prev) is not set else rid not in prev):
            self._bad_release(ev, prev, i)
            self._ring(ev.ts_ns)
            return
        self._drop(rid, b)
        if type(prev) is set:
            prev.discard(rid)
            if len(prev) == 1:
                self._holder[i] = next(iter(prev))
            last = False
        else:
            self._holder[i] = None
            self.held_blocks -= 1
            last = True
        if last and ev.cached:
            self._cache(i)
        self._released(i, rid)
        self._ring(ev.ts_ns)
        if self.history is not None:
            self.history.released(ev, last)

    def _released(self, i: int, rid: RequestId) -> None:
        """Remember ``rid`` among the releasers of the current allocation of the block in slot ``i``."""
        rel = self._relby[i]
        if rel is None:
            self._relby[i] = rid
        elif type(rel) is dict:
            rel[rid] = None
            if len(rel) > RELEASERS_KEPT:
                del rel[next(iter(rel))]
        else:
            self._relby[i] = {rel: None, rid: None}

    def _bad_release(self, ev: BlockReleased, prev: object, i: int) -> None:
        b, rid = ev.block_id, ev.request_id
        rel = self._relby[i]
        if rel is not None and (rel == rid if type(rel) is not dict else rid in rel):
            self._anomaly("double_release", ev.ts_ns, b, rid)
            self.double_release_requests.add(rid)
            if self.history is not None:
                self.history.record(rid).double_releases += 1
            return
        self._anomaly("release_unheld", ev.ts_ns, b, rid)
        if prev is None and ev.cached:  # not held by anyone we know of: the engine caches it
            self._cache(i)

    def evicted(self, ev: BlockEvicted) -> None:
        b = ev.block_id
        i = self._slot(b)
        self.block_events += 1
        self.evictions += 1
        if self._holder[i] is not None:
            self._anomaly("evict_held", ev.ts_ns, b, None)
        if self.dropped_log is not None:
            self.dropped_log.append(b)
        self._uncache(i)
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
