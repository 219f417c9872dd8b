"""An independent count of the engine's own evidence of evictions, for the miss-cause tests."""

from __future__ import annotations

from kvdiag.events.schema import BlockEvicted, BlockStored


def recomputed_after_eviction(events) -> int:
    """Blocks the engine stored again under a hash whose earlier block it had evicted in between
    (its ``BlockStored`` and ``BlockEvicted`` events, read directly: not through the fold)."""
    block_hash, gone, recomputed = {}, set(), 0
    for e in events:
        if isinstance(e, BlockStored):
            recomputed += e.block_hash in gone
            gone.discard(e.block_hash)
            block_hash[e.block_id] = e.block_hash
        elif isinstance(e, BlockEvicted) and e.block_id in block_hash:
            gone.add(block_hash.pop(e.block_id))
    return recomputed
