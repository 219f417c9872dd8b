"""The vLLM plugin's view of vLLM's KV block pool: its size (``KVPoolInfo``), its occupancy now
(``KVPoolSample``: blocks held, cached only, free; tokens computed by running requests) and the
sampling of it within :data:`SAMPLE_BUDGET` of the engine core's time, from the step or, while
the engine is idle, from a daemon thread (the module doc of
:mod:`kvdiag.collectors.vllm_plugin`).
"""

from __future__ import annotations

import threading
import time

from kvdiag.collectors.vllm_hook_state import Hooks, now_ns
from kvdiag.events.schema import KVPoolInfo, KVPoolSample

SAMPLE_BUDGET = 0.005
"""Share of the engine core's time the periodic pool sample may take (it walks every block)."""


def pool_info(sched) -> KVPoolInfo:
    """The pool's size and layout, from the scheduler vLLM just built."""
    mgr = sched.kv_cache_manager
    pool = mgr.block_pool
    cfg = sched.kv_cache_config
    num_blocks = int(pool.num_gpu_blocks) - 1  # block 0 is vLLM's null placeholder
    group = cfg.kv_cache_groups[0]
    spec = group.kv_cache_spec
    total_bytes = sum(int(t.size) for t in getattr(cfg, "kv_cache_tensors", ()) or ())
    block_bytes = (total_bytes // int(cfg.num_blocks) if total_bytes and cfg.num_blocks
                   else int(spec.page_size_bytes) * len(group.layer_names))
    return KVPoolInfo(ts_ns=now_ns(), num_blocks=num_blocks, block_size_tokens=int(spec.block_size),
                      block_bytes=block_bytes, num_layers=sum(len(g.layer_names) for g in cfg.kv_cache_groups),
                      num_kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0),
                      head_dim=int(getattr(spec, "head_size", 0) or 0),
                      dtype=str(getattr(spec, "dtype", "")).replace("torch.", ""),
                      prefix_sharing=bool(mgr.enable_caching))


def pool_sample(sched) -> KVPoolSample:
    """Occupancy of vLLM's pool now: blocks held by requests (ref count > 0), blocks kept only
    by the prefix cache (hashed, ref count 0), free ones, and the tokens the running requests
    have computed (their KV slots actually written)."""
    pool = sched.kv_cache_manager.block_pool
    used = cached = 0
    for b in pool.blocks:
        if b.is_null:
            continue
        if b.ref_cnt > 0:
            used += 1
        elif b.block_hash is not None:
            cached += 1
    num_blocks = int(pool.num_gpu_blocks) - 1
    tokens = sum(int(r.num_computed_tokens) for r in list(sched.running))
    return KVPoolSample(ts_ns=now_ns(), num_blocks=num_blocks, blocks_used=used, blocks_cached=cached,
                        blocks_free=num_blocks - used - cached, tokens_held=tokens,
                        running_requests=len(sched.running), waiting_requests=len(sched.waiting))


def take_sample(h: Hooks, sched, now: int) -> None:
    """One pool sample; the next one is due a sample interval later, or later still on a
    large pool, so that sampling costs at most :data:`SAMPLE_BUDGET` of the time. The cost is
    the CPU time of the thread that sampled, not wall time: a thread that waited for the GIL
    while the engine worked did not cost that wait (as wall time, a wait of 60 ms would hold the
    next sample back 12 s). The caller holds ``h.sample_lock``."""
    started_ns = time.thread_time_ns()
    h.record(pool_sample(sched))
    cost_ns = time.thread_time_ns() - started_ns
    h.next_sample_ns = now + max(h.sample_interval_ns, int(cost_ns / SAMPLE_BUDGET))


def _idle_sample(h: Hooks) -> bool:
    """The idle thread's turn: a pool sample when one is due and the engine took no step for a
    sample interval (it waits for requests). True when it took one."""
    sched = h.scheduler
    now = now_ns()
    if sched is None or now < h.next_sample_ns or now - h.last_step_ns < h.sample_interval_ns:
        return False
    if not h.sample_lock.acquire(blocking=False):
        return False
    try:
        take_sample(h, sched, now)
    finally:
        h.sample_lock.release()
    return True


def start_idle_sampler(h: Hooks) -> None:
    """The daemon thread that samples the pool while the engine is idle (module doc)."""
    if h.idle_thread is not None or h.sample_interval_ns <= 0:
        return

    def run() -> None:
        while not h.idle_stop.wait(h.sample_interval_ns / 1e9):
            try:
                _idle_sample(h)
            except Exception as exc:  # never into vLLM; counted like a hook's error
                h.failed("idle_pool_sample", exc)

    h.idle_thread = threading.Thread(target=run, name="kvdiag-vllm-idle-sampler", daemon=True)
    h.idle_thread.start()
