"""The vLLM plugin's set-up of kvdiag's agent in the engine core: the agent (handed in by the
entry point) is started with an adapter that records through the hooks (:class:`VllmAdapter`),
the worker's shadow is attached to its sink or given an inbox for workers in processes of their
own, and the agent is stopped when the process leaves.
"""

from __future__ import annotations

import atexit
import os
from typing import Optional

from kvdiag.collectors.vllm_hook_state import ENGINE, Hooks, now_ns
from kvdiag.collectors.vllm_pool_sampling import pool_sample
from kvdiag.events.sinks import NullSink, Sink


class VllmAdapter:
    """What the agent holds: a pool sample on demand, and removal of the hooks."""

    def __init__(self, hooks: Hooks) -> None:
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


def start_agent(h: Hooks, sched) -> None:
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
        for status in h.methods.statuses(now_ns()):
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


def _attach_worker(h: Hooks, sink: Sink) -> None:
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
        sink.record(CollectorStatus(ts_ns=now_ns(), collector=f"{vllm_worker.COLLECTOR}:shadow",
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


def _warm_up_worker(h: Hooks, sched) -> None:
    """Pay the worker's shadow kernels' one-time costs before the server takes traffic."""
    if h.worker is None or h.worker.runner is None:
        return
    with h.error_policy.guard("worker_shadow"):
        cfg = sched.vllm_config
        spec = sched.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        h.worker.warm_up(int(spec.num_kv_heads), int(cfg.model_config.get_num_attention_heads(cfg.parallel_config)),
                         int(spec.head_size))
