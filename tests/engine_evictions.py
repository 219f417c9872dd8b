"""An independent count of the engine's own evidence of evictions, for the miss-cause tests."""

from __future__ import annotations

from kvdiag.events.schema import BlockEvicted, BlockReleased, BlockStored


def let_go(e) -> bool:
    """The event says a block's content left the engine's prefix cache: evicted, or released
    without being kept cached (transformers, on a preemption)."""
    return isinstance(e, BlockEvicted) or isinstance(e, BlockReleased) and not e.cached


def recomputed_after_eviction(events, cached_at_first_admission: bool = False) -> int:
    """Missed prompt blocks the engine stored again under a hash whose earlier block it had let
    go in between (its ``BlockStored``, ``BlockEvicted`` and ``BlockReleased`` events, read
    directly: not through the fold): per finished request, its ``BlockStored`` and
    ``BlockDeduplicated`` in order from block ``cached // B``, within its prompt's full blocks;
    a preempted request's are left out where the engine counts cached tokens at the last
    admission (transformers: the miss is the preemption's)."""
    from kvdiag.events.schema import BlockDeduplicated, KVPoolInfo, RequestFinished, RequestPreempted
    bs = next(e for e in events if isinstance(e, KVPoolInfo)).block_size_tokens
    block_hash, gone, computed, preempted = {}, set(), {}, set()
    for e in events:
        if isinstance(e, BlockStored):
            computed.setdefault(e.request_id, []).append(e.block_hash in gone)
            gone.discard(e.block_hash)
            block_hash[e.block_id] = e.block_hash
        elif isinstance(e, BlockDeduplicated):
            computed.setdefault(e.request_id, []).append(False)
        elif let_go(e) and e.block_id in block_hash:
            gone.add(block_hash.pop(e.block_id))
        elif isinstance(e, RequestPreempted):
            preempted.add(e.request_id)
    recomputed = 0
    for e in events:
        if isinstance(e, RequestFinished) and (cached_at_first_admission or e.request_id not in preempted):
            full = e.prompt_tokens // bs - (e.prompt_tokens % bs == 0)
            recomputed += sum(computed.get(e.request_id, [])[:max(full - e.cached_prompt_tokens // bs, 0)])
    return recomputed


def in_flight_tokens(events) -> int:
    """Missed prompt tokens of blocks a request computed (its ``BlockStored`` and
    ``BlockDeduplicated``, in order from block ``cached // B``; the last block of a block-aligned
    prompt left out) whose engine hash a request that arrived earlier stored, and which no block
    of the engine held when this request was first scheduled (its ``RequestScheduled``, else its
    first store): counted from the events, not through the fold. Exact where the shadow at the
    pool's size evicts nothing."""
    from kvdiag.events.schema import (BlockDeduplicated, KVPoolInfo, RequestArrived, RequestFinished,
                                      RequestScheduled)
    bs = next(e for e in events if isinstance(e, KVPoolInfo)).block_size_tokens
    arrival, scheduled, computed = {}, {}, {}
    spans, open_span, storers = {}, {}, {}  # hash -> [stored, evicted] per block; block -> span
    for e in events:
        if isinstance(e, RequestArrived):
            arrival[e.request_id] = e.ts_ns
        elif isinstance(e, RequestScheduled):
            scheduled.setdefault(e.request_id, e.ts_ns)
        elif isinstance(e, BlockStored):
            if e.block_id in open_span:  # stored again: its earlier content no longer held there
                open_span.pop(e.block_id)[1] = e.ts_ns
            open_span[e.block_id] = span = [e.ts_ns, None, e.request_id]
            spans.setdefault(e.block_hash, []).append(span)
            storers.setdefault(e.block_hash, set()).add(e.request_id)
            computed.setdefault(e.request_id, []).append((e.ts_ns, e.block_hash))
        elif let_go(e) and e.block_id in open_span:
            open_span.pop(e.block_id)[1] = e.ts_ns
        elif isinstance(e, BlockDeduplicated):
            computed.setdefault(e.request_id, []).append((e.ts_ns, e.block_hash))
    tokens = 0
    for e in events:
        if not isinstance(e, RequestFinished) or e.request_id not in arrival:
            continue
        rid, prompt, cached = e.request_id, e.prompt_tokens, e.cached_prompt_tokens
        full = prompt // bs - (prompt % bs == 0)
        blocks = computed.get(rid, [])
        lookup = scheduled.get(rid, blocks[0][0] if blocks else None)
        for k, (_, h) in enumerate(blocks):
            j = cached // bs + k
            if j >= full:
                break
            earlier = any(arrival.get(o, float("inf")) < arrival[rid] for o in storers.get(h, ()) if o != rid)
            held = any(a <= lookup and (b is None or b > lookup) and o != rid for a, b, o in spans.get(h, ()))
            if earlier and not held:
                tokens += min((j + 1) * bs, prompt) - max(j * bs, cached)
    return tokens
