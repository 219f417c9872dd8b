"""The hooks of the transformers continuous-batching adapter
(:class:`kvdiag.collectors.transformers_cb.TransformersCBAdapter`): which engine methods it wraps
(:data:`PATCHES`, in install order) and what each wrapper hands the adapter; the engine's
classes, and its block hashes folded to 63 bits.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

from kvdiag.events.hooks import MethodHooks
from kvdiag.events.schema import (
    MASK63,
    BlockAllocated,
    BlockEvicted,
    PrefixHit,
)

if TYPE_CHECKING:  # the adapter imports this module; hooks only call it
    from kvdiag.collectors.transformers_cb import TransformersCBAdapter


def fold_hash(block_hash: Optional[int]) -> Optional[int]:
    """The engine's 64-bit blake2b block hash folded to 63 bits (fits an int64 column)."""
    if block_hash is None:
        return None
    return (block_hash ^ (block_hash >> 63)) & MASK63


def engine_classes() -> dict[str, type]:
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching import continuous_api, requests, scheduler
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator
    from transformers.generation.continuous_batching.cache_allocators import full_attention, sliding_attention

    return {
        "PagedAttentionCache": cb_cache.PagedAttentionCache,
        "CacheAllocator": cache_allocator.CacheAllocator,
        "BlockLedger": cache_allocator.BlockLedger,
        "FullAttentionCacheAllocator": full_attention.FullAttentionCacheAllocator,
        "SlidingAttentionCacheAllocator": sliding_attention.SlidingAttentionCacheAllocator,
        "Scheduler": scheduler.Scheduler,
        "RequestState": requests.RequestState,
        "ContinuousBatchProcessor": continuous_api.ContinuousBatchProcessor,
        "ContinuousBatchingManager": continuous_api.ContinuousBatchingManager,
    }


# One function per hooked engine method: ``hook(adapter, methods, cls, name)`` installs it
# through :class:`kvdiag.events.hooks.MethodHooks` (signature checked, errors counted and reported by
# the one policy, never raised into the engine). Most are ``before``/``after`` pairs around the
# engine's own call; the two whose control flow differs (finish_request's fault injection, the
# status property) replace the method and guard their own part.


def _request_status() -> type:
    from transformers.generation.continuous_batching.requests import RequestStatus

    return RequestStatus


def _hook_cache_init(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type, name: str) -> None:
    """``PagedAttentionCache.__init__``: the pool's geometry (``KVPoolInfo``)."""
    methods.wrap(cls, name, lambda _note, _result, cache, *a, **kw: adapter._on_cache_created(cache))


def _hook_search_prefix_match(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type,
                              name: str) -> None:
    """``PagedAttentionCache.search_prefix_match``: the request's cached prompt tokens."""
    def after(_note, matched, _cache, request_id, prompt_ids):
        req = adapter._request(request_id) if matched else None
        if req is not None:
            req.cached_tokens = matched
    methods.wrap(cls, name, after, params=("request_id", "prompt_ids"))


def _hook_acquire_prefix_blocks(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type,
                                name: str) -> None:
    """``CacheAllocator.acquire_prefix_blocks``: one ``PrefixHit`` per reused block."""
    def after(_note, _result, allocator, request_id, prefix_len, block_ids):
        now = adapter.clock_ns()
        block_to_hash = allocator.ledger.block_to_hash
        page = allocator.tokens_per_page
        for block_id in allocator.block_table.get(request_id, ()):
            adapter._emit(PrefixHit(ts_ns=now, request_id=request_id, block_id=block_id,
                                    block_hash=fold_hash(block_to_hash.get(block_id)),
                                    num_tokens=page))
    methods.wrap(cls, name, after, params=("request_id", "prefix_len", "block_ids"))


