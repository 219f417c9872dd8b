"""kvdiag in vLLM's worker: shadow compression and per-head locality on vLLM's own paged KV.

Installed by the vLLM plugin (:mod:`kvdiag.collectors.vllm_plugin`) with ``KVDIAG_AGENT=1``,
through the same :class:`~kvdiag.events.hooks.MethodHooks` (checked signatures; a hook whose method
is missing or changed is skipped and said as a ``CollectorStatus``, never an error in vLLM):

==============================================  =============================================
vLLM                                            what the hook does
==============================================  =============================================
``GPUModelRunner.initialize_kv_cache``          a worker in its own process starts linking to
                                                the engine core's agent (below)
``GPUModelRunner.execute_model``                before: on a step with a request in decode
(``CPUModelRunner`` inherits it)                (one scheduled token), asks the shadow runner
                                                whether to sample (its rate and CPU budget,
                                                :class:`~kvdiag.shadow.runner.ShadowRunner`)
                                                and arms the capture; after: hands the copies
                                                to the runner (``maybe_run``), which measures
                                                the compression table, the attention-output
                                                error and the locality per head
``CPUAttentionBackendImpl.forward`` (CPU),      on the class only during a sampled step (the
``FlashAttentionImpl.forward`` (CUDA)           step's hook puts it on and takes it off: other
                                                steps run no kvdiag code per layer), for the
                                                layers the run measures:
                                                copies the request's decode query (post-RoPE,
                                                ``[1, QH, 1, D]``) and its K/V, gathered from
                                                the layer's KV cache tensor through the step's
                                                block table (``attn_metadata.block_table`` row
                                                of the request, ``seq_lens``), after vLLM wrote
                                                this step's token
==============================================  =============================================

Where the events go: to the engine core's agent, so that a server has one log and one live
socket, the worker's events beside the scheduler's. vLLM 0.32 serves with its ``mp`` executor
even with one worker (the API server's engine core starts a ``VLLM::Worker`` process): the
worker's hooks then link to the engine core through a private Unix socket
(:class:`~kvdiag.collectors.vllm_worker_link.WorkerInbox` there,
:class:`~kvdiag.collectors.vllm_worker_link.WorkerLink` here; its path ``KVDIAG_WORKER_SOCKET`` is
chosen by the first process that loads the plugin and inherited by the ones it starts), from a
daemon thread that tries once a second from the worker's KV cache set-up (before the engine
core's scheduler and agent exist) until the agent listens; the engine's thread only queues events (a full queue drops and counts). With
the ``uni`` executor (offline ``LLM`` without multiprocessing) the worker runs in the engine
core's process and records through the same agent directly. A second socket that attach and top
merge would have given every client two streams to join and order; the relay keeps one. The
first tensor-parallel rank measures the shadow; every rank sends its memory.

KV layouts read: :mod:`kvdiag.collectors.vllm_kv_layout`.

Memory in the worker: the worker samples its own process's RSS/PSS (``ProcessSample``, its pid
beside the engine core's; with the ``uni`` executor the agent's own sampler is the worker's);
the KV tensors' total size is the pool's ``KVPoolInfo`` (block bytes from vLLM's
``kv_cache_tensors``). On CUDA, the worker also samples torch's allocator (``AllocatorSample``,
:mod:`kvdiag.collectors.allocator`) every sample interval and the agent's hardware recorder
reads NVML for the process's device.

Environment (with ``KVDIAG_AGENT=1``): ``KVDIAG_SHADOW=0`` turns the worker's shadow off;
``KVDIAG_SHADOW_RATE`` (most share of decode steps sampled, default 0.005),
``KVDIAG_SHADOW_BUDGET`` (shadow CPU per engine CPU, default 0.01; 0: none),
``KVDIAG_SHADOW_LAYERS`` (layers per sampled step, default 3; 0: all),
``KVDIAG_SHADOW_METHODS`` (comma-separated; default :data:`VLLM_METHODS`).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from kvdiag.collectors.vllm_kv_layout import CPU_LAYOUT_ISAS, cpu_layout, gather_kv, layer_index
from kvdiag.collectors.vllm_worker_link import ENV_WORKER_SOCKET, LINK_RETRY_S, WorkerLink
from kvdiag.events.hooks import HookErrors, MethodHooks
from kvdiag.events.schema import CollectorStatus
from kvdiag.events.sinks import Sink

COLLECTOR = "vllm-worker"
ENV_SHADOW = "KVDIAG_SHADOW"
VLLM_METHODS = ("fp8_e4m3:s=1", "fp8_e5m2:s=1", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2",
                "int8", "int4", "int2", "topk_norm", "h2o", "streaming")
"""The worker's default methods: kvdiag's defaults and, first, vLLM's own fp8 caches
(``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``: a plain cast with one scale of 1.0 per tensor,
as vLLM stores them without calibrated scales)."""

STEP_HOOK = "GPUModelRunner.execute_model"
WORKER_MEMORY_INTERVAL_S = 2.0
"""Least seconds between two samples of the worker's own memory: its KV pool is allocated once
at start, so it moves slowly, and the engine core samples its own every sample interval."""


def shadow_enabled() -> bool:
    """The worker's shadow is on unless ``KVDIAG_SHADOW=0``."""
    return os.environ.get(ENV_SHADOW, "1").strip() != "0"


