"""The vLLM plugin's hooks on vLLM's scheduler, KV cache manager and block pool: each records the
kvdiag events of the table in :mod:`kvdiag.collectors.vllm_plugin`'s module doc, after vLLM's own
method ran unchanged. :func:`wrap_scheduler` installs them.
"""

from __future__ import annotations

import hashlib
import time
from typing import Optional

from kvdiag.collectors.vllm_agent_setup import start_agent
from kvdiag.collectors.vllm_hook_state import Hooks, fold_hash, now_ns
from kvdiag.collectors.vllm_pool_sampling import pool_info, start_idle_sampler, take_sample
from kvdiag.events.hooks import step_phase
from kvdiag.pool.hashing import CONTENT_CHUNK_TOKENS, block_chunk_hashes, salted_chunk_hashes
from kvdiag.events.schema import (BlockAllocated, BlockHash, BlockEvicted, BlockReleased, BlockStored,
                           EngineStep, PrefixHit, RequestArrived, RequestFinished, RequestFirstToken,
                           RequestPreempted, RequestScheduled, elapsed_ns)


# ------------------------------------------------------------------------------ the hooks


def _scheduler_init(h: Hooks):
    def after(_note, _result, sched, *args, **kwargs) -> None:
        h.scheduler = sched
        start_agent(h, sched)
        info = pool_info(sched)
        h.block_size_tokens = info.block_size_tokens
        h.record(info)
        start_idle_sampler(h)
    return after


def _add_request(h: Hooks):
    def before(sched, request, *a, **kw) -> bool:
        return request.request_id in sched.requests  # a streaming update, not a new request

    def after(existed, _result, sched, request, *a, **kw) -> None:
        if existed:
            return
        params = getattr(request, "sampling_params", None)
        token_ids = [int(t) for t in request.prompt_token_ids or []]
        salt = None if h.record_token_ids else h.content_salt
        h.record(RequestArrived(ts_ns=now_ns(), request_id=str(request.request_id),
                                prompt_tokens=int(request.num_prompt_tokens),
                                token_ids=token_ids if h.record_token_ids else None,
                                chunk_hashes=None if salt is None else [
                                    BlockHash(int(k)) for k in salted_chunk_hashes(token_ids, salt)],
                                partial_tokens=None if salt is None
                                else len(token_ids) % CONTENT_CHUNK_TOKENS,
                                max_new_tokens=getattr(params, "max_tokens", None),
                                cache_domain=cache_domain(request, h.content_salt)))
    return before, after


