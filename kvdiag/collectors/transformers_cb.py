"""Engine adapter for transformers' continuous-batching engine and its paged KV cache.

``install(sink)`` wraps methods of the engine's classes (``PagedAttentionCache``,
``CacheAllocator`` and its subclasses, ``BlockLedger``, ``Scheduler``, ``RequestState``,
``ContinuousBatchProcessor``, ``ContinuousBatchingManager``) so that every engine in the
process, including the one running in the engine's own generation thread, reports schema
events; ``uninstall()`` puts the original class attributes back (the same objects).

What is observed, and where:

- request lifecycle: ``add_request`` (arrival, with prompt token ids), the ``RequestState.status``
  setter (leaving PENDING = scheduled), ``update_and_check_completion`` (first token),
  ``Scheduler.finish_request`` / ``clear_cancelled_requests`` (finished / aborted);
- KV blocks: ``allocate_cache_to_request`` (fresh blocks), ``search_prefix_match`` and
  ``acquire_prefix_blocks`` (prefix hits), ``mark_complete_blocks`` (hash registration and
  on-the-spot de-duplication), ``free_blocks`` (release, cached or not; ``no_cache`` =
  preemption), ``BlockLedger.evict_cached_blocks`` (eviction);
- preemption: when the pool cannot hold the next step, the engine's ``OffloadingManager``
  (transformers >= 5.2x) evicts cached blocks, then frees running requests' blocks with
  ``free_blocks(no_cache=True)`` (``RequestPreempted``), copies them to a CPU swap pool if one
  is configured or else "soft resets" them (prompt + generated tokens re-prefilled later), and
  requeues them through ``Scheduler.finish_request`` + ``add_waiting_request``. That
  ``finish_request`` is not the request's end: no ``RequestFinished`` is emitted for it; the
  request is scheduled again later (a second ``RequestScheduled``), keeps its first-token time,
  and finishes once with all its output tokens;
- steps: ``ContinuousBatchProcessor._generation_step`` (forward + sampling time, batch
  composition) and a ``KVPoolSample`` at most every ``sample_interval_s``.

The hooks do no per-token work beyond one wrapper call in ``update_and_check_completion``;
block-level work happens only when blocks change hands. Hooks are installed through
:class:`kvdiag.events.hooks.MethodHooks`: a method whose signature changed is skipped and said
(``CollectorStatus``); a hook that fails is counted, the first of each (hook, error type) is
reported as a ``CollectorError`` and each hook's total at uninstall; nothing propagates into
the engine.

Fault injection (testing only): with ``inject_leak_every=N`` the adapter really skips the
engine's release of every N-th finished request's blocks (``Scheduler.finish_request`` drops
the request without calling ``cache.free_blocks``), so the pool leaks as it would with a
broken release path.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Callable, Optional

from kvdiag.events.hooks import HookErrors, MethodHooks, step_phase
from kvdiag.pool.hashing import CONTENT_CHUNK_TOKENS, block_chunk_hashes, salted_chunk_hashes
from kvdiag.events.schema import (
    MASK63,
    elapsed_ns,
    BlockAllocated,
    BlockHash,
    BlockDeduplicated,
    BlockEvicted,
    BlockReleased,
    BlockStored,
    EngineStep,
    Event,
    KVPoolInfo,
    KVPoolSample,
    PrefixHit,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestScheduled,
)
from kvdiag.events.sinks import Sink

COLLECTOR = "transformers-cb"


def fold_hash(block_hash: Optional[int]) -> Optional[int]:
    """The engine's 64-bit blake2b block hash folded to 63 bits (fits an int64 column)."""
    if block_hash is None:
        return None
    return (block_hash ^ (block_hash >> 63)) & MASK63


def _engine_classes() -> dict[str, type]:
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


def patch_points() -> list[tuple[type, str]]:
    """The (class, attribute) pairs the adapter replaces while installed."""
    c = _engine_classes()
    return [(c[class_key], name) for class_key, name, _ in _PATCHES]


class _Request:
    """What the adapter remembers about a live request (times are wall-clock ns)."""

    __slots__ = ("arrived_ns", "first_token_ns", "cached_tokens", "prompt_tokens")

    def __init__(self, arrived_ns: int, prompt_tokens: int) -> None:
        self.arrived_ns = arrived_ns
        self.first_token_ns: Optional[int] = None
        self.cached_tokens = 0
        self.prompt_tokens = prompt_tokens