def shadow_options() -> dict:
    """:class:`~kvdiag.shadow.runner.ShadowRunner` arguments from the environment (module doc);
    ValueError names a malformed variable."""
    from kvdiag.shadow.transformers_cb import (DEFAULT_BUDGET_FRAC, DEFAULT_LAYERS_PER_RUN,
                                                          DEFAULT_SAMPLE_RATE)

    def number(name: str, default: float) -> float:
        text = os.environ.get(name, "").strip()
        try:
            return float(text) if text else default
        except ValueError:
            raise ValueError(f"{name}={text!r}: expected a number") from None

    rate = number("KVDIAG_SHADOW_RATE", DEFAULT_SAMPLE_RATE)
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"KVDIAG_SHADOW_RATE={rate}: expected a number in [0, 1]")
    budget = number("KVDIAG_SHADOW_BUDGET", DEFAULT_BUDGET_FRAC)
    layers = int(number("KVDIAG_SHADOW_LAYERS", DEFAULT_LAYERS_PER_RUN))
    methods = os.environ.get("KVDIAG_SHADOW_METHODS", "").strip() or ",".join(VLLM_METHODS)
    return dict(methods=methods, sample_rate=rate, budget_frac=budget if budget > 0 else None,
                layers_per_run=layers if layers > 0 else None)


