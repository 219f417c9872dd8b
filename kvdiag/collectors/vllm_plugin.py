"""kvdiag inside vLLM: the hooks behind the ``vllm.general_plugins`` entry point that record
vLLM's KV block pool.

vLLM calls the entry point (:func:`kvdiag.agent.vllm_entry.register`, which hands
:mod:`kvdiag.agent` to :func:`register`: a collector never imports the agent that installs it)
in every process it starts (API server, engine core, workers).
With ``KVDIAG_AGENT=1`` in the environment it wraps a few methods of vLLM's scheduler and KV
cache manager; with the variable unset it does nothing at all. The kvdiag agent starts in the
process that builds a ``Scheduler`` (the engine core), so the API server and the workers stay
untouched. What the hooks record, in kvdiag's schema (the same events the transformers adapter
emits, so the ledger, leak rules, shadow sharing and fragmentation work unchanged):

==============================================  =============================================
vLLM                                            kvdiag event
==============================================  =============================================
``Scheduler.__init__``                          ``KVPoolInfo`` (usable blocks: the pool minus
                                                vLLM's null block)
``Scheduler.add_request``                       ``RequestArrived`` with the prompt token ids
                                                (or their salted hashes) and ``cache_domain``
``KVCacheManager.allocate_slots``               ``RequestScheduled`` (its first slots)
``BlockPool.get_new_blocks``                    ``BlockAllocated`` (inside ``allocate_slots``)
``BlockPool.touch``                             ``PrefixHit`` (a cached block reused: its
                                                ``num_tokens`` is the block size, so a request's
                                                hits sum to the prefix-cache hit tokens vLLM
                                                counts for it at admission)
``BlockPool.cache_full_blocks``                 ``BlockStored`` with its token ids
``BlockPool._maybe_evict_cached_block``         ``BlockEvicted``
``KVCacheManager.free`` / ``pop_blocks_for_free``  ``BlockReleased`` (``cached``: the block keeps
                                                its hash; vLLM may return it to the pool a step
                                                later, the request has let it go now)
``KVCacheManager.record_prefix_cache_stats``    the request's prefix-cache hit tokens, as vLLM
                                                counts them in ``prefix_cache_hits_total``
``Scheduler._free_request``                     ``RequestFinished`` (``cached_prompt_tokens``:
                                                those hits at its first admission)
``Scheduler._preempt_request``                  ``RequestPreempted``
``Scheduler.schedule`` → ``update_from_output``  ``EngineStep`` (wall time between them),
                                                ``RequestFirstToken`` and, every sample
                                                interval, ``KVPoolSample``
``Scheduler.shutdown``                          the agent stops: last pool sample, final shadow
                                                results, log and socket closed
(idle engine)                                   ``KVPoolSample`` every sample interval from a
                                                daemon thread while no step runs
==============================================  =============================================

The worker's hooks (``GPUModelRunner.execute_model`` and the attention backend's ``forward``:
shadow compression and per-head locality on vLLM's own paged KV) are in
:mod:`kvdiag.collectors.vllm_worker`; a worker in its own process (``VLLM::Worker``, vLLM's
``mp`` executor: how the API server runs) sends its events to this agent through a private
inbox socket (``WorkerInbox``), a worker in this process (``uni`` executor) records into it
directly: one log and one live socket per server.

An idle engine core takes no steps (it waits for requests), so the pool would be sampled only
with traffic and a client's pool view would go stale when traffic stops: a daemon thread
(``kvdiag-vllm-idle-sampler``) takes the sample instead once no step ran for a sample interval.
It reads the pool as the step's sample does (block reference counts, the running and waiting
queues' lengths), takes no lock of vLLM's and runs only while the engine is idle; the step's
own sample and the thread's exclude each other through a lock of kvdiag's, which the engine's
thread only tries (it never waits on it). Its cost is bounded like the step's sample
(:data:`SAMPLE_BUDGET`).

Every hook runs vLLM's own method first and unchanged, then records; an exception in kvdiag's
part is counted (``CollectorError``, once per hook with the running count at the end) and never
reaches vLLM. Each hook checks that the method exists with the parameters it reads; on a vLLM
whose internals differ, the hook is skipped and a ``CollectorStatus`` says which one.

vLLM's default ``--shutdown-timeout 0`` kills the engine core the moment the server stops, so
the agent's last events (those of the final half second: the last pool sample and shadow
results) are lost; serve with ``--shutdown-timeout 10`` (as ``kvdiag demo --engine vllm`` does)
to have them flushed by ``Scheduler.shutdown``.

Environment: ``KVDIAG_AGENT=1`` turns it on; ``KVDIAG_LOG=PATH`` also writes an event log (the
live socket is always served: ``kvdiag attach`` and ``kvdiag top`` read it; ``KVDIAG_SOCKET=PATH``
names it, else it is the engine core's per-pid agent socket);
``KVDIAG_PROMETHEUS=[HOST:]PORT`` serves kvdiag's metrics from the engine core (127.0.0.1
unless a host is given; docs/metrics.md);
``KVDIAG_SAMPLE_INTERVAL_S`` (default 0.5); ``KVDIAG_SHADOW=0`` and ``KVDIAG_SHADOW_*`` (the
worker's shadow, :mod:`kvdiag.collectors.vllm_worker`); ``KVDIAG_FAIL_HOOK=NAME`` makes that hook's recording
raise (fault injection, to check that vLLM keeps serving).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
import time
from typing import Any, Callable, Optional

from kvdiag.events.hooks import HookErrors, MethodHooks, UsesHookErrors, step_phase
from kvdiag.pool.hashing import CONTENT_CHUNK_TOKENS, block_chunk_hashes, salted_chunk_hashes
from kvdiag.pool.prefix_cache import fold_block_hash
from kvdiag.events.schema import (BlockAllocated, BlockHash, BlockEvicted, BlockReleased, BlockStored,
                           EngineStep, KVPoolInfo, KVPoolSample, PrefixHit,
                           RequestArrived, RequestFinished, RequestFirstToken, RequestPreempted,
                           RequestScheduled, elapsed_ns)
from kvdiag.events.sinks import NullSink, Sink

ENGINE = "vllm"
COLLECTOR = "vllm-plugin"
ENV_ON = "KVDIAG_AGENT"
SAMPLE_BUDGET = 0.005
"""Share of the engine core's time the periodic pool sample may take (it walks every block)."""


