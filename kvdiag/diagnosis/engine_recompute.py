"""The engine's own evidence that it recomputed content it had evicted: which content (the
engine's block hash) each block id stores (``BlockStored``), which of those contents the engine
evicted (``BlockEvicted``, fed here or taken from a live ledger that folds those events), and
whether a store is of content evicted since it was last stored. The miss causes
(:mod:`kvdiag.diagnosis.miss_causes`) call such a block ``evicted``: a pool under pressure.

Memory: per block id the hash it stores, and the last :data:`MAX_EVICTED_HASHES` hashes the
engine evicted (until stored again; the oldest forgotten first).
"""

from __future__ import annotations

from typing import Optional

from kvdiag.pool.blockledger import BlockLedger

MAX_EVICTED_HASHES = 1 << 17


class EngineRecompute:
    """``ledger``: a live ledger that folds the same stream's ``BlockEvicted`` events (the
    evictions are taken from its log, :meth:`BlockLedger.log_evictions`, at each store and
    whenever :meth:`take_evictions` is called); None: feed them to :meth:`evicted`."""

    def __init__(self, ledger: Optional[BlockLedger] = None) -> None:
        self._ledger = ledger
        self._stored_hash: dict = {}  # block id -> the engine's hash of the content it stores
        self._evicted_hashes: dict = {}  # hashes whose block the engine evicted, not stored since

    def clear(self) -> None:
        """A new pool: its block ids name other blocks."""
        self._stored_hash.clear()
        self._evicted_hashes.clear()

    def stored(self, block_id, block_hash) -> bool:
        """Note that ``block_id`` stores ``block_hash`` now; True when the engine had stored the
        same content before and evicted it since (a recompute after an eviction)."""
        if self._ledger is not None:
            self._ledger.log_evictions()  # from the first store on: evictions of stored content
            self.take_evictions()
        self._stored_hash[block_id] = block_hash
        if block_hash in self._evicted_hashes:
            del self._evicted_hashes[block_hash]
            return True
        return False

    def take_evictions(self) -> None:
        """The ledger's evictions so far (none without a ledger)."""
        if self._ledger is not None and self._ledger.evicted_log:
            for b in self._ledger.take_evictions():
                self.evicted(b)

    def evicted(self, block_id) -> None:
        """The engine evicted ``block_id`` (its ``BlockEvicted``)."""
        h = self._stored_hash.pop(block_id, None)
        if h is not None:
            self._evicted_hashes[h] = None
            if len(self._evicted_hashes) > MAX_EVICTED_HASHES:
                del self._evicted_hashes[next(iter(self._evicted_hashes))]
