"""Live shadow sharing fed one event at a time equals the offline simulator on the same prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvdiag.simulation.live_sharing import ShadowConfig, ShadowSharingSink
from kvdiag.simulation.sharing import simulate
from kvdiag.traces.trace import TraceBuilder
from kvdiag.pool.hashing import chunk_hashes
from kvdiag.events.schema import KVPoolInfo, KVPoolSample, RequestArrived, RequestFinished, ShadowSharing
from kvdiag.events.sinks import ListSink

MOONCAKE = Path(__file__).parent.parent / "data" / "mooncake" / "synthetic_trace.jsonl"


def _prompts(n=150):
    """Token ids realising the first Mooncake requests (block j's tokens = its hash id)."""
    out = []
    with open(MOONCAKE) as f:
        for _ in range(n):
            req = json.loads(next(f))
            k = req["input_length"]
            out.append([h for j, h in enumerate(req["hash_ids"]) for _ in range(min(512, k - 512 * j))])
    return out


def trace_from_tokens(prompts, block):
    """Each prompt at arrival, then (it finishes at once, with no stored generated blocks) its
    prompt blocks touched again: what the live sink sees here, written independently."""
    b = TraceBuilder(block, "tokens", "")
    for p in prompts:
        keys = chunk_hashes(p, block)
        b.add(keys, len(p))
        b.add(keys, 0, block_tokens=np.zeros(len(keys), np.int32), counted=False)
    return b.build()


class _Clock:
    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now


CONFIGS = [ShadowConfig("lru", 512, None), ShadowConfig("lru", 512, 400),
           ShadowConfig("s3fifo", 256, 900), ShadowConfig("lfu", 64, 5000),
           ShadowConfig("fifo", 1024, 150)]


def test_live_events_equal_offline_simulation():
    prompts = _prompts()
    clock = _Clock()
    sink = ListSink()
    live = ShadowSharingSink(CONFIGS, sink, interval_s=1.0, clock=clock, bytes_per_token=46080)
    engine_cached = []
    for i, tokens in enumerate(prompts):
        clock.now = i * 300_000_000  # 0.3 s between arrivals
        live.record(RequestArrived(ts_ns=clock.now, request_id=str(i), prompt_tokens=len(tokens),
                                   token_ids=tokens))
        cached = (i * 37) % len(tokens)  # whatever the engine reports
        engine_cached.append(cached)
        live.record(RequestFinished(ts_ns=clock.now, request_id=str(i), prompt_tokens=len(tokens),
                                    output_tokens=1, cached_prompt_tokens=cached))
    live.flush()
    assert live.errors == 0
    emitted = [e for e in sink.events if isinstance(e, ShadowSharing)]
    # a batch at the start (the counters' baseline), whenever the engine drained (here: each
    # request finishes before the next arrives), + flush; the 1 s interval is tested with
    # requests in flight below
    assert len(emitted) == len(CONFIGS) * (len(prompts) + 2)
    assert all(e.finished_requests == 0 and e.requests <= 1 for e in emitted[:len(CONFIGS)])
    final = emitted[-len(CONFIGS):]
    engine = sum(engine_cached) / sum(len(t) for t in prompts)
    for cfg, ev in zip(CONFIGS, final):
        offline = simulate(trace_from_tokens(prompts, cfg.block_size_tokens), cfg.policy,
                           cfg.capacity_blocks)
        assert (ev.policy, ev.block_size_tokens, ev.capacity_blocks) == (
            cfg.policy, cfg.block_size_tokens, cfg.capacity_blocks)
        assert ev.requests == len(prompts)
        assert ev.block_hit_rate == pytest.approx(offline.block_hit_rate, abs=1e-12)
        assert ev.token_hit_rate == pytest.approx(offline.token_hit_rate, abs=1e-12)
        assert ev.request_hit_rate == pytest.approx(offline.request_hit_rate, abs=1e-12)
        assert ev.bytes_saved == offline.hit_tokens * 46080
        assert ev.engine_hit_rate == pytest.approx(engine)
        # the same requests on both sides: every request finished, so the finished counters
        # are the offline simulation's hits and the engine's reported cached tokens
        assert ev.finished_requests == len(prompts)
        assert ev.finished_prompt_tokens == sum(len(t) for t in prompts)
        assert ev.finished_hit_tokens == offline.hit_tokens
        assert ev.finished_engine_cached_tokens == sum(engine_cached)
    # every intermediate batch is the offline result over the requests seen by then
    mid = emitted[len(CONFIGS) * 40]
    offline = simulate(trace_from_tokens(prompts[:mid.requests], 512), "lru", None)
    assert mid.token_hit_rate == pytest.approx(offline.token_hit_rate, abs=1e-12)


def test_engine_settings_gap():
    """An engine that reports exactly the content's LRU hits at its own settings has no gap;
    one that silently never shares shows the full shadow rate as the gap."""
    prompts = _prompts(60)
    offline = simulate(trace_from_tokens(prompts, 512), "lru", 200)
    pool = KVPoolInfo(ts_ns=0, num_blocks=200, block_size_tokens=512, block_bytes=512 * 46080,
                      num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32",
                      prefix_sharing=True)
    for engine_hits, want_gap in ((offline.request_hit_tokens, 0.0), (None, offline.token_hit_rate)):
        live = ShadowSharingSink(interval_s=1e9)
        live.record(pool)
        for i, tokens in enumerate(prompts):
            live.record(RequestArrived(ts_ns=i, request_id=str(i), prompt_tokens=len(tokens),
                                       token_ids=tokens))
            cached = 0 if engine_hits is None else int(engine_hits[i])
            live.record(RequestFinished(ts_ns=i, request_id=str(i), prompt_tokens=len(tokens),
                                        output_tokens=1, cached_prompt_tokens=cached))
        assert live.engine_config == ShadowConfig("lru", 512, 200)
        assert live.gap() == pytest.approx(want_gap, abs=1e-12)
        assert live.bytes_per_token == 46080


def test_results_every_interval_while_requests_are_in_flight():
    """With requests always in flight, a batch whenever >= 1 s passed since the last one."""
    clock = _Clock()
    sink = ListSink()
    live = ShadowSharingSink([ShadowConfig("lru", 16, None)], sink, interval_s=1.0, clock=clock)
    for i in range(20):
        clock.now = i * 300_000_000
        live.record(RequestArrived(ts_ns=clock.now, request_id=str(i), prompt_tokens=32,
                                   token_ids=list(range(32))))
        if i:
            live.record(RequestFinished(ts_ns=clock.now, request_id=str(i - 1), prompt_tokens=32,
                                        output_tokens=1))
    batches = [e for e in sink.events if isinstance(e, ShadowSharing)]
    # the baseline at the first event, then every interval
    assert [e.ts_ns for e in batches] == [0, 1_200_000_000, 2_400_000_000, 3_600_000_000, 4_800_000_000]
    # arrivals are counted as they come, the same-requests counters once a request finished:
    # the 1.2 s batch is taken on request 4's arrival (5 arrived), before request 3's finish
    # is recorded (3 finished)
    assert [(e.requests, e.finished_requests) for e in batches] == [(1, 0), (5, 3), (9, 7), (13, 11), (17, 15)]
    assert all(e.finished_prompt_tokens == 32 * e.finished_requests for e in batches)
    live.record(RequestFinished(ts_ns=clock.now, request_id="19", prompt_tokens=32, output_tokens=1))
    last = [e for e in sink.events if isinstance(e, ShadowSharing)][-1]
    assert last.ts_ns == clock.now == 5_700_000_000 and last.requests == 20  # drained
    # then an idle engine (pool samples only, no request arriving or finishing): no repeats
    n = len([e for e in sink.events if isinstance(e, ShadowSharing)])
    for t in range(10):
        clock.now = 6_000_000_000 + t * 1_000_000_000
        live.record(KVPoolSample(ts_ns=clock.now, num_blocks=10, blocks_used=1))
    assert len([e for e in sink.events if isinstance(e, ShadowSharing)]) == n