class WorkerShadow:
    """The worker's hooks (module docstring). ``active`` is False until the plugin's agent in
    this process gives it a sink (:meth:`attach`); until then every hook returns at once."""

    def __init__(self, errors: HookErrors, methods: MethodHooks) -> None:
        self.errors = errors
        self.methods = methods
        self.runner = None  # kvdiag.shadow.runner.ShadowRunner, made by attach
        self.active = False
        self.step_id = 0
        self.armed: Optional[dict] = None  # the sampled step's capture
        self.model_runner: Any = None
        self.num_layers = 0
        self.said: set[str] = set()  # statuses told once
        self.layout_off = False  # the KV layout is not one gather_kv reads: no shadow
        self.allocator = None  # kvdiag.collectors.allocator.AllocatorCollector on CUDA
        self.next_allocator_ns = 0
        self.sample_interval_ns = int(float(os.environ.get("KVDIAG_SAMPLE_INTERVAL_S", "0.5")) * 1e9)
        # a worker in its own process: its link to the engine core's inbox (module doc)
        self.link_path = os.environ.get(ENV_WORKER_SOCKET)
        self.link: Optional[WorkerLink] = None
        self.linker = None  # the thread that links to the engine core's inbox
        self.host_sampler = None  # kvdiag.collectors.procfs.ProcessSampler of the worker's process
        # the attention backends' forward hooks: (class, name, vLLM's own, own attribute, wrapper),
        # on the classes only during a sampled step (:meth:`_gate`)
        self.gated: list = []
        self.gate_on = True  # as MethodHooks.wrap leaves them

    # ------------------------------------------------------------------ set-up

    def install(self) -> None:
        """Wrap vLLM's model runner and attention backends' ``forward`` (what this vLLM has)."""
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        self.methods.wrap(GPUModelRunner, "execute_model", self._after_step, self._before_step,
                          ("scheduler_output",), where=STEP_HOOK)
        # at start-up, once the worker's KV cache exists: begin linking to the engine core
        self.methods.wrap(GPUModelRunner, "initialize_kv_cache",
                          lambda _note, _result, model_runner, *a, **kw: self._maybe_link(model_runner),
                          None, ("kv_cache_config",), where="GPUModelRunner.initialize_kv_cache")
        impls = []
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
            impls.append((CPUAttentionBackendImpl, "cpu"))
        except Exception:
            pass
        try:
            import torch
            if torch.cuda.is_available():
                from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
                impls.append((FlashAttentionImpl, "flash"))
        except Exception:
            pass
        for cls, kind in impls:
            self._hook_attention(cls, kind)
        if STEP_HOOK not in self.methods.skipped:
            self._gate(False)  # the step's hook arms them on the sampled steps alone

    def _hook_attention(self, cls: type, kind: str) -> None:
        """Wrap an attention backend's ``forward`` (checked signature), kept for :meth:`_gate`."""
        if self.methods.wrap(cls, "forward", self._attention(kind), None,
                             ("layer", "query", "kv_cache", "attn_metadata"),
                             where=f"{cls.__name__}.forward"):
            _, name, original, own = self.methods.installed[-1]
            self.gated.append((cls, name, original, own, cls.__dict__[name]))

    def _gate(self, on: bool) -> None:
        """Put the attention backends' wrapped ``forward`` on their classes (``on``: a sampled
        step, whose layers it captures) or vLLM's own back: an unsampled step runs no kvdiag
        code per layer. The step's hook calls it on vLLM's engine thread, between steps."""
        if on == self.gate_on:
            return
        for cls, name, original, _own, wrapper in self.gated:
            # an inherited forward is set on the class too, so that MethodHooks.restore finds
            # the attribute it deletes
            setattr(cls, name, wrapper if on else original)
        self.gate_on = on

    def attach(self, sink: Sink, **options) -> None:
        """Start recording into ``sink`` (the agent's) with a runner of ``options``
        (:func:`shadow_options`)."""
        from kvdiag.shadow.runner import ShadowRunner

        self.runner = ShadowRunner(sink, max_batch=1, locality=True, **options)
        self.active = True
        try:
            import torch
            if torch.cuda.is_available():
                from kvdiag.collectors.allocator import AllocatorCollector
                self.allocator = AllocatorCollector(sink)
                self.allocator.start()
        except Exception as exc:
            self.errors.failed("allocator", exc)

    def warm_up(self, kv_heads: int, query_heads: int, head_dim: int) -> float:
        """The runner's one-time costs paid before the server takes traffic (seconds)."""
        return self.runner.warm_up(kv_heads, query_heads, head_dim) if self.runner is not None else 0.0

    def detach(self) -> None:
        """Stop: the runner's final counts, then nothing more is recorded."""
        self.active = False
        if self.runner is not None:
            self.runner.close()
        if self.allocator is not None:
            self.allocator.stop()
        if self.host_sampler is not None:
            self.host_sampler.stop()
        if self.link is not None:
            self.link.close()

    def _say(self, key: str, available: bool, hint: str) -> None:
        """One ``CollectorStatus`` per ``key`` in this process."""
        if key in self.said or self.runner is None:
            return
        self.said.add(key)
        self.errors.record(CollectorStatus(ts_ns=time.time_ns(), collector=f"{COLLECTOR}:{key}",
                                           available=available, hint=hint))

    # ------------------------------------------------------------------ the hooks

    def _maybe_link(self, model_runner) -> None:
        """In a worker process whose shadow is not attached: start (once) the daemon thread that
        links to the engine core's inbox as soon as it listens (:meth:`_link`)."""
        if self.linker is not None or not self.link_path or self.runner is not None:
            return
        import threading

        self.linker = threading.Thread(target=self._link, args=(model_runner,), name="kvdiag-worker-link",
                                       daemon=True)
        self.linker.start()

    def _link(self, model_runner) -> None:
        """Try the inbox every :data:`LINK_RETRY_S` until it answers (or the shadow was attached
        in this process: the worker runs in the engine core's); then record into it this
        process's statuses and host memory and, with the step's hook, the shadow (kernels
        warmed first, off the engine's thread; a ``CollectorStatus`` says when it is ready)."""
        import threading

        wait = threading.Event()
        while self.runner is None:
            link = WorkerLink.connect(self.link_path)
            if link is not None:
                break
            wait.wait(LINK_RETRY_S)
        else:
            return
        self.link = link
        self.errors.sink = link  # this process's hook errors and statuses go there too
        for status in self.methods.statuses():
            link.record(status)
        with self.errors.guard("worker_memory"):
            from kvdiag.collectors.procfs import ProcessSampler
            interval_s = max(self.sample_interval_ns / 1e9, WORKER_MEMORY_INTERVAL_S)
            self.host_sampler = ProcessSampler.of_self(link, interval_s=interval_s).start()
        if model_runner is None or not _first_rank():
            # without the step's hook nothing is sampled; tensor-parallel ranks after the first
            # hold a slice of the heads: memory and statuses only
            return
        try:
            options = shadow_options()
        except ValueError as exc:
            link.record(CollectorStatus(ts_ns=time.time_ns(), collector=f"{COLLECTOR}:shadow",
                                        available=False, hint=f"shadow off: {exc}"))
            return
        with self.errors.guard("worker_shadow"):
            self.attach(link, **options)
            self.active = False  # until the kernels are warm
            cfg, par = model_runner.model_config, model_runner.parallel_config
            seconds = self.warm_up(int(cfg.get_num_kv_heads(par)), int(cfg.get_num_attention_heads(par)),
                                   int(cfg.get_head_size()))
            link.record(CollectorStatus(ts_ns=time.time_ns(), collector=f"{COLLECTOR}:shadow", available=True,
                                        hint=f"worker pid {os.getpid()}: shadow kernels ready in {seconds:.1f} s"))
            self.active = True

    def _before_step(self, model_runner, *a, **kw) -> None:
        if self.armed is not None:  # the last sampled step raised in vLLM: disarm
            self.armed = None
            self._gate(False)
        if not self.active:
            self._maybe_link(model_runner)
        if not self.active or self.layout_off:
            return None
        self.step_id += 1
        self.model_runner = model_runner
        scheduler_output = a[0] if a else kw.get("scheduler_output")
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        target = next((rid for rid, n in scheduled.items() if n == 1), None)  # a decode step
        if target is None:
            return None
        if not self.runner.should_sample():
            return None
        if not self.num_layers:
            self.num_layers = int(model_runner.model_config.hf_text_config.num_hidden_layers)
        layers = self.runner.layers_of_run(self.num_layers, self.runner.sampled)
        self.armed = {"request": target, "layers": set(layers), "kv": {}, "q": {}}
        self._gate(True)
        return None

    def _after_step(self, _note, _result, model_runner, *a, **kw) -> None:
        armed, self.armed = self.armed, None
        self._gate(False)  # also when a layer disarmed the step (an unread layout)
        if self.allocator is not None:
            now = time.monotonic_ns()
            if now >= self.next_allocator_ns:
                self.next_allocator_ns = now + self.sample_interval_ns
                self.allocator.sample()
        if armed is None:
            return
        from kvdiag.shadow.runner import PerLayer

        kv, q = armed["kv"], armed["q"]
        if set(kv) != armed["layers"]:  # a layer not seen (another backend, a skipped hook)
            missing = sorted(armed["layers"] - set(kv))
            self.errors.failed("shadow", RuntimeError(f"layers {missing} not captured in the step"))
            return

        def of(store):
            def fetch(layer):
                if layer not in store:
                    raise KeyError(f"layer {layer} not captured")
                return store[layer]
            return fetch
        self.runner.maybe_run(self.step_id, PerLayer(self.num_layers, of(kv)),
                              PerLayer(self.num_layers, of(q)), sampled=True)

    def _attention(self, kind: str):
        def after(_note, _result, impl, layer, query, key, value, kv_cache, attn_metadata, *a, **kw) -> None:
            if self.link is None and STEP_HOOK in self.methods.skipped:
                self._maybe_link(None)  # the step's hook is missing: link from here (memory, statuses)
            armed = self.armed
            if armed is None or attn_metadata is None:
                return
            index = layer_index(getattr(layer, "layer_name", ""))
            if index is None or index not in armed["layers"] or index in armed["kv"]:
                return
            layout = self._layout(kind, layer, kv_cache)
            if layout is None:
                self.armed = None
                return
            row = self.model_runner.input_batch.req_id_to_index[armed["request"]]
            end = int(attn_metadata.query_start_loc[row + 1])  # the request's last query row
            seq_len = int(attn_metadata.seq_lens[row])
            import torch
            with torch.inference_mode(False), torch.no_grad():
                blocks = attn_metadata.block_table[row].tolist()
                armed["kv"][index] = gather_kv(kv_cache, blocks, seq_len, layout)
                armed["q"][index] = query[end - 1: end].detach().float().clone().transpose(0, 1).unsqueeze(0)
            if self.runner.scaling is None:
                self.runner.scaling = float(impl.scale)
        return after

    def _layout(self, kind: str, layer, kv_cache) -> Optional[str]:
        if kind == "flash":
            return "flash"
        layout = cpu_layout(getattr(layer, "isa", None), kv_cache.dtype)
        if layout is None:
            self.layout_off = True
            self._say("layout", False, f"vLLM's CPU KV layout for ISA {getattr(layer, 'isa', None)!r} and "
                      f"cache dtype {kv_cache.dtype} is not one kvdiag reads (it reads ISA "
                      f"{', '.join(CPU_LAYOUT_ISAS)} with fp32/fp16/bf16): no shadow compression")
        return layout


def _first_rank() -> bool:
    """True unless vLLM says this worker is a tensor-parallel rank after the first."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank() == 0
    except Exception:
        return True


def install(errors: HookErrors, methods: MethodHooks) -> Optional[WorkerShadow]:
    """The worker's hooks on ``methods`` (the plugin's), or None when ``KVDIAG_SHADOW=0``."""
    if not shadow_enabled():
        return None
    shadow = WorkerShadow(errors, methods)
    shadow.install()
    return shadow
