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
(:data:`kvdiag.collectors.vllm_pool_sampling.SAMPLE_BUDGET`).

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

import os
from typing import Optional

from kvdiag.collectors.vllm_hook_state import Hooks
from kvdiag.collectors.vllm_scheduler_hooks import wrap_scheduler

ENV_ON = "KVDIAG_AGENT"


def enabled() -> bool:
    """True when the environment asks for the agent (``KVDIAG_AGENT=1``)."""
    return os.environ.get(ENV_ON, "") == "1"


_HOOKS: Optional[Hooks] = None


def install_hooks(agent_api=None) -> Hooks:
    """Wrap vLLM's methods (idempotent); ``agent_api`` (:mod:`kvdiag.agent`) is started in the
    process that builds a ``Scheduler`` (None: the hooks record into no agent)."""
    global _HOOKS
    if _HOOKS is not None:
        _HOOKS.agent_api = agent_api or _HOOKS.agent_api
        return _HOOKS
    h = Hooks()
    h.agent_api = agent_api
    wrap_scheduler(h)
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
