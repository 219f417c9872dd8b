"""A synthetic vLLM-shaped event stream (CONSTRUCTED DATA) for the live-path benchmarks.

What a vLLM engine with prefix caching publishes through kvdiag's plugin, at GPU scale: a
pool of ``num_blocks`` blocks of 16 tokens; requests arrive with 256-2,048-token prompts whose
first blocks are prefix hits on cached blocks of earlier requests (a shared system prompt and
conversations continued), allocate the rest, grow by one block every 16 generated tokens,
finish, and release every block (full blocks kept cached); the cache is evicted LRU when the
free list runs dry (a warm cache: in steady state nearly every allocation evicts). One
``EngineStep`` per ~32 events, a ``KVPoolSample`` per ~1,000. Event mix of 1 M events (seed 0):
33% allocations, 33% releases, 31% evictions, 1% engine steps, 0.8% prefix hits, 0.8%
request arrivals and finishes: the block-event-dominated stream of a busy GPU server (the
recorded CPU demo in tests/data/vllm_demo is step-dominated only because a CPU engine is
slow). With ``content``, as the plugin records in hashes mode: arrivals carry their chunk
hashes and each prompt block of fresh content is stored (``BlockStored`` after its
allocation; generated blocks are not modelled). Deterministic for a seed; generated lazily
(constant memory).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Iterator

from kvdiag.events import schema as s

BLOCK_TOKENS = 16


def pool_info(num_blocks: int) -> s.KVPoolInfo:
    return s.KVPoolInfo(ts_ns=1, num_blocks=num_blocks, block_size_tokens=BLOCK_TOKENS,
                        block_bytes=BLOCK_TOKENS * 2 * 32 * 8 * 128 * 2, num_layers=32, num_kv_heads=8,
                        head_dim=128, dtype="bfloat16", prefix_sharing=True)


def events(n_events: int, num_blocks: int = 20_000, seed: int = 0, concurrency: int = 64,
           events_per_s: float = 5_000.0, content: bool = False) -> Iterator[s.Event]:
    """Yield about ``n_events`` events (stops at the first request boundary past it), one
    every 1 / ``events_per_s`` seconds of event time. ``content``: arrivals carry hashes-mode
    ``chunk_hashes`` (one 16-token chunk per block; a prefix hit's chunks are those of the
    cached block it hits) and a ``BlockStored`` follows each allocation of a fresh prompt
    block; the same draws otherwise (steps come every 32 events, stores counted)."""
    rng = random.Random(seed)
    ts = 1_000_000_000
    dt = max(1, round(1e9 / events_per_s))
    yield pool_info(num_blocks)
    n = 1
    free = list(range(num_blocks))
    cached: OrderedDict[int, None] = OrderedDict()  # LRU order
    prefixes: list[list[int]] = []  # block chains of earlier prompts that may be hit
    live: list[tuple[str, list[int], int]] = []
    step = 0
    i = 0
    block_key: dict[int, int] = {}  # content=True: block -> its prompt content's chunk key
    pending: dict[str, list[int]] = {}  # request -> chunk keys of its prompt blocks to allocate
    next_key = 1

    def allocate(rid: str, blocks: list[int]):
        """A free block for ``rid``, else the least recently used cached one, evicted first."""
        nonlocal ts, n
        if free:
            b = free.pop()
        else:
            b, _ = cached.popitem(last=False)
            ts += dt
            yield s.BlockEvicted(ts_ns=ts, block_id=b)
            n += 1
        ts += dt
        keys = pending.get(rid)
        key = None
        if keys:  # a prompt block of fresh content
            key = block_key[b] = keys.pop(0)
            if not keys:
                del pending[rid]
        yield s.BlockAllocated(ts_ns=ts, request_id=rid, block_id=b)
        n += 1
        if key is not None:  # computed, then registered in the prefix cache (the plugin's store)
            ts += dt
            yield s.BlockStored(ts_ns=ts, block_id=b, block_hash=key,
                                parent_hash=block_key.get(blocks[-1]) if blocks else None,
                                num_tokens=BLOCK_TOKENS, request_id=rid, chunk_hashes=[key])
            n += 1
        blocks.append(b)

    while n < n_events:
        while len(live) < concurrency:
            rid = f"req-{i}"
            i += 1
            ts += dt
            prompt_blocks = rng.randint(16, 128)
            hits: list[int] = []  # decided first (the same draws): the arrival may carry them
            if prefixes and rng.random() < 0.6:
                chain = prefixes[rng.randrange(len(prefixes))]
                for b in chain[:rng.randint(1, len(chain))]:
                    if b not in cached:
                        break
                    hits.append(b)
            chunks = None
            if content:
                fresh = range(next_key, next_key + prompt_blocks - len(hits))
                next_key += len(fresh)
                chunks = [block_key.get(b, -b - 1) for b in hits] + list(fresh)
                pending[rid] = list(fresh)
            yield s.RequestArrived(ts_ns=ts, request_id=rid, prompt_tokens=prompt_blocks * BLOCK_TOKENS,
                                   max_new_tokens=256, chunk_hashes=chunks)
            n += 1
            blocks: list[int] = []
            if hits:
                for b in hits:
                    del cached[b]
                    ts += dt
                    yield s.PrefixHit(ts_ns=ts, request_id=rid, block_id=b, num_tokens=BLOCK_TOKENS)
                    n += 1
                    blocks.append(b)
            while len(blocks) < prompt_blocks:
                yield from allocate(rid, blocks)
            live.append((rid, blocks, rng.randint(1, 16)))
        # one request grows or finishes
        k = rng.randrange(len(live))
        rid, blocks, grow = live[k]
        if grow > 0:
            yield from allocate(rid, blocks)
            live[k] = (rid, blocks, grow - 1)
        else:
            live.pop(k)
            ts += dt
            yield s.RequestFinished(ts_ns=ts, request_id=rid, prompt_tokens=len(blocks) * BLOCK_TOKENS,
                                    output_tokens=128, cached_prompt_tokens=0, e2e_ns=2_000_000_000,
                                    ttft_ns=100_000_000)
            n += 1
            for b in blocks:
                ts += dt
                keep = b not in cached
                yield s.BlockReleased(ts_ns=ts, request_id=rid, block_id=b, cached=keep)
                n += 1
                if keep:
                    cached[b] = None
            if len(prefixes) < 64:
                prefixes.append(blocks[:8])
            else:
                prefixes[rng.randrange(64)] = blocks[:8]
        if n // 32 > step:
            step = n // 32
            ts += dt
            yield s.EngineStep(ts_ns=ts, step_id=step, phase="decode", batch_size=len(live),
                               num_tokens=len(live), duration_ns=20_000_000, decode_tokens=len(live))
            n += 1
            if step % 32 == 0:
                used = num_blocks - len(free) - len(cached)
                yield s.KVPoolSample(ts_ns=ts, num_blocks=num_blocks, blocks_used=used,
                                     blocks_cached=len(cached), blocks_free=len(free),
                                     tokens_held=used * BLOCK_TOKENS, running_requests=len(live),
                                     waiting_requests=0)
                n += 1