def enabled() -> bool:
    """True when the environment asks for the agent (``KVDIAG_AGENT=1``)."""
    return os.environ.get(ENV_ON, "") == "1"


def fold_hash(key: Any) -> Optional[int]:
    """A block's key in vLLM's pool (its hash bytes followed by a 4-byte group id) as the key
    vLLM publishes for it in its KV events (the hash's low 64 bits, big-endian, as
    ``maybe_convert_block_hash`` makes it), folded by :func:`kvdiag.pool.prefix_cache.fold_block_hash`:
    a block's ``BlockStored`` from the plugin and its ``PrefixCacheStored`` share one key."""
    if key is None:
        return None
    return fold_block_hash(int.from_bytes(bytes(key)[:-4], "big"))


# ------------------------------------------------------------------------------ hook plumbing


class _Hooks(UsesHookErrors):
    """The wrapped methods, the sink they record into, and their error counts."""

    def __init__(self) -> None:
        # the one error policy and method wrapping of engine adapters (kvdiag.events.hooks)
        self.error_policy = HookErrors(NullSink(), COLLECTOR, clock_ns=_now)
        self.methods = MethodHooks(self.error_policy, os.environ.get("KVDIAG_FAIL_HOOK", ""))
        # prompts as token ids (KVDIAG_RECORD_TOKENS=1) or chunk hashes under the log's salt
        self.record_token_ids = False
        self.content_salt: Optional[str] = None
        self.current_request: Optional[str] = None  # inside allocate_slots
        self.cached_tokens: dict[str, int] = {}  # request -> prefix hits at first admission
        self.scheduled: set[str] = set()  # requests given their first slots
        self.first_token_ns: dict[str, int] = {}  # request -> time to its first output token
        self.step_started: dict[int, int] = {}  # id(scheduler output) -> ns
        self.step_id = 0
        self.sample_interval_ns = int(float(os.environ.get("KVDIAG_SAMPLE_INTERVAL_S", "0.5")) * 1e9)
        self.next_sample_ns = 0
        self.scheduler: Any = None
        self.agent: Any = None
        self.agent_api: Any = None  # kvdiag.agent (start, stop), handed in by register
        self.lock = threading.Lock()
        self.block_size_tokens = 0  # the pool's, for the tokens of a prefix hit
        self.last_step_ns = 0  # when the engine last finished a step (0: none yet)
        self.sample_lock = threading.Lock()  # the step's sample and the idle thread's, one at a time
        self.idle_stop = threading.Event()
        self.idle_thread: Optional[threading.Thread] = None
        self.worker: Any = None  # kvdiag.collectors.vllm_worker.WorkerShadow (None: shadow off)
        self.inbox: Any = None  # kvdiag.collectors.vllm_worker_link.WorkerInbox: workers' events, here

    @property
    def skipped(self) -> dict[str, str]:
        """Hooks not installed -> why."""
        return self.methods.skipped

    def record(self, event) -> None:
        self.sink.record(event)

    def failed(self, hook: str, exc: BaseException) -> None:
        """The error policy of :class:`kvdiag.events.hooks.HookErrors`: counted, the first of each
        (hook, type) reported at once, never raised into vLLM."""
        self.error_policy.failed(hook, exc)

    def wrap(self, cls: type, name: str, params: tuple[str, ...],
             after: Callable[..., None], before: Optional[Callable[..., Any]] = None) -> None:
        """Wrap ``cls.name`` (:meth:`kvdiag.events.hooks.MethodHooks.wrap`): vLLM's method runs
        unchanged; ``before(self, *a, **kw)`` may take a note first, ``after(note, result, self,
        *a, **kw)`` records. Skipped (and said) when the method or one of ``params`` is missing."""
        self.methods.wrap(cls, name, after, before, params)

    def unwrap(self) -> None:
        self.methods.restore()