def _hook_mark_complete_blocks(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type,
                               name: str) -> None:
    """``CacheAllocator.mark_complete_blocks``: newly hashed blocks (``BlockStored``) and
    blocks swapped for an identical hashed one (``BlockDeduplicated`` + ``BlockReleased``)."""
    def before(allocator, request_id, token_ids, new_new_blocks):
        table = allocator.block_table.get(request_id)
        held = list(table) if table is not None else []
        block_to_hash = allocator.ledger.block_to_hash
        hashed_before = 0
        for block_id in held:
            if block_id not in block_to_hash:
                break
            hashed_before += 1
        return held, hashed_before

    def after(note, _result, allocator, request_id, token_ids, new_new_blocks):
        held, hashed_before = note
        adapter._on_marked(allocator, request_id, token_ids, held, hashed_before)
    methods.wrap(cls, name, after, before, params=("request_id", "token_ids", "new_new_blocks"))


def _hook_free_blocks(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type, name: str) -> None:
    """``CacheAllocator.free_blocks``: ``BlockReleased`` per held block (``RequestPreempted``
    first when ``no_cache``)."""
    def before(allocator, request_id, no_cache=False):
        return list(allocator.block_table.get(request_id, ()))

    def after(held, _result, allocator, request_id, no_cache=False):
        if held:
            adapter._on_freed(allocator, request_id, held, no_cache)
    methods.wrap(cls, name, after, before, params=("request_id", "no_cache"))


def _hook_allocate(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type, name: str) -> None:
    """``*CacheAllocator.allocate_cache_to_request``: one ``BlockAllocated`` per fresh block,
    with the free-block count as it stood right after that block was taken."""
    def before(allocator, request_id, past_length, query_length):
        table = allocator.block_table.get(request_id)
        return len(table) if table is not None else 0

    def after(start, _result, allocator, request_id, past_length, query_length):
        table = allocator.block_table.get(request_id)
        if table is not None and len(table) > start:
            now = adapter.clock_ns()
            free = adapter._free_blocks_of(allocator)
            fresh = table[start:]
            for i, block_id in enumerate(fresh):
                adapter._emit(BlockAllocated(ts_ns=now, request_id=request_id, block_id=block_id,
                                             num_blocks_free=free + len(fresh) - 1 - i))
    methods.wrap(cls, name, after, before, params=("request_id", "past_length", "query_length"))


def _hook_evict(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type, name: str) -> None:
    """``BlockLedger.evict_cached_blocks``: one ``BlockEvicted`` per evicted cached block."""
    def before(ledger):
        return {block_id: ledger.block_to_hash.get(block_id) for block_id in ledger.cached_blocks}

    def after(hashes, evicted, _ledger):
        now = adapter.clock_ns()
        for block_id in evicted:
            adapter._emit(BlockEvicted(ts_ns=now, block_id=block_id,
                                       block_hash=fold_hash(hashes.get(block_id))))
    methods.wrap(cls, name, after, before)


def _hook_finish_request(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type,
                         name: str) -> None:
    """``Scheduler.finish_request``: ``RequestFinished``; with ``inject_leak_every=N`` every
    N-th request is dropped without the engine's release of its blocks (fault injection)."""
    failed = _request_status().FAILED
    where = f"{cls.__name__}.{name}"

    def make(orig: Callable) -> Callable:
        def finish_request(self, request_id):
            with adapter._lock:
                preempted = request_id in adapter._preempted
                adapter._preempted.discard(request_id)
            if preempted:  # the engine's preemption drops the request to requeue it: no finish
                return orig(self, request_id)
            state = self.active_requests.get(request_id)
            leak = False
            if adapter.inject_leak_every > 0:
                adapter._finished_count += 1
                leak = adapter._finished_count % adapter.inject_leak_every == 0
            if leak:  # fault injection: really skip the engine's release path
                self.active_requests.pop(request_id, None)
                adapter.leaked_requests.append(request_id)
            else:
                orig(self, request_id)
            with methods.errors.guard(where):
                adapter._on_finished(request_id, state, "failed" if state is not None
                                     and state.status == failed else "finished")
        return finish_request
    methods.replace(cls, name, make, params=("request_id",))


def _hook_clear_cancelled(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type,
                          name: str) -> None:
    """``Scheduler.clear_cancelled_requests``: ``RequestFinished(status="aborted")`` each."""
    def after(_note, states, _scheduler):
        for state in states:
            adapter._on_finished(state.request_id, state, "aborted")
    methods.wrap(cls, name, after)


