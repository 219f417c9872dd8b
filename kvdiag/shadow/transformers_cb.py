"""Shadow compression and locality on the live paged KV of transformers' continuous-batching engine.

``CBShadow(runner).install()`` wraps ``ContinuousBatchingManager._generation_step`` (one engine
step: forward + sampling) of every engine in the process. On a step whose batch holds a
request in decode (query length 1, at least one token generated), it asks the runner whether
to sample (:meth:`ShadowRunner.should_sample`: rate, then time budget). On a sampled step:

- before the forward, :class:`QueryCapture` is armed on the model's attention layers; the
  engine packs every request's tokens into one sequence ``[1, N]``, so the request's decode
  query is row ``sum of the query lengths of the requests before it`` of the packed queries;
- after the forward, the request's K/V of every layer is gathered from the paged cache: the
  physical token rows are ``allocator.get_read_indices(request_id, 0, seq_len)`` (its block
  table, in order) into the layer's token view of the cache tensor, ``seq_len`` = the
  request's ``position_offset`` (prompt + generated tokens so far, the decode token included);
- ``runner.maybe_run(step_id, kv, q, sampled=True)`` gets both as callables, so nothing is
  gathered or copied on unsampled steps and the runner copies only what it measures.

The gather reads the cache (``index_select`` makes new tensors) and runs with inference mode
off, so the copies are ordinary tensors a background worker may use. Anything that fails in
shadow work is caught, counted in ``errors`` and reported as ``CollectorError``
(``collector="shadow:cb"``); the engine's own forward runs exactly as without shadow.
Install after the engine adapter (:mod:`kvdiag.collectors.transformers_cb`), uninstall before it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvdiag.kernels.attention import QueryCapture
from kvdiag.shadow.runner import PerLayer, ShadowRunner
from kvdiag.events.hooks import HookErrors, MethodHooks
from kvdiag.events.sinks import Sink

COLLECTOR = "shadow:cb"


@dataclass(slots=True)
class ShadowSample:
    """One sampled decode step: which request, and how many of its tokens the cache held."""

    step_id: int
    request_id: str
    seq_len_tokens: int


def decode_row(batch) -> Optional[tuple[Any, int]]:
    """The first request of ``batch`` (FutureRequestStates) in decode and its row in the
    packed query tokens, or None when no request decodes in this step."""
    row = 0
    for future in batch:
        if future.query_length == 1 and future.has_new_token and future.state.generated_tokens:
            return future.state, row
        row += future.query_length
    return None


def request_kv(cache, request_id: str, seq_len_tokens: int) -> PerLayer:
    """Per layer (K, V) [1, kv_heads, seq_len, head_dim]: copies of the request's first
    ``seq_len_tokens`` cached tokens, read through its block table when a layer is first
    accessed (a sampled step gathers only the layers it measures)."""
    index_of: dict[int, torch.Tensor] = {}

    def layer_kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        allocator = cache.layer_to_allocator[layer]
        index = index_of.get(id(allocator))
        if index is None:
            rows = allocator.get_read_indices(request_id, 0, seq_len_tokens)
            index = torch.tensor(rows, dtype=torch.int64, device=allocator.cache_tensor.device)
            index_of[id(allocator)] = index
        k_view, v_view = allocator._kv_token_views[layer]  # [rows, kv_heads, head_dim]
        k = torch.index_select(k_view, 0, index).transpose(0, 1).unsqueeze(0)
        v = torch.index_select(v_view, 0, index).transpose(0, 1).unsqueeze(0)
        return k, v

    return PerLayer(cache.config.num_hidden_layers, _outside_inference_mode(layer_kv))


def _outside_inference_mode(fetch):
    """``fetch`` run as ordinary tensors without autograd (the engine's step runs in inference
    mode; the shadow's copies must not be inference tensors)."""

    def run(layer: int):
        with torch.inference_mode(False), torch.no_grad():
            return fetch(layer)
    return run


class CBShadow:
    """Feeds a :class:`ShadowRunner` from the engine's sampled decode steps (module docstring).

    ``record_steps``: keep the wall time of every wrapped step (shadow work included) in
    ``step_ns`` and whether it was a decode step in ``step_decode``, for benchmarks."""

    def __init__(self, runner: ShadowRunner, sink: Optional[Sink] = None, record_steps: bool = False) -> None:
        self.runner = runner
        # the one error policy of code run inside an engine (kvdiag.events.hooks)
        self.error_policy = HookErrors(sink if sink is not None else runner.sink)
        self._methods = MethodHooks(self.error_policy)
        self.record_steps = record_steps
        self.samples: list[ShadowSample] = []
        self.step_ns: list[int] = []
        self.step_decode: list[bool] = []
        self._step_id = 0
        self._captures: dict[int, QueryCapture] = {}

    @property
    def sink(self) -> Sink:
        return self.error_policy.sink

    @property
    def errors(self) -> int:
        """Errors in the wrapped step (outside the runner's own), every one counted."""
        return self.error_policy.total

    @property
    def installed(self) -> bool:
        return bool(self._methods.installed)

    def install(self) -> "CBShadow":
        if self.installed:
            return self
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

        shadow = self

        def make(original):
            def _generation_step(manager) -> None:
                shadow._step(manager, original)
            return _generation_step

        if not self._methods.replace(ContinuousBatchingManager, "_generation_step", make):
            for status in self._methods.statuses():
                self.error_policy.record(status)
        return self

    def uninstall(self) -> None:
        """Put the engine's method back, remove the query hooks, stop the runner's worker."""
        self._methods.restore()
        for capture in self._captures.values():
            capture.close()
        self._captures.clear()
        self.runner.close()
        self.error_policy.report_totals()

    # ------------------------------------------------------------------ the wrapped step

    def _step(self, manager, original) -> None:
        t0 = time.perf_counter_ns()
        step_id = self._step_id
        self._step_id += 1
        target, capture, sampled = None, None, False
        try:
            target = decode_row(manager.batch_processor.inputs_and_outputs.requests_in_batch)
            if target is not None:
                sampled = self.runner.should_sample()
                if sampled:
                    capture = self._capture_of(manager.model)
                    capture.armed = True
        except Exception as exc:
            self._failed(exc)
            sampled = False
        try:
            original(manager)
        finally:
            if capture is not None:
                capture.armed = False
        if sampled:
            try:
                self._measure(manager, step_id, target, capture)
            except Exception as exc:
                self._failed(exc)
            finally:
                capture.clear()
        if self.record_steps:
            self.step_ns.append(time.perf_counter_ns() - t0)
            self.step_decode.append(target is not None)

    def _measure(self, manager, step_id: int, target, capture: QueryCapture) -> None:
        state, row = target
        request_id, seq_len = state.request_id, int(state.position_offset)
        cache = manager.batch_processor.cache
        self.samples.append(ShadowSample(step_id, request_id, seq_len))

        def kv():
            return request_kv(cache, request_id, seq_len)

        def queries():
            # project only the request's row of the packed hidden states (and its RoPE angles)
            capture._inputs = [(h[:, row: row + 1], (cos[:, row: row + 1], sin[:, row: row + 1]))
                               for h, (cos, sin) in capture._inputs]
            return PerLayer(len(capture.layers), _outside_inference_mode(capture.query))

        self.runner.maybe_run(step_id, kv, queries, sampled=True)

    def _capture_of(self, model) -> QueryCapture:
        capture = self._captures.get(id(model))
        if capture is None:
            capture = self._captures[id(model)] = QueryCapture(model)
            if self.runner.scaling is None:
                self.runner.scaling = capture.scaling()
        return capture

    def _failed(self, exc: BaseException) -> None:
        self.error_policy.failed(COLLECTOR, exc)


DEFAULT_BUDGET_FRAC = 0.01
# sampled steps run in the engine thread and are slower: kept to half a percent of decode steps
# they stay in the slowest 1% and leave the P99 step latency as it was
DEFAULT_SAMPLE_RATE = 0.005
DEFAULT_LAYERS_PER_RUN = 3  # one per third of the model's depth, rotating (ShadowRunner.layers_of_run)


def install(sink: Sink, methods=None, sample_rate: float = DEFAULT_SAMPLE_RATE, budget_frac: Optional[float] = DEFAULT_BUDGET_FRAC,
            locality: bool = True, background: bool = False, record_steps: bool = False,
            layers_per_run: Optional[int] = DEFAULT_LAYERS_PER_RUN) -> CBShadow:
    """A :class:`ShadowRunner` on ``sink`` wired into every continuous-batching engine of the
    process; returns the installed :class:`CBShadow` (``.uninstall()`` when done).

    Defaults: shadow CPU within 1% of the engine's CPU (tokens per CPU-second drop by about 1%),
    at most 0.5% of decode steps sampled (so that P99 step latency keeps its value),
    three layers per sampled step (spread over the depth, rotating: many steps in small pieces),
    measured in the engine thread: a sampled step is slow, but sampled steps are rare (each run
    buys ~100 runs' worth of unsampled time), so step-latency percentiles below the top 1% keep
    their value; a background worker (``background=True``) instead competes with the engine
    for CPU on every step while it runs, which hurt P99 more on a 2-core machine."""
    from kvdiag.kernels.methods import DEFAULT_METHODS

    runner = ShadowRunner(sink, methods or DEFAULT_METHODS, sample_rate=sample_rate, budget_frac=budget_frac,
                          locality=locality, max_batch=1, background=background, layers_per_run=layers_per_run)
    return CBShadow(runner, sink, record_steps=record_steps).install()
