"""CONSTRUCTED TEST DATA for the `kvdiag top` tests and benchmark (not a recording).

A small deterministic simulation of a paged KV pool serving chat requests that share a system
prompt, emitting the schema's events: request lifecycle, engine steps, block allocation /
prefix hits / releases / evictions, pool samples, memory samples and, optionally, shadow
results (prefix sharing computed by an LRU simulation of the generated prompts; compression
and locality values drawn from a seeded RNG). It exists so that every panel can be shown with
data in one state and as N/A in another before a real recorded demo log is available; tests
check the TUI's numbers against independent computations over these same events.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from pathlib import Path
from typing import Optional

from kvdiag.events import schema as s
from kvdiag.events.log_writer import LogWriter

T0_NS = 1_790_000_000_000_000_000  # a fixed wall-clock origin: snapshots are deterministic
BLOCK_TOKENS = 32
NUM_BLOCKS = 256
BLOCK_BYTES = 1_474_560
LAYERS = 30
HEADS = 9
SYSTEM_TOKENS = 256
STEP_NS = 100_000_000


def header(gpu: bool = True) -> s.LogHeader:
    return s.LogHeader(schema_version=s.SCHEMA_VERSION, host="constructed", pid=4242, engine="constructed-test-data", model="SmolLM2-135M (constructed)",
                       block_size_tokens=BLOCK_TOKENS, bytes_per_token=46_080, start_ns=T0_NS, node="constructed",
                       extra={"constructed": True, "gpu": gpu})


def _chain(tokens: list[int], block: int) -> list[int]:
    hashes, h = [], 0
    for i in range(0, len(tokens) - block + 1, block):
        h = hash((h, tuple(tokens[i:i + block]))) & ((1 << 63) - 1)
        hashes.append(h)
    return hashes


class _ShadowLRU:
    """Token hit rate of an LRU prefix cache over the prompts (the shadow what-if)."""

    def __init__(self, block: int, capacity: Optional[int]) -> None:
        self.block, self.capacity = block, capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.hit_blocks = self.ref_blocks = self.hit_tokens = self.prompt_tokens = self.requests = 0

    def add(self, tokens: list[int]) -> None:
        self.requests += 1
        self.prompt_tokens += len(tokens)
        prefix = True
        for h in _chain(tokens, self.block):
            self.ref_blocks += 1
            if prefix and h in self.cache:
                self.hit_blocks += 1
                self.hit_tokens += self.block
                self.cache.move_to_end(h)
            else:
                prefix = False
                self.cache[h] = None
                if self.capacity is not None and len(self.cache) > self.capacity:
                    self.cache.popitem(last=False)

    def event(self, ts: int, engine: Optional[float]) -> s.ShadowSharing:
        return s.ShadowSharing(ts_ns=ts, policy="lru", block_size_tokens=self.block, capacity_blocks=self.capacity,
                               requests=self.requests, block_hit_rate=self.hit_blocks / max(1, self.ref_blocks),
                               token_hit_rate=self.hit_tokens / max(1, self.prompt_tokens), engine_hit_rate=engine)


def constructed_events(n_requests: int = 120, arrivals_per_s: float = 2.0, seed: int = 7, gpu: bool = True,
                       shadow: bool = True, spike_at: float = 0.6, leak_every: int = 0) -> list[s.Event]:
    """Events of ``n_requests`` chat requests (see module docstring). TTFT is 5x higher for
    requests arriving in a window around ``spike_at`` of the run (a P99 regression);
    ``leak_every`` > 0 makes every n-th request never release its blocks."""
    rng = random.Random(seed)
    system = [rng.randrange(50_000) for _ in range(SYSTEM_TOKENS)]
    events: list[s.Event] = [s.KVPoolInfo(ts_ns=T0_NS, num_blocks=NUM_BLOCKS, block_size_tokens=BLOCK_TOKENS,
                                          block_bytes=BLOCK_BYTES, num_layers=LAYERS, num_kv_heads=3, head_dim=64,
                                          dtype="float32", prefix_sharing=True)]
    if not gpu:
        events.append(s.CollectorStatus(ts_ns=T0_NS, collector="nvml", available=False,
                                        hint="no GPU: NVML library not found"))
        events.append(s.CollectorStatus(ts_ns=T0_NS, collector="cuda-allocator", available=False,
                                        hint="torch CPU build: no CUDA allocator"))
    arrivals = []
    t = T0_NS + 500_000_000
    for i in range(n_requests):
        t += int(rng.expovariate(arrivals_per_s) * 1e9)
        tail = [rng.randrange(50_000) for _ in range(rng.randrange(40, 400))]
        arrivals.append((t, f"req-{i:05d}", system + tail, rng.randrange(8, 48)))
    end_ns = arrivals[-1][0] + 10_000_000_000
    spike = (T0_NS + spike_at * (end_ns - T0_NS), T0_NS + (spike_at + 0.05) * (end_ns - T0_NS))
    free = list(range(NUM_BLOCKS - 1, -1, -1))
    cache: OrderedDict[int, int] = OrderedDict()  # hash -> block of the engine's prefix cache
    refs: dict[int, int] = {}
    running: dict[str, dict] = {}
    shadows = [_ShadowLRU(b, c) for b in (16, 32, 64) for c in (32, 64, 128, None)] if shadow else []
    cached_prompt = prompt_sum = 0
    next_arrival, step, now = 0, 0, T0_NS
    while now < end_ns or running:
        now += STEP_NS
        step += 1
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now:
            ts, rid, tokens, out = arrivals[next_arrival]
            next_arrival += 1
            events.append(s.RequestArrived(ts_ns=ts, request_id=rid, prompt_tokens=len(tokens), max_new_tokens=out))
            hashes = _chain(tokens, BLOCK_TOKENS)
            blocks, hit = [], 0
            for h in hashes:
                if h in cache:
                    b = cache[h]
                    cache.move_to_end(h)
                    blocks.append(b)
                    hit += BLOCK_TOKENS
                    refs[b] = refs.get(b, 0) + 1
                    events.append(s.PrefixHit(ts_ns=ts + 1, request_id=rid, block_id=b, block_hash=h,
                                              num_tokens=BLOCK_TOKENS))
                else:
                    break
            need = -(-(len(tokens) + out) // BLOCK_TOKENS) - len(blocks)
            while len(free) < need and cache:
                h, b = next(((h, b) for h, b in cache.items() if refs.get(b, 0) == 0), (None, None))
                if h is None:
                    break
                del cache[h]
                free.append(b)
                events.append(s.BlockEvicted(ts_ns=ts + 2, block_id=b, block_hash=h))
            for _ in range(min(need, len(free))):
                b = free.pop()
                blocks.append(b)
                refs[b] = refs.get(b, 0) + 1
                events.append(s.BlockAllocated(ts_ns=ts + 3, request_id=rid, block_id=b, num_blocks_free=len(free)))
            for sh in shadows:
                sh.add(tokens)
            slow = 5 if spike[0] <= ts <= spike[1] else 1
            ttft = int((0.15 + 0.0004 * (len(tokens) - hit) + rng.random() * 0.1) * 1e9) * slow
            running[rid] = dict(arrived=ts, tokens=tokens, hashes=hashes, blocks=blocks, hit=hit, out=out,
                                done=0, first=ts + ttft, leak=leak_every and int(rid[4:]) % leak_every == 0)
            events.append(s.RequestScheduled(ts_ns=ts + 4, request_id=rid, queue_ns=4))
        decode = 0
        for rid, r in list(running.items()):
            if now < r["first"]:
                continue
            if r["done"] == 0:
                events.append(s.RequestFirstToken(ts_ns=r["first"], request_id=rid, ttft_ns=r["first"] - r["arrived"]))
            else:
                decode += 1
            r["done"] += 1
            if r["done"] >= r["out"]:
                del running[rid]
                full = len(r["tokens"]) // BLOCK_TOKENS
                for i, b in enumerate(r["blocks"]):
                    keep = i < full
                    if keep and i < len(r["hashes"]) and r["hashes"][i] not in cache:
                        cache[r["hashes"][i]] = b
                        events.append(s.BlockStored(ts_ns=now, block_id=b, block_hash=r["hashes"][i],
                                                    num_tokens=BLOCK_TOKENS, request_id=rid))
                    elif keep:
                        keep = cache.get(r["hashes"][i]) == b
                    if r["leak"]:
                        continue
                    refs[b] -= 1
                    if refs[b] == 0:
                        del refs[b]
                        if not keep:
                            free.append(b)
                    events.append(s.BlockReleased(ts_ns=now, request_id=rid, block_id=b, cached=keep,
                                                  num_blocks_free=len(free)))
                prompt_sum += len(r["tokens"])
                cached_prompt += r["hit"]
                events.append(s.RequestFinished(ts_ns=now, request_id=rid, prompt_tokens=len(r["tokens"]),
                                                output_tokens=r["out"], cached_prompt_tokens=r["hit"],
                                                e2e_ns=now - r["arrived"], ttft_ns=r["first"] - r["arrived"]))
        events.append(s.EngineStep(ts_ns=now, step_id=step, phase="decode", batch_size=len(running),
                                   num_tokens=decode, duration_ns=STEP_NS // 2, decode_tokens=decode))
        if step % 10 == 0:
            used = len(refs)
            cached_only = sum(1 for b in cache.values() if b not in refs)
            shared = {b for r in running.values() for b in r["blocks"][:r["hit"] // BLOCK_TOKENS]}
            held = sum(len(r["tokens"]) + r["done"] - r["hit"] for r in running.values()) + BLOCK_TOKENS * len(shared)
            events.append(s.KVPoolSample(ts_ns=now, num_blocks=NUM_BLOCKS, blocks_used=used, blocks_cached=cached_only,
                                         blocks_free=len(free), tokens_held=min(held, used * BLOCK_TOKENS),
                                         running_requests=sum(1 for r in running.values() if now >= r["first"]),
                                         waiting_requests=sum(1 for r in running.values() if now < r["first"])))
            events.append(s.ProcessSample(ts_ns=now, pid=4242, rss_bytes=2_000_000_000 + used * 4096 * 16,
                                          num_threads=12, cpu_time_ns=step * 50_000_000, name="python"))
            if gpu:
                alloc = 6_000_000_000 + used * BLOCK_BYTES
                events.append(s.NvmlSample(ts_ns=now, device=0, memory_used_bytes=alloc + 900_000_000,
                                           memory_total_bytes=80 * (1 << 30), gpu_util_pct=60.0,
                                           process_memory_bytes=alloc + 500_000_000))
                events.append(s.AllocatorSample(ts_ns=now, device=0, reserved_bytes=alloc + 700_000_000,
                                                allocated_bytes=alloc))
        if shadow and step % 50 == 0 and prompt_sum:
            engine = cached_prompt / prompt_sum
            events.extend(sh.event(now, engine) for sh in shadows)
            for layer in range(0, LAYERS, 3):
                for head in range(3):
                    for method, ratio, err in (("fp16", 2.0, 0.0004), ("int8", 4.0, 0.004), ("int4", 8.0, 0.03),
                                               ("sparse", 8.0, 0.08)):
                        e = err * (1 + layer / LAYERS) * (0.8 + 0.4 * rng.random())
                        events.append(s.ShadowCompression(
                            ts_ns=now, layer=layer, head=head, method=method, seq_len_tokens=512, ratio=ratio,
                            k_rel_error=e, v_rel_error=e * 0.9, attn_out_rel_error=e * 0.7,
                            encode_ns=20_000, decode_ns=30_000 + int(10_000 * ratio * rng.random())))
            for layer in range(LAYERS):
                for head in range(HEADS):
                    recent = min(0.97, 0.4 + 0.5 * rng.random() * (1 - head / HEADS) + layer / (3 * LAYERS))
                    sink = (1 - recent) * rng.random() * 0.6
                    events.append(s.ShadowLocality(
                        ts_ns=now, layer=layer, head=head, seq_len_tokens=400, recent_mass=recent, sink_mass=sink,
                        other_mass=1 - recent - sink, entropy_nats=0.5 + 3 * (1 - recent),
                        outside_share=(1 - recent) / HEADS * 2 * rng.random()))
    events.sort(key=lambda e: e.ts_ns)
    return events


def write_constructed_log(path: Path, **kwargs) -> Path:
    """Write :func:`constructed_events` through the real LogWriter."""
    events = constructed_events(**kwargs)
    with LogWriter(path, header(kwargs.get("gpu", True)), max_queue=len(events) + 10) as writer:
        for ev in events:
            writer.record(ev)
    return path