def _hook_status(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type, name: str) -> None:
    """The ``RequestState.status`` property: ``RequestScheduled`` when a request leaves
    PENDING for a state before FINISHED."""
    status_enum = _request_status()
    pending, finished_min = status_enum.PENDING, status_enum.FINISHED
    where = f"{cls.__name__}.{name}"

    def make(orig_property: property) -> property:
        fget, fset = orig_property.fget, orig_property.fset

        def set_status(self, value):
            old = self._status
            fset(self, value)
            if old == pending and value != pending and value < finished_min:
                with methods.errors.guard(where):
                    adapter._on_scheduled(self.request_id)
        return property(fget, set_status, orig_property.fdel, orig_property.__doc__)
    methods.replace(cls, name, make)


def _hook_update(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type, name: str) -> None:
    """``RequestState.update_and_check_completion``: ``RequestFirstToken`` on the first token."""
    def before(state, token_id, logprob):
        return not state.generated_tokens

    def after(first, _done, state, token_id, logprob):
        if first and state.generated_tokens:
            adapter._on_first_token(state.request_id)
    methods.wrap(cls, name, after, before, params=("token_id", "logprob"))


def _hook_generation_step(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type,
                          name: str) -> None:
    """``ContinuousBatchProcessor._generation_step``: ``EngineStep`` (wall time of forward and
    sampling, perf_counter ns) and a periodic ``KVPoolSample``."""
    def before(processor, model):
        return adapter.clock_ns(), time.perf_counter_ns()

    def after(note, _result, processor, model):
        duration_ns = time.perf_counter_ns() - note[1]
        adapter._on_step(processor, note[0], duration_ns)
    methods.wrap(cls, name, after, before, params=("model",))


def _hook_add_request(adapter: TransformersCBAdapter, methods: MethodHooks, cls: type,
                      name: str) -> None:
    """``ContinuousBatchingManager.add_request``: ``RequestArrived`` (before the engine sees it
    when the caller names the request), or ``RequestFinished(status="failed")`` if refused."""
    def before(manager, input_ids, request_id=None, max_new_tokens=None, *args, **kwargs):
        now = adapter.clock_ns()
        if request_id is not None:
            adapter._on_arrived(request_id, input_ids, max_new_tokens, now)
        return now

    def after(now, rid, manager, input_ids, request_id=None, max_new_tokens=None, *args, **kwargs):
        if request_id is None and rid is not None:
            adapter._on_arrived(rid, input_ids, max_new_tokens, now)
        elif rid is None and request_id is not None:  # the engine refused it
            adapter._on_finished(request_id, None, "failed")
    methods.wrap(cls, name, after, before, params=("input_ids", "request_id", "max_new_tokens"))


# (engine class, attribute, hook): what ``install`` hooks, in this order, and ``uninstall``
# puts back in reverse.
PATCHES: list[tuple[str, str, Callable[[TransformersCBAdapter, MethodHooks, type, str], None]]] = [
    ("PagedAttentionCache", "__init__", _hook_cache_init),
    ("PagedAttentionCache", "search_prefix_match", _hook_search_prefix_match),
    ("CacheAllocator", "acquire_prefix_blocks", _hook_acquire_prefix_blocks),
    ("CacheAllocator", "mark_complete_blocks", _hook_mark_complete_blocks),
    ("CacheAllocator", "free_blocks", _hook_free_blocks),
    ("FullAttentionCacheAllocator", "allocate_cache_to_request", _hook_allocate),
    ("SlidingAttentionCacheAllocator", "allocate_cache_to_request", _hook_allocate),
    ("BlockLedger", "evict_cached_blocks", _hook_evict),
    ("Scheduler", "finish_request", _hook_finish_request),
    ("Scheduler", "clear_cancelled_requests", _hook_clear_cancelled),
    ("RequestState", "status", _hook_status),
    ("RequestState", "update_and_check_completion", _hook_update),
    ("ContinuousBatchProcessor", "_generation_step", _hook_generation_step),
    ("ContinuousBatchingManager", "add_request", _hook_add_request),
]