_HOOKS: Optional[_Hooks] = None


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


# ------------------------------------------------------------------------------ the hooks


def _now() -> int:
    return time.time_ns()


def _scheduler_init(h: _Hooks):
    def after(_note, _result, sched, *args, **kwargs) -> None:
        h.scheduler = sched
        _start_agent(h, sched)
        info = _pool_info(sched)
        h.block_size_tokens = info.block_size_tokens
        h.record(info)
        _start_idle_sampler(h)
    return after


def _take_sample(h: _Hooks, sched, now: int) -> None:
    """One pool sample; the next one is due a sample interval later, or later still on a
    large pool, so that sampling costs at most :data:`SAMPLE_BUDGET` of the time. The cost is
    the CPU time of the thread that sampled, not wall time: a thread that waited for the GIL
    while the engine worked did not cost that wait (as wall time, a wait of 60 ms would hold the
    next sample back 12 s). The caller holds ``h.sample_lock``."""
    started_ns = time.thread_time_ns()
    h.record(pool_sample(sched))
    cost_ns = time.thread_time_ns() - started_ns
    h.next_sample_ns = now + max(h.sample_interval_ns, int(cost_ns / SAMPLE_BUDGET))


def _idle_sample(h: _Hooks) -> bool:
    """The idle thread's turn: a pool sample when one is due and the engine took no step for a
    sample interval (it waits for requests). True when it took one."""
    sched = h.scheduler
    now = _now()
    if sched is None or now < h.next_sample_ns or now - h.last_step_ns < h.sample_interval_ns:
        return False
    if not h.sample_lock.acquire(blocking=False):
        return False
    try:
        _take_sample(h, sched, now)
    finally:
        h.sample_lock.release()
    return True


def _start_idle_sampler(h: _Hooks) -> None:
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


def _pool_info(sched) -> KVPoolInfo:
    mgr = sched.kv_cache_manager
    pool = mgr.block_pool
    cfg = sched.kv_cache_config
    num_blocks = int(pool.num_gpu_blocks) - 1  # block 0 is vLLM's null placeholder
    group = cfg.kv_cache_groups[0]
    spec = group.kv_cache_spec
    total_bytes = sum(int(t.size) for t in getattr(cfg, "kv_cache_tensors", ()) or ())
    block_bytes = (total_bytes // int(cfg.num_blocks) if total_bytes and cfg.num_blocks
                   else int(spec.page_size_bytes) * len(group.layer_names))
    return KVPoolInfo(ts_ns=_now(), num_blocks=num_blocks, block_size_tokens=int(spec.block_size),
                      block_bytes=block_bytes, num_layers=sum(len(g.layer_names) for g in cfg.kv_cache_groups),
                      num_kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0),
                      head_dim=int(getattr(spec, "head_size", 0) or 0),
                      dtype=str(getattr(spec, "dtype", "")).replace("torch.", ""),
                      prefix_sharing=bool(mgr.enable_caching))