def cache_domain(request, salt: Optional[str] = None) -> Optional[str]:
    """The hash domain vLLM folds into a request's block hashes beside its tokens
    (``kv_cache_utils.generate_block_hash_extra_keys``: the ``cache_salt`` and the LoRA adapter's
    name and path; multimodal keys, which change only some blocks, are left out) as a 16-hex
    digest keyed by the log's salt (the cache salt itself is not recorded); None when default."""
    parts = []
    if getattr(request, "cache_salt", None):
        parts.append(("cache_salt", str(request.cache_salt)))
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(("lora", str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", ""))))
    if not parts:
        return None
    return hashlib.blake2b(repr((salt or "", parts)).encode(), digest_size=8).hexdigest()


def _allocate_slots(h: Hooks):
    def before(mgr, request, *a, **kw) -> Optional[str]:
        previous, h.current_request = h.current_request, str(request.request_id)
        return previous

    def after(previous, result, mgr, request, *a, **kw) -> None:
        h.current_request = previous
        rid = str(request.request_id)
        if result is not None and rid not in h.scheduled:  # None: no room, it waits on
            h.scheduled.add(rid)
            arrival = getattr(request, "arrival_time", None)
            h.record(RequestScheduled(ts_ns=now_ns(), request_id=rid,
                                      queue_ns=elapsed_ns(arrival * 1e9, now_ns()) if arrival else None))
    return before, after


def _get_new_blocks(h: Hooks):
    def after(_note, blocks, pool, *a, **kw) -> None:
        rid = h.current_request or "?"
        free = pool.get_num_free_blocks()
        for b in blocks:
            h.record(BlockAllocated(ts_ns=now_ns(), request_id=rid, block_id=int(b.block_id),
                                    num_blocks_free=free))
    return after


def _touch(h: Hooks):
    def after(_note, _result, pool, blocks, *a, **kw) -> None:
        rid = h.current_request
        if rid is None:  # a touch outside a request's allocation (none in vLLM 0.32)
            return
        for b in blocks:
            if not b.is_null:
                # a touched block is a full cached block the request reuses instead of computing
                h.record(PrefixHit(ts_ns=now_ns(), request_id=rid, block_id=int(b.block_id),
                                   block_hash=fold_hash(b.block_hash), num_tokens=h.block_size_tokens))
    return after


def _cache_full_blocks(h: Hooks):
    def after(_note, _result, pool, request, blocks, num_cached_blocks, num_full_blocks,
              block_size, *a, **kw) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        tokens = request.all_token_ids
        keys = None  # hashes mode: the salted chunk keys of the full blocks, hashed once
        if not h.record_token_ids and h.content_salt is not None:
            keys = salted_chunk_hashes([int(t) for t in tokens[:num_full_blocks * block_size]],
                                       h.content_salt)
        parent = fold_hash(blocks[num_cached_blocks - 1].block_hash) if num_cached_blocks else None
        for i in range(num_cached_blocks, num_full_blocks):
            b = blocks[i]
            key = fold_hash(b.block_hash)
            if b.is_null or key is None:
                continue
            h.record(BlockStored(ts_ns=now_ns(), block_id=int(b.block_id), block_hash=key,
                                 parent_hash=parent, num_tokens=int(block_size),
                                 request_id=str(request.request_id),
                                 token_ids=list(tokens[i * block_size:(i + 1) * block_size])
                                 if h.record_token_ids else None,
                                 chunk_hashes=None if keys is None else block_chunk_hashes(
                                     tokens, i, int(block_size), h.content_salt, keys=keys)))
            parent = key
    return after


def _evict(h: Hooks):
    def before(pool, block, *a, **kw) -> Optional[int]:
        return fold_hash(block.block_hash)

    def after(key, evicted, pool, block, *a, **kw) -> None:
        if evicted:
            h.record(BlockEvicted(ts_ns=now_ns(), block_id=int(block.block_id), block_hash=key))
    return before, after


def _release(h: Hooks):
    """``KVCacheManager.free`` and ``pop_blocks_for_free``: the request lets its blocks go."""
    def before(mgr, request, *a, **kw) -> list:
        groups = mgr.coordinator.get_blocks(request.request_id)
        return [b for b in (groups[0] if groups else ()) if not b.is_null]

    def after(blocks, _result, mgr, request, *a, **kw) -> None:
        rid = str(request.request_id)
        free = mgr.block_pool.get_num_free_blocks()
        for b in reversed(blocks or ()):  # vLLM frees tail first
            h.record(BlockReleased(ts_ns=now_ns(), request_id=rid, block_id=int(b.block_id),
                                   cached=b.block_hash is not None, num_blocks_free=free))
    return before, after


def _prefix_cache_stats(h: Hooks):
    def after(_note, _result, mgr, request, num_hits, *a, **kw) -> None:
        h.cached_tokens.setdefault(str(request.request_id), int(num_hits))
    return after


_STATUS = {"FINISHED_ABORTED": "aborted", "FINISHED_ERROR": "failed"}


def _free_request(h: Hooks):
    def after(_note, _result, sched, request, *a, **kw) -> None:
        h.scheduled.discard(str(request.request_id))
        now = now_ns()
        arrival = getattr(request, "arrival_time", None)
        status = _STATUS.get(getattr(request.status, "name", ""), "finished")
        h.record(RequestFinished(ts_ns=now, request_id=str(request.request_id),
                                 prompt_tokens=int(request.num_prompt_tokens),
                                 output_tokens=int(request.num_output_tokens),
                                 cached_prompt_tokens=h.cached_tokens.pop(str(request.request_id), 0),
                                 status=status, ttft_ns=h.first_token_ns.pop(str(request.request_id), None),
                                 e2e_ns=elapsed_ns(arrival * 1e9, now) if arrival else None))
    return after


def _preempt(h: Hooks):
    def after(_note, _result, sched, request, *a, **kw) -> None:
        h.record(RequestPreempted(ts_ns=now_ns(), request_id=str(request.request_id)))
    return after


def _schedule(h: Hooks):
    def before(sched, *a, **kw) -> int:
        return time.perf_counter_ns()

    def after(started, output, sched, *a, **kw) -> None:
        if output is not None and started is not None:
            h.step_started[id(output)] = started
    return before, after


def _update_from_output(h: Hooks):
    def after(_note, _result, sched, scheduler_output, *a, **kw) -> None:
        started = h.step_started.pop(id(scheduler_output), None)
        for rid in getattr(scheduler_output, "num_scheduled_tokens", {}) or {}:
            request = sched.requests.get(rid)
            if (request is not None and rid not in h.first_token_ns and request.num_output_tokens > 0
                    and getattr(request, "arrival_time", None)):
                ttft = elapsed_ns(request.arrival_time * 1e9, now_ns())
                h.first_token_ns[str(rid)] = ttft
                h.record(RequestFirstToken(ts_ns=now_ns(), request_id=str(rid), ttft_ns=ttft))
        if len(h.step_started) > 64:  # outputs never updated (aborted steps)
            h.step_started.clear()
        per_request: dict = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        if started is not None and per_request:
            decode = sum(1 for n in per_request.values() if n == 1)
            total = int(sum(per_request.values()))
            prefill = total - decode
            h.step_id += 1
            h.record(EngineStep(ts_ns=now_ns(), step_id=h.step_id, phase=step_phase(prefill, decode),
                                batch_size=len(per_request), num_tokens=total,
                                duration_ns=time.perf_counter_ns() - started,
                                prefill_tokens=prefill, decode_tokens=decode))
        now = now_ns()
        h.last_step_ns = now
        # the sample walks the pool's blocks: on a large pool, sample less often so that it
        # costs the scheduler at most SAMPLE_BUDGET of its time; never wait for the idle thread
        if now >= h.next_sample_ns and h.sample_lock.acquire(blocking=False):
            try:
                take_sample(h, sched, now)
            finally:
                h.sample_lock.release()
    return after


def _shutdown(h: Hooks):
    def after(_note, _result, sched, *a, **kw) -> None:
        if h.agent is not None:
            h.agent_api.stop()
    return after


def wrap_scheduler(h: Hooks) -> None:
    """Wrap vLLM's scheduler, KV cache manager and block pool methods with the hooks above
    (each skipped, and said, where vLLM's method or a parameter it reads is missing)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    h.wrap(Scheduler, "__init__", (), _scheduler_init(h))
    before, after = _add_request(h)
    h.wrap(Scheduler, "add_request", ("request",), after, before)
    before, after = _allocate_slots(h)
    h.wrap(KVCacheManager, "allocate_slots", ("request",), after, before)
    h.wrap(BlockPool, "get_new_blocks", ("num_blocks",), _get_new_blocks(h))
    h.wrap(BlockPool, "touch", ("blocks",), _touch(h))
    h.wrap(BlockPool, "cache_full_blocks",
           ("request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size"), _cache_full_blocks(h))
    before, after = _evict(h)
    h.wrap(BlockPool, "_maybe_evict_cached_block", ("block",), after, before)
    for name in ("free", "pop_blocks_for_free"):
        before, after = _release(h)
        h.wrap(KVCacheManager, name, ("request",), after, before)
    h.wrap(KVCacheManager, "record_prefix_cache_stats", ("request", "num_hits"), _prefix_cache_stats(h))
    h.wrap(Scheduler, "_free_request", ("request",), _free_request(h))
    h.wrap(Scheduler, "_preempt_request", ("request",), _preempt(h))
    before, after = _schedule(h)
    h.wrap(Scheduler, "schedule", (), after, before)
    h.wrap(Scheduler, "update_from_output", ("scheduler_output",), _update_from_output(h))
    h.wrap(Scheduler, "shutdown", (), _shutdown(h))
