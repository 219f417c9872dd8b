"""What the engine's own block events say about content it missed: which content (the engine's
block hash) each block id stores (``BlockStored``); which of those contents the engine let go
(``BlockEvicted``, or ``BlockReleased`` not kept cached: fed to :meth:`EngineRecompute.evicted`
or taken from a live ledger that folds those events); and, for a store, whether its content had
been let go since it was last stored (a recompute after an eviction: a pool under pressure) or
whether no block held it when the storing request was looked up (a request in flight was still
computing it). The miss causes (:mod:`kvdiag.diagnosis.miss_causes`) call such blocks
``evicted`` and ``in_flight``.

Memory: per block id the hash it stores, per hash held its block count and since when, and the
last :data:`MAX_EVICTED_HASHES` hashes the engine let go (until stored again; the oldest
forgotten first).
"""

from __future__ import annotations

from typing import Optional

from kvdiag.pool.blockledger import BlockLedger

MAX_EVICTED_HASHES = 1 << 17

HELD, RESTORED_EVICTED, NOT_HELD = 0, 1, 2
"""What :meth:`EngineRecompute.stored` says of a store: another block held the content when the
request was looked up; its content had been let go since it was last stored; no block held it
when the request was looked up (nor was it let go since)."""


class EngineRecompute:
    """``ledger``: a live ledger that folds the same stream's block events (the content it let
    go is taken from its log, :meth:`BlockLedger.log_dropped`, at each store and whenever
    :meth:`take_dropped` is called); None: feed it to :meth:`evicted`."""

    def __init__(self, ledger: Optional[BlockLedger] = None) -> None:
        self._ledger = ledger
        self._stored_hash: dict = {}  # block id -> the engine's hash of the content it stores
        self._held: dict = {}  # hash -> [blocks storing it, since when one has (ns)]
        self._evicted_hashes: dict = {}  # hashes whose block the engine let go, not stored since

    def clear(self) -> None:
        """A new pool: its block ids name other blocks."""
        self._stored_hash.clear()
        self._held.clear()
        self._evicted_hashes.clear()

    def stored(self, block_id, block_hash, ts_ns: int, lookup_ns: Optional[int] = None) -> int:
        """Note that ``block_id`` stores ``block_hash`` since ``ts_ns``; returns
        :data:`RESTORED_EVICTED` when the engine had stored the same content before and let it go
        since, else :data:`HELD` when another block has held it since ``lookup_ns`` or before
        (the storing request's lookup; None: this store's time), else :data:`NOT_HELD`."""
        if self._ledger is not None:
            self._ledger.log_dropped()  # from the first store on: stored content let go
            self.take_dropped()
        held = self._held.get(block_hash)
        code = HELD if held is not None and held[1] <= (ts_ns if lookup_ns is None else lookup_ns) else NOT_HELD
        old = self._stored_hash.get(block_id)
        if old is not None:  # stored again with no eviction seen: no longer holds the old content
            self._release(old)
        self._stored_hash[block_id] = block_hash
        if held is None:
            self._held[block_hash] = [1, ts_ns]
        else:
            held[0] += 1
        if block_hash in self._evicted_hashes:
            del self._evicted_hashes[block_hash]
            return RESTORED_EVICTED
        return code

    def adopted(self, block_hash, lookup_ns: int) -> int:
        """A request filled a block and adopted the engine's block of the same content instead
        (``BlockDeduplicated``): :data:`HELD` when that block held it since ``lookup_ns`` (the
        request's lookup) or before, else :data:`NOT_HELD`."""
        held = self._held.get(block_hash)
        return HELD if held is not None and held[1] <= lookup_ns else NOT_HELD

    def take_dropped(self) -> None:
        """The content the ledger saw let go so far (none without a ledger)."""
        if self._ledger is not None and self._ledger.dropped_log:
            for b in self._ledger.take_dropped():
                self.evicted(b)

    def evicted(self, block_id) -> None:
        """The engine let ``block_id``'s content go (its ``BlockEvicted``, or a ``BlockReleased``
        not kept cached)."""
        h = self._stored_hash.pop(block_id, None)
        if h is not None:
            self._release(h)
            self._evicted_hashes[h] = None
            if len(self._evicted_hashes) > MAX_EVICTED_HASHES:
                del self._evicted_hashes[next(iter(self._evicted_hashes))]

    def _release(self, block_hash) -> None:
        held = self._held.get(block_hash)
        if held is not None:
            held[0] -= 1
            if not held[0]:
                del self._held[block_hash]