def _add_request(h: _Hooks):
    def before(sched, request, *a, **kw) -> bool:
        return request.request_id in sched.requests  # a streaming update, not a new request

    def after(existed, _result, sched, request, *a, **kw) -> None:
        if existed:
            return
        params = getattr(request, "sampling_params", None)
        token_ids = [int(t) for t in request.prompt_token_ids or []]
        salt = None if h.record_token_ids else h.content_salt
        h.record(RequestArrived(ts_ns=_now(), request_id=str(request.request_id),
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


def _allocate_slots(h: _Hooks):
    def before(mgr, request, *a, **kw) -> Optional[str]:
        previous, h.current_request = h.current_request, str(request.request_id)
        return previous

    def after(previous, result, mgr, request, *a, **kw) -> None:
        h.current_request = previous
        rid = str(request.request_id)
        if result is not None and rid not in h.scheduled:  # None: no room, it waits on
            h.scheduled.add(rid)
            arrival = getattr(request, "arrival_time", None)
            h.record(RequestScheduled(ts_ns=_now(), request_id=rid,
                                      queue_ns=elapsed_ns(arrival * 1e9, _now()) if arrival else None))
    return before, after


def _get_new_blocks(h: _Hooks):
    def after(_note, blocks, pool, *a, **kw) -> None:
        rid = h.current_request or "?"
        free = pool.get_num_free_blocks()
        for b in blocks:
            h.record(BlockAllocated(ts_ns=_now(), request_id=rid, block_id=int(b.block_id),
                                    num_blocks_free=free))
    return after


def _touch(h: _Hooks):
    def after(_note, _result, pool, blocks, *a, **kw) -> None:
        rid = h.current_request
        if rid is None:  # a touch outside a request's allocation (none in vLLM 0.32)
            return
        for b in blocks:
            if not b.is_null:
                # a touched block is a full cached block the request reuses instead of computing
                h.record(PrefixHit(ts_ns=_now(), request_id=rid, block_id=int(b.block_id),
                                   block_hash=fold_hash(b.block_hash), num_tokens=h.block_size_tokens))
    return after


def _cache_full_blocks(h: _Hooks):
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
            h.record(BlockStored(ts_ns=_now(), block_id=int(b.block_id), block_hash=key,
                                 parent_hash=parent, num_tokens=int(block_size),
                                 request_id=str(request.request_id),
                                 token_ids=list(tokens[i * block_size:(i + 1) * block_size])
                                 if h.record_token_ids else None,
                                 chunk_hashes=None if keys is None else block_chunk_hashes(
                                     tokens, i, int(block_size), h.content_salt, keys=keys)))
            parent = key
    return after


def _evict(h: _Hooks):
    def before(pool, block, *a, **kw) -> Optional[int]:
        return fold_hash(block.block_hash)

    def after(key, evicted, pool, block, *a, **kw) -> None:
        if evicted:
            h.record(BlockEvicted(ts_ns=_now(), block_id=int(block.block_id), block_hash=key))
    return before, after


def _release(h: _Hooks):
    """``KVCacheManager.free`` and ``pop_blocks_for_free``: the request lets its blocks go."""
    def before(mgr, request, *a, **kw) -> list:
        groups = mgr.coordinator.get_blocks(request.request_id)
        return [b for b in (groups[0] if groups else ()) if not b.is_null]

    def after(blocks, _result, mgr, request, *a, **kw) -> None:
        rid = str(request.request_id)
        free = mgr.block_pool.get_num_free_blocks()
        for b in reversed(blocks or ()):  # vLLM frees tail first
            h.record(BlockReleased(ts_ns=_now(), request_id=rid, block_id=int(b.block_id),
                                   cached=b.block_hash is not None, num_blocks_free=free))
    return before, after


def _prefix_cache_stats(h: _Hooks):
    def after(_note, _result, mgr, request, num_hits, *a, **kw) -> None:
        h.cached_tokens.setdefault(str(request.request_id), int(num_hits))
    return after


_STATUS = {"FINISHED_ABORTED": "aborted", "FINISHED_ERROR": "failed"}


def _free_request(h: _Hooks):
    def after(_note, _result, sched, request, *a, **kw) -> None:
        h.scheduled.discard(str(request.request_id))
        now = _now()
        arrival = getattr(request, "arrival_time", None)
        status = _STATUS.get(getattr(request.status, "name", ""), "finished")
        h.record(RequestFinished(ts_ns=now, request_id=str(request.request_id),
                                 prompt_tokens=int(request.num_prompt_tokens),
                                 output_tokens=int(request.num_output_tokens),
                                 cached_prompt_tokens=h.cached_tokens.pop(str(request.request_id), 0),
                                 status=status, ttft_ns=h.first_token_ns.pop(str(request.request_id), None),
                                 e2e_ns=elapsed_ns(arrival * 1e9, now) if arrival else None))
    return after


def _preempt(h: _Hooks):
    def after(_note, _result, sched, request, *a, **kw) -> None:
        h.record(RequestPreempted(ts_ns=_now(), request_id=str(request.request_id)))
    return after


def _schedule(h: _Hooks):
    def before(sched, *a, **kw) -> int:
        return time.perf_counter_ns()

    def after(started, output, sched, *a, **kw) -> None:
        if output is not None and started is not None:
            h.step_started[id(output)] = started
    return before, after


def _update_from_output(h: _Hooks):
    def after(_note, _result, sched, scheduler_output, *a, **kw) -> None:
        started = h.step_started.pop(id(scheduler_output), None)
        for rid in getattr(scheduler_output, "num_scheduled_tokens", {}) or {}:
            request = sched.requests.get(rid)
            if (request is not None and rid not in h.first_token_ns and request.num_output_tokens > 0
                    and getattr(request, "arrival_time", None)):
                ttft = elapsed_ns(request.arrival_time * 1e9, _now())
                h.first_token_ns[str(rid)] = ttft
                h.record(RequestFirstToken(ts_ns=_now(), request_id=str(rid), ttft_ns=ttft))
        if len(h.step_started) > 64:  # outputs never updated (aborted steps)
            h.step_started.clear()
        per_request: dict = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        if started is not None and per_request:
            decode = sum(1 for n in per_request.values() if n == 1)
            total = int(sum(per_request.values()))
            prefill = total - decode
            h.step_id += 1
            h.record(EngineStep(ts_ns=_now(), step_id=h.step_id, phase=step_phase(prefill, decode),
                                batch_size=len(per_request), num_tokens=total,
                                duration_ns=time.perf_counter_ns() - started,
                                prefill_tokens=prefill, decode_tokens=decode))
        now = _now()
        h.last_step_ns = now
        # the sample walks the pool's blocks: on a large pool, sample less often so that it
        # costs the scheduler at most SAMPLE_BUDGET of its time; never wait for the idle thread
        if now >= h.next_sample_ns and h.sample_lock.acquire(blocking=False):
            try:
                _take_sample(h, sched, now)
            finally:
                h.sample_lock.release()
    return after


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
    return KVPoolSample(ts_ns=_now(), num_blocks=num_blocks, blocks_used=used, blocks_cached=cached,
                        blocks_free=num_blocks - used - cached, tokens_held=tokens,
                        running_requests=len(sched.running), waiting_requests=len(sched.waiting))


# ------------------------------------------------------------------------------ the adapter


class VllmAdapter:
    """What the agent holds: a pool sample on demand, and removal of the hooks."""

    def __init__(self, hooks: _Hooks) -> None:
        self.hooks = hooks

    def sample_now(self) -> None:
        if self.hooks.scheduler is not None:
            try:
                self.hooks.record(pool_sample(self.hooks.scheduler))
            except Exception as exc:
                self.hooks.failed("pool_sample", exc)

    def uninstall(self) -> None:
        self.hooks.idle_stop.set()
        if self.hooks.worker is not None:
            self.hooks.worker.detach()  # the shadow's final counts while the sink still records
        if self.hooks.inbox is not None:
            self.hooks.inbox.close()  # what the workers sent until now
        self.hooks.error_policy.report_totals()
        self.hooks.sink = NullSink()


def _start_agent(h: _Hooks, sched) -> None:
    """Start kvdiag's agent in this process (the engine core), recording through the hooks."""
    if h.agent is not None or h.agent_api is None:
        return
    agent_mod = h.agent_api

    model = ""
    try:
        model = str(sched.vllm_config.model_config.model)
    except Exception:
        pass

    def install(sink: Sink, record_token_ids: bool = False, content_salt: Optional[str] = None,
                **_kw) -> VllmAdapter:
        h.sink = sink
        h.record_token_ids, h.content_salt = bool(record_token_ids), content_salt
        for status in h.methods.statuses(_now()):
            sink.record(status)
        _attach_worker(h, sink)
        return VllmAdapter(h)

    try:
        import vllm
        version = getattr(vllm, "__version__", "")
    except Exception:
        version = ""
    try:
        block_size = int(sched.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    except Exception:
        block_size = None
    agent = agent_mod.start(log_path=os.environ.get("KVDIAG_LOG") or None,
                              socket_path=os.environ.get("KVDIAG_SOCKET") or None, model=model, engine=ENGINE,
                              block_size_tokens=block_size,
                              adapter=install, sample_interval_s=h.sample_interval_ns / 1e9,
                              extra={"vllm_version": version},
                              prometheus=os.environ.get("KVDIAG_PROMETHEUS") or None)
    h.agent = agent
    _warm_up_worker(h, sched)
    # the engine core is a multiprocessing child: it leaves through os._exit, which skips
    # atexit, so the last events (final pool sample, shadow results) are flushed by vLLM's own
    # shutdown (Scheduler.shutdown, wrapped below) or multiprocessing's exit finalizers
    atexit.register(agent_mod.stop)
    try:
        from multiprocessing import util
        util.Finalize(agent, agent_mod.stop, exitpriority=100)
    except Exception:
        pass


def _attach_worker(h: _Hooks, sink: Sink) -> None:
    """The worker's shadow records into the agent's sink (the worker runs in this process:
    :mod:`kvdiag.collectors.vllm_worker`); malformed ``KVDIAG_SHADOW_*`` settings turn it off,
    said as a ``CollectorStatus``."""
    if h.worker is None:
        return
    from kvdiag.collectors import vllm_worker, vllm_worker_link
    from kvdiag.events.schema import CollectorStatus
    try:
        options = vllm_worker.shadow_options()
    except ValueError as exc:
        sink.record(CollectorStatus(ts_ns=_now(), collector=f"{vllm_worker.COLLECTOR}:shadow",
                                    available=False, hint=f"shadow off: {exc}"))
        h.worker = None
        return
    with h.error_policy.guard("worker_shadow"):
        backend = getattr(h.scheduler.vllm_config.parallel_config, "distributed_executor_backend", None)
        if backend in ("uni", "external_launcher"):  # the worker runs in this process
            h.worker.attach(sink, **options)
            return
        # workers in processes of their own (VLLM::Worker): they send their events here
        h.inbox = vllm_worker_link.WorkerInbox(vllm_worker_link.choose_worker_socket(), sink, h.error_policy)


def _warm_up_worker(h: _Hooks, sched) -> None:
    """Pay the worker's shadow kernels' one-time costs before the server takes traffic."""
    if h.worker is None or h.worker.runner is None:
        return
    with h.error_policy.guard("worker_shadow"):
        cfg = sched.vllm_config
        spec = sched.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        h.worker.warm_up(int(spec.num_kv_heads), int(cfg.model_config.get_num_attention_heads(cfg.parallel_config)),
                         int(spec.head_size))


def _shutdown(h: _Hooks):
    def after(_note, _result, sched, *a, **kw) -> None:
        if h.agent is not None:
            h.agent_api.stop()
    return after


def install_hooks(agent_api=None) -> _Hooks:
    """Wrap vLLM's methods (idempotent); ``agent_api`` (:mod:`kvdiag.agent`) is started in the
    process that builds a ``Scheduler`` (None: the hooks record into no agent)."""
    global _HOOKS
    if _HOOKS is not None:
        _HOOKS.agent_api = agent_api or _HOOKS.agent_api
        return _HOOKS
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    h = _Hooks()
    h.agent_api = agent_api
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
    try:  # the worker's shadow (same process with vLLM's one-worker executor)
        from kvdiag.collectors import vllm_worker, vllm_worker_link
        h.worker = vllm_worker.install(h.error_policy, h.methods)
        if h.worker is not None:
            vllm_worker_link.choose_worker_socket()  # before the engine core starts its workers
    except Exception as exc:  # counted and said; the scheduler's hooks stay
        h.failed("worker_hooks", exc)
    _HOOKS = h
    return h


def register(agent_api) -> None:
    """Install the hooks when ``KVDIAG_AGENT=1``, starting ``agent_api`` (:mod:`kvdiag.agent`,
    handed in by the entry point :func:`kvdiag.agent.vllm_entry.register`) in the engine core.
    Never raises (a failure is printed once and vLLM goes on without kvdiag)."""
    if not enabled():
        return
    try:
        install_hooks(agent_api)
    except Exception as exc:  # an unexpected vLLM layout: vLLM serves on without kvdiag
        import sys
        print(f"kvdiag: vLLM plugin not installed: {type(exc).__name__}: {exc}", file=sys.stderr)