class TransformersCBAdapter:
    """Turns the engine's cache and scheduling calls into schema events sent to ``sink``."""

    def __init__(self, sink: Sink, sample_interval_s: float = 0.5, inject_leak_every: int = 0,
                 record_token_ids: bool = False, content_salt: Optional[str] = None,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.sink = sink
        self.clock_ns = clock_ns  # wall-clock ns of every event (tests inject one)
        self.sample_interval_ns = int(sample_interval_s * 1e9)
        self.inject_leak_every = inject_leak_every
        self.record_token_ids = record_token_ids
        # hashes mode (no token ids): content as chunk hashes under this salt (None: no content)
        self.content_salt = None if record_token_ids else content_salt
        self.leaked_requests: list[str] = []
        # the one error policy of engine adapters (kvdiag.events.hooks): errors per hook
        self.error_policy = HookErrors(sink, COLLECTOR, clock_ns=clock_ns)
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._methods = MethodHooks(self.error_policy)
        self._step_id = 0
        self._finished_count = 0
        # requests whose KV was just freed by a preemption (free_blocks(no_cache=True)): the
        # engine then calls Scheduler.finish_request on them and requeues them; that is not
        # their end
        self._preempted: set[str] = set()
        self._last_sample_ns = 0
        self._processor_ref: Optional[weakref.ref] = None

    # ------------------------------------------------------------------ plumbing

    @property
    def installed(self) -> bool:
        return bool(self._methods.installed)

    @property
    def error_count(self) -> int:
        """Errors in the hooks and the sink, all counted (:class:`kvdiag.events.hooks.HookErrors`)."""
        return self.error_policy.total

    @property
    def skipped(self) -> dict[str, str]:
        """Hooks not installed (method missing or signature changed) -> why."""
        return self._methods.skipped

    def _emit(self, event: Event) -> None:
        self.error_policy.record(event)  # a sink must never break the engine

    def _failed(self, where: str, exc: BaseException) -> None:
        self.error_policy.failed(where, exc)

    def _request(self, request_id: str) -> Optional[_Request]:
        return self._requests.get(request_id)

    @staticmethod
    def _free_blocks_of(allocator) -> int:
        pool = allocator.pool
        return len(pool.free_sectors) * allocator.blocks_per_sector + pool.count_free_blocks(allocator.index)

    # ------------------------------------------------------------------ install

    def install(self) -> "TransformersCBAdapter":
        """Wrap the engine's methods; idempotent per adapter, exclusive per process."""
        if self.installed:
            return self
        global _ACTIVE
        if _ACTIVE is not None and _ACTIVE is not self:
            raise RuntimeError("another transformers-cb adapter is installed; uninstall it first")
        c = _engine_classes()
        for class_key, name, hook in _PATCHES:
            hook(self, self._methods, c[class_key], name)
        for status in self._methods.statuses():  # hooks whose engine method changed
            self._emit(status)
        _ACTIVE = self
        return self

    def uninstall(self) -> None:
        """Put back the original class attributes, exactly as they were; report the total of
        each hook that failed more than once."""
        global _ACTIVE
        self._methods.restore()
        self.error_policy.report_totals()
        if _ACTIVE is self:
            _ACTIVE = None

    def sample_now(self) -> None:
        """Emit a ``KVPoolSample`` of the last engine seen (e.g. before the log closes)."""
        processor = self._processor_ref() if self._processor_ref is not None else None
        if processor is not None:
            self._sample(processor, self.clock_ns())

    # ------------------------------------------------------------------ event builders

    def _on_cache_created(self, cache) -> None:
        from transformers.generation.continuous_batching.utils import find_head_dim

        allocators = list(cache.cache_allocators.values())
        first = allocators[0]
        self._emit(KVPoolInfo(
            ts_ns=self.clock_ns(),
            num_blocks=int(cache.num_blocks),
            block_size_tokens=int(first.tokens_per_page),
            block_bytes=int(sum(a.bytes_per_block for a in allocators)),
            num_layers=int(cache.config.num_hidden_layers),
            num_kv_heads=int(getattr(first, "num_key_value_heads", 0)),
            head_dim=int(find_head_dim(cache.config)),
            dtype=str(cache.dtype).replace("torch.", ""),
            prefix_sharing=bool(cache.use_prefix_sharing),
        ))

    def _on_arrived(self, request_id: str, input_ids, max_new_tokens, now: int) -> None:
        token_ids = [int(t) for t in input_ids]
        with self._lock:
            self._requests[request_id] = _Request(now, len(token_ids))
        salt = self.content_salt
        self._emit(RequestArrived(
            ts_ns=now, request_id=request_id, prompt_tokens=len(token_ids),
            max_new_tokens=max_new_tokens, token_ids=token_ids if self.record_token_ids else None,
            chunk_hashes=None if salt is None else [
                BlockHash(int(h)) for h in salted_chunk_hashes(token_ids, salt)],
            partial_tokens=None if salt is None else len(token_ids) % CONTENT_CHUNK_TOKENS))

    def _on_scheduled(self, request_id: str) -> None:
        now = self.clock_ns()
        req = self._request(request_id)
        self._emit(RequestScheduled(ts_ns=now, request_id=request_id,
                                    queue_ns=None if req is None else elapsed_ns(req.arrived_ns, now)))

    def _on_first_token(self, request_id: str) -> None:
        now = self.clock_ns()
        req = self._request(request_id)
        if req is None or req.first_token_ns is not None:  # a preempted request starts over
            return
        req.first_token_ns = now
        self._emit(RequestFirstToken(ts_ns=now, request_id=request_id, ttft_ns=elapsed_ns(req.arrived_ns, now)))

    def _on_finished(self, request_id: str, state, status: str) -> None:
        now = self.clock_ns()
        with self._lock:
            req = self._requests.pop(request_id, None)
        prompt = req.prompt_tokens if req is not None else len(getattr(state, "initial_tokens", ()) or ())
        output = len(state.generated_tokens) if state is not None else 0
        true_initial = getattr(state, "_true_initial_tokens", 0) or 0
        if true_initial:  # soft reset after a preemption: earlier output became prompt
            output += max(len(state.initial_tokens) - true_initial, 0)
        self._emit(RequestFinished(
            ts_ns=now, request_id=request_id, prompt_tokens=prompt, output_tokens=output,
            cached_prompt_tokens=req.cached_tokens if req is not None else 0, status=status,
            e2e_ns=None if req is None else elapsed_ns(req.arrived_ns, now),
            ttft_ns=(None if req is None or req.first_token_ns is None
                     else elapsed_ns(req.arrived_ns, req.first_token_ns)),
        ))

    def _on_marked(self, allocator, request_id: str, token_ids, before: list, hashed_before: int) -> None:
        table = allocator.block_table.get(request_id)
        if table is None:
            return
        now = self.clock_ns()
        ledger = allocator.ledger
        page = allocator.tokens_per_page
        for i in range(len(before)):
            old, new = before[i], table[i]
            if old != new:  # de-duplicated: the request adopted an identical, already hashed block
                self._emit(BlockDeduplicated(ts_ns=now, request_id=request_id, block_id=new,
                                             duplicate_block_id=old,
                                             block_hash=fold_hash(ledger.block_to_hash.get(new))))
                self._emit(BlockReleased(ts_ns=now, request_id=request_id, block_id=old,
                                         cached=old in ledger.block_to_hash,
                                         num_blocks_free=self._free_blocks_of(allocator)))
        parent = ledger.block_to_hash.get(table[hashed_before - 1]) if hashed_before else None
        keys = None  # hashes mode: the salted chunk keys of the sequence's full blocks, hashed once
        if self.content_salt is not None and hashed_before < len(table):
            keys = salted_chunk_hashes([int(t) for t in token_ids[:len(table) * page]],
                                       self.content_salt)
        for i in range(hashed_before, len(table)):
            block_id = table[i]
            block_hash = ledger.block_to_hash.get(block_id)
            if block_hash is None:
                break
            if i >= len(before) or before[i] == block_id:  # newly registered under its own id
                self._emit(BlockStored(
                    ts_ns=now, block_id=block_id, block_hash=fold_hash(block_hash),
                    parent_hash=fold_hash(parent), num_tokens=page, request_id=request_id,
                    token_ids=[int(t) for t in token_ids[i * page:(i + 1) * page]]
                    if self.record_token_ids else None,
                    chunk_hashes=None if self.content_salt is None else block_chunk_hashes(
                        token_ids, i, page, self.content_salt, keys=keys)))
            parent = block_hash

    def _on_freed(self, allocator, request_id: str, held: list, no_cache: bool) -> None:
        now = self.clock_ns()
        block_to_hash = allocator.ledger.block_to_hash
        free = self._free_blocks_of(allocator)
        if no_cache:
            with self._lock:
                self._preempted.add(request_id)
            self._emit(RequestPreempted(ts_ns=now, request_id=request_id, blocks_freed=len(held)))
        for block_id in held:
            self._emit(BlockReleased(ts_ns=now, request_id=request_id, block_id=block_id,
                                     cached=block_id in block_to_hash, num_blocks_free=free))

    def _on_step(self, processor, start_ns: int, duration_ns: int) -> None:
        prefill = decode = 0
        batch = getattr(processor.inputs_and_outputs, "requests_in_batch", ()) or ()
        for future in batch:
            q = future.query_length
            if q == 1 and future.state.generated_tokens:
                decode += 1
            else:
                prefill += q
        self._emit(EngineStep(ts_ns=start_ns, step_id=self._step_id, phase=step_phase(prefill, decode),
                              batch_size=len(batch),
                              num_tokens=prefill + decode, duration_ns=duration_ns,
                              prefill_tokens=prefill, decode_tokens=decode))
        self._step_id += 1
        now = start_ns + duration_ns
        if now - self._last_sample_ns >= self.sample_interval_ns:
            if self._processor_ref is None or self._processor_ref() is not processor:
                self._processor_ref = weakref.ref(processor)
            self._sample(processor, now)

    def _sample(self, processor, now: int) -> None:
        self._last_sample_ns = now
        cache, scheduler = processor.cache, processor.scheduler
        allocators = list(cache.cache_allocators.values())
        # free sectors are shared by all allocators: count them once, in whole-model blocks
        free = len(cache.pool.free_sectors) * allocators[0].blocks_per_sector
        free += sum(a.pool.count_free_blocks(a.index) for a in allocators)
        cached = sum(len(a.ledger.cached_blocks) for a in allocators)
        num_blocks = int(cache.num_blocks)
        active = scheduler.active_requests
        self._emit(KVPoolSample(
            ts_ns=now, num_blocks=num_blocks, blocks_used=max(0, num_blocks - free - cached),
            blocks_cached=cached, blocks_free=free,
            tokens_held=_distinct_tokens_held(allocators[0], active),
            running_requests=len(active), waiting_requests=len(scheduler.waiting_requests)))


def _distinct_tokens_held(allocator, active_requests: dict) -> int:
    """Tokens written in the blocks live requests hold, each block counted once: a prefix
    block shared by several requests holds its tokens once (token occupancy must not exceed
    the blocks' token slots)."""
    page = allocator.tokens_per_page
    fill: dict[int, int] = {}
    for request_id, state in list(active_requests.items()):
        length = state.current_len()
        for i, block_id in enumerate(allocator.block_table.get(request_id, ())):
            tokens = min(page, max(0, length - i * page))
            if tokens > fill.get(block_id, 0):
                fill[block_id] = tokens
    return sum(fill.values())


# ---------------------------------------------------------------------- hooks
#
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
_PATCHES: list[tuple[str, str, Callable[[TransformersCBAdapter, MethodHooks, type, str], None]]] = [
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


_ACTIVE: Optional[TransformersCBAdapter] = None


def install(sink: Sink, sample_interval_s: float = 0.5, inject_leak_every: int = 0,
            record_token_ids: bool = False, content_salt: Optional[str] = None,
            clock_ns: Callable[[], int] = time.time_ns) -> TransformersCBAdapter:
    """Install a new adapter that sends events to ``sink``; returns it (call ``.uninstall()``).
    Prompts are recorded as token ids with ``record_token_ids``, else as chunk hashes salted
    with ``content_salt`` (None: not at all). ``clock_ns``: the events' wall clock."""
    return TransformersCBAdapter(sink, sample_interval_s=sample_interval_s,
                                 inject_leak_every=inject_leak_every,
                                 record_token_ids=record_token_ids,
                                 content_salt=content_salt, clock_ns=clock_ns).install()


def installed_adapter() -> Optional[TransformersCBAdapter]:
    """The adapter currently installed in this process, if any."""
    return _ACTIVE


def uninstall() -> None:
    """Uninstall the active adapter, if any."""
    if _ACTIVE is not None:
        _ACTIVE.uninstall()
