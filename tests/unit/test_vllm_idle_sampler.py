"""The vLLM plugin's pool samples while the engine is idle, on a stand-in scheduler (vLLM's
attribute names, no vLLM needed): samples keep coming at the sample interval once no step ran
for one, and stop while steps run (the step takes its own)."""

from __future__ import annotations

import time
import types

from kvdiag.collectors import vllm_pool_sampling as sampling
from kvdiag.collectors.vllm_hook_state import Hooks
from kvdiag.events.schema import KVPoolSample
from kvdiag.events.sinks import ListSink
from waiting import wait_for

INTERVAL_NS = 50_000_000


def _block(i: int, ref_cnt: int, block_hash):
    return types.SimpleNamespace(block_id=i, is_null=i == 0, ref_cnt=ref_cnt, block_hash=block_hash)


def test_the_pool_is_sampled_while_the_engine_is_idle():
    blocks = [_block(0, 0, None), _block(1, 2, b"a"), _block(2, 0, b"b"), _block(3, 0, None), _block(4, 0, None)]
    pool = types.SimpleNamespace(blocks=blocks, num_gpu_blocks=len(blocks))
    sched = types.SimpleNamespace(kv_cache_manager=types.SimpleNamespace(block_pool=pool), running=[], waiting=[1])
    h = Hooks()
    h.sink = ListSink()
    h.scheduler = sched
    h.sample_interval_ns = INTERVAL_NS
    samples = lambda: [e for e in h.sink.events if isinstance(e, KVPoolSample)]  # noqa: E731
    try:
        sampling.start_idle_sampler(h)
        wait_for(lambda: len(samples()) >= 3, 10, "three pool samples from the idle sampler")
        first = samples()[:3]
        # what the stand-in pool holds, counted here: block 1 held, block 2 only cached, 2 free
        assert all((s.num_blocks, s.blocks_used, s.blocks_cached, s.blocks_free, s.waiting_requests)
                   == (4, 1, 1, 2, 1) for s in first)
        gaps = [b.ts_ns - a.ts_ns for a, b in zip(first, first[1:])]
        assert all(g >= INTERVAL_NS for g in gaps)
    finally:
        h.idle_stop.set()
        h.idle_thread.join(timeout=5)
    assert not h.idle_thread.is_alive()
    assert not h.errors
    # the thread's turn, taken by hand: while steps run it leaves the sampling to them ...
    n = len(samples())
    h.next_sample_ns = 0
    h.last_step_ns = time.time_ns() + 10**12  # a step "ends" far ahead: always busy
    assert not sampling._idle_sample(h) and len(samples()) == n
    # ... and once the engine has been idle for an interval it samples
    h.last_step_ns = time.time_ns() - 2 * INTERVAL_NS
    assert sampling._idle_sample(h) and len(samples()) == n + 1
