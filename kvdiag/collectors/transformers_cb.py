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

from kvdiag.collectors.transformers_cb_hooks import PATCHES, engine_classes, fold_hash
from kvdiag.events.hooks import HookErrors, MethodHooks, step_phase
from kvdiag.pool.hashing import CONTENT_CHUNK_TOKENS, block_chunk_hashes, salted_chunk_hashes
from kvdiag.events.schema import (
    elapsed_ns,
    BlockHash,
    BlockDeduplicated,
    BlockReleased,
    BlockStored,
    EngineStep,
    Event,
    KVPoolInfo,
    KVPoolSample,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestScheduled,
)
from kvdiag.events.sinks import Sink

COLLECTOR = "transformers-cb"


def patch_points() -> list[tuple[type, str]]:
    """The (class, attribute) pairs the adapter replaces while installed."""
    c = engine_classes()
    return [(c[class_key], name) for class_key, name, _ in PATCHES]


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
        c = engine_classes()
        for class_key, name, hook in PATCHES:
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
