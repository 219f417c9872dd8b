"""Independent checks of a recorded demo log against the engine's own bookkeeping.

The block ledger is replayed from the log with transformers' own block hash function
(``compute_block_hash``): the prefix match the engine should have found for each request is
recomputed from the request's prompt token ids and compared with what the adapter recorded.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from kvdiag.collectors.transformers_cb_hooks import fold_hash
from kvdiag.events.eventlog import iter_events, read_header
from kvdiag.events.schema import (
    BlockAllocated,
    BlockDeduplicated,
    BlockEvicted,
    BlockReleased,
    BlockStored,
    EngineStep,
    KVPoolInfo,
    KVPoolSample,
    PrefixHit,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestScheduled,
)


@dataclass
class Replay:
    page_size: int = 0
    problems: list[str] = field(default_factory=list)
    finished: dict[str, RequestFinished] = field(default_factory=dict)
    expected_cached_tokens: dict[str, int] = field(default_factory=dict)
    prefix_hit_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    blocks_at_finish: dict[str, int] = field(default_factory=dict)
    held_at_finish: dict[str, list[int]] = field(default_factory=dict)
    cached_blocks_at_end: set[int] = field(default_factory=set)
    last_sample: KVPoolSample | None = None
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def engine_prefix_match_tokens(token_ids: list[int], page: int, hash_to_block: dict[int, int]) -> int:
    """What ``CacheAllocator.match_prefix_blocks`` matches, on a replayed ledger."""
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

    matched, parent = 0, None
    for b in range((len(token_ids) - 1) // page):
        parent = compute_block_hash(parent, token_ids[b * page:(b + 1) * page])
        if fold_hash(parent) not in hash_to_block:
            break
        matched += 1
    return matched * page


def replay(path) -> Replay:
    """Replay a recorded log (see :func:`replay_events`)."""
    return replay_events(iter_events(path, strict=True), read_header(path).block_size_tokens or 0)


def replay_events(events, page_size: int = 0) -> Replay:
    """Fold events, in recorded order, into per-request block accounting and a replayed ledger."""
    r = Replay()
    r.page_size = page_size
    prompts: dict[str, list[int]] = {}
    held: dict[str, list[int]] = defaultdict(list)  # request -> blocks (a block may be held once)
    dedup_pending: dict[str, set[int]] = defaultdict(set)
    hash_to_block: dict[int, int] = {}
    block_to_hash: dict[int, int] = {}
    holders: dict[int, int] = defaultdict(int)
    first_hit_seen: set[str] = set()
    pending_match: set[str] = set()
    for ev in events:
        r.counts[type(ev).__name__] += 1
        if isinstance(ev, KVPoolInfo):
            r.page_size = ev.block_size_tokens
        elif isinstance(ev, RequestArrived):
            prompts[ev.request_id] = ev.token_ids or []
            pending_match.add(ev.request_id)
        elif isinstance(ev, PrefixHit):
            if ev.request_id not in first_hit_seen:
                first_hit_seen.add(ev.request_id)
                pending_match.discard(ev.request_id)
                r.expected_cached_tokens[ev.request_id] = engine_prefix_match_tokens(
                    prompts[ev.request_id], r.page_size, hash_to_block)
            r.prefix_hit_tokens[ev.request_id] += ev.num_tokens
            if ev.block_hash is None or hash_to_block.get(ev.block_hash) != ev.block_id:
                r.problems.append(f"prefix hit on block {ev.block_id} which the replayed ledger "
                                  f"does not hold under hash {ev.block_hash}")
            held[ev.request_id].append(ev.block_id)
            holders[ev.block_id] += 1
        elif isinstance(ev, RequestScheduled):
            if ev.request_id in pending_match:  # no prefix hit: the match the engine did found nothing
                pending_match.discard(ev.request_id)
                r.expected_cached_tokens[ev.request_id] = engine_prefix_match_tokens(
                    prompts.get(ev.request_id, []), r.page_size, hash_to_block)
        elif isinstance(ev, BlockAllocated):
            if holders[ev.block_id] or ev.block_id in block_to_hash:
                r.problems.append(f"block {ev.block_id} allocated to {ev.request_id} while still in use")
            held[ev.request_id].append(ev.block_id)
            holders[ev.block_id] += 1
        elif isinstance(ev, BlockDeduplicated):
            dedup_pending[ev.request_id].add(ev.duplicate_block_id)
            held[ev.request_id].append(ev.block_id)
            holders[ev.block_id] += 1
        elif isinstance(ev, BlockStored):
            if ev.block_hash in hash_to_block:
                r.problems.append(f"hash {ev.block_hash} stored twice")
            hash_to_block[ev.block_hash] = ev.block_id
            block_to_hash[ev.block_id] = ev.block_hash
        elif isinstance(ev, BlockReleased):
            if ev.block_id not in held[ev.request_id]:
                r.problems.append(f"{ev.request_id} released block {ev.block_id} it did not hold")
                continue
            if ev.block_id in dedup_pending[ev.request_id]:
                dedup_pending[ev.request_id].discard(ev.block_id)
            elif ev.request_id not in r.blocks_at_finish:  # first release of the final free_blocks
                r.blocks_at_finish[ev.request_id] = len(held[ev.request_id])
            held[ev.request_id].remove(ev.block_id)
            holders[ev.block_id] -= 1
            if ev.cached != (ev.block_id in block_to_hash):
                r.problems.append(f"block {ev.block_id} released with cached={ev.cached} but the replayed "
                                  f"ledger says hashed={ev.block_id in block_to_hash}")
        elif isinstance(ev, BlockEvicted):
            if holders[ev.block_id]:
                r.problems.append(f"block {ev.block_id} evicted while held")
            h = block_to_hash.pop(ev.block_id, None)
            if h is None:
                r.problems.append(f"evicted block {ev.block_id} was not cached")
            else:
                hash_to_block.pop(h, None)
        elif isinstance(ev, RequestFinished):
            r.finished[ev.request_id] = ev
            r.held_at_finish[ev.request_id] = list(held.pop(ev.request_id, []))
        elif isinstance(ev, KVPoolSample):
            r.last_sample = ev
    r.cached_blocks_at_end = {b for b in block_to_hash if holders[b] == 0}
    return r


def timestamps_problems(path) -> list[str]:
    """Request lifecycle, steps and block events are ordered in time."""
    problems = []
    arrived, scheduled, first, finished = {}, {}, {}, {}
    block_ts = defaultdict(list)
    steps = []
    for ev in iter_events(path, strict=True):
        if isinstance(ev, RequestArrived):
            arrived[ev.request_id] = ev.ts_ns
        elif isinstance(ev, RequestScheduled):
            scheduled.setdefault(ev.request_id, ev.ts_ns)
        elif isinstance(ev, RequestFirstToken):
            first[ev.request_id] = ev.ts_ns
        elif isinstance(ev, RequestFinished):
            finished[ev.request_id] = ev.ts_ns
        elif isinstance(ev, (BlockAllocated, PrefixHit, BlockReleased, BlockDeduplicated)):
            block_ts[ev.request_id].append(ev.ts_ns)
        elif isinstance(ev, EngineStep):
            steps.append(ev)
    for rid, t_fin in finished.items():
        chain = [arrived.get(rid), scheduled.get(rid), first.get(rid), t_fin]
        present = [t for t in chain if t is not None]
        if present != sorted(present) or arrived.get(rid) is None:
            problems.append(f"{rid}: lifecycle out of order {chain}")
        for t in block_ts[rid]:
            if not arrived[rid] <= t <= t_fin:
                problems.append(f"{rid}: block event at {t} outside [{arrived[rid]}, {t_fin}]")
    for a, b in zip(steps, steps[1:]):
        if b.step_id != a.step_id + 1 or b.ts_ns < a.ts_ns + a.duration_ns:
            problems.append(f"steps {a.step_id} and {b.step_id} out of order or overlapping")
    return problems


def expected_blocks(prompt_tokens: int, output_tokens: int, page: int) -> int:
    """Blocks a finished request holds: every token written to the KV cache (the prompt and all
    generated tokens but the last, which is never fed back) rounded up to whole pages."""
    return math.ceil((prompt_tokens + output_tokens - 1) / page)
