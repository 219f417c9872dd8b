"""Independent counts of the engine's own evidence about missed prompt blocks, read directly from
its events (not through the miss-cause fold), for the miss-cause tests."""

from __future__ import annotations

from kvdiag.events.schema import (BlockDeduplicated, BlockEvicted, BlockReleased, BlockStored, KVPoolInfo,
                                  RequestArrived, RequestFinished, RequestPreempted, RequestScheduled)


def let_go(e) -> bool:
    """The event says a block's content left the engine's prefix cache: evicted, or released
    without being kept cached (transformers, on a preemption)."""
    return isinstance(e, BlockEvicted) or isinstance(e, BlockReleased) and not e.cached


def _missed_computed_blocks(events, cached_at_first_admission: bool):
    """Per finished request, the missed prompt blocks it computed: its ``BlockStored`` and
    ``BlockDeduplicated`` in order from block ``cached // B``, within its prompt's full blocks
    (a block-aligned prompt's last one left out); a preempted request's are left out where the
    engine counts cached tokens at the last admission (transformers: the miss is the
    preemption's). Yields (missed tokens of the block, restored: stored under a hash whose
    earlier block the engine let go since, in flight: an earlier arrival stored the hash and no
    other block held it when this request was first scheduled, else at its first store)."""
    bs = next(e for e in events if isinstance(e, KVPoolInfo)).block_size_tokens
    arrival, scheduled, computed, preempted = {}, {}, {}, set()
    block_hash, gone = {}, set()  # block id -> hash stored; hashes let go, not stored since
    spans, open_span, storers = {}, {}, {}  # hash -> [stored, let go, by] per block; block -> its span
    for e in events:
        if isinstance(e, RequestArrived):
            arrival[e.request_id] = e.ts_ns
        elif isinstance(e, RequestScheduled):
            scheduled.setdefault(e.request_id, e.ts_ns)
        elif isinstance(e, RequestPreempted):
            preempted.add(e.request_id)
        elif isinstance(e, BlockStored):
            computed.setdefault(e.request_id, []).append((e.ts_ns, e.block_hash, e.block_hash in gone))
            gone.discard(e.block_hash)
            block_hash[e.block_id] = e.block_hash
            if e.block_id in open_span:  # stored again: its earlier content no longer held there
                open_span.pop(e.block_id)[1] = e.ts_ns
            open_span[e.block_id] = span = [e.ts_ns, None, e.request_id]
            spans.setdefault(e.block_hash, []).append(span)
            storers.setdefault(e.block_hash, set()).add(e.request_id)
        elif isinstance(e, BlockDeduplicated):
            computed.setdefault(e.request_id, []).append((e.ts_ns, e.block_hash, False))
        elif let_go(e):
            if e.block_id in block_hash:
                gone.add(block_hash.pop(e.block_id))
            if e.block_id in open_span:
                open_span.pop(e.block_id)[1] = e.ts_ns
    for e in events:
        rid = e.request_id if isinstance(e, RequestFinished) else None
        if rid is None or rid not in arrival or (rid in preempted and not cached_at_first_admission):
            continue
        prompt, cached = e.prompt_tokens, e.cached_prompt_tokens
        full = prompt // bs - (prompt % bs == 0)
        blocks = computed.get(rid, [])
        lookup = scheduled.get(rid, blocks[0][0] if blocks else None)
        for k, (_, h, restored) in enumerate(blocks[:max(full - cached // bs, 0)]):
            j = cached // bs + k
            earlier = any(arrival.get(o, float("inf")) < arrival[rid] for o in storers.get(h, ()) if o != rid)
            held = any(a <= lookup and (b is None or b > lookup) and o != rid for a, b, o in spans.get(h, ()))
            yield min((j + 1) * bs, prompt) - max(j * bs, cached), restored, earlier and not held and not restored


def recomputed_after_eviction(events, cached_at_first_admission: bool = False) -> int:
    """Missed prompt blocks the engine stored again under a hash whose earlier block it had let
    go in between (its ``BlockStored``, ``BlockEvicted`` and ``BlockReleased`` events)."""
    return sum(restored for _, restored, _ in _missed_computed_blocks(events, cached_at_first_admission))


def in_flight_tokens(events, cached_at_first_admission: bool = False) -> int:
    """Missed prompt tokens of blocks whose content a request that arrived earlier stored, and
    which no block of the engine held when this request was looked up (nor had it let them go
    since their last store). Exact where the shadow at the pool's size holds what the earlier
    arrivals brought."""
    return sum(n for n, _, in_flight in _missed_computed_blocks(events, cached_at_first_admission) if in_flight)
