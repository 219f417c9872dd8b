"""Shadow compression: measure KV compressors on copies of live KV, on sampled decode steps.

Entry point for any engine: ``ShadowRunner(sink, methods, sample_rate, budget_frac)`` and, after
each decode forward, ``runner.maybe_run(step_id, layers_kv, queries)`` where ``layers_kv`` is a
sequence of per-layer (K, V) [B, KH, T, D] *after* the step's cache update and ``queries`` a
sequence of per-layer post-RoPE queries [B, QH, Tq, D] of that step (either may be a callable
returning the sequence, so an engine gathers paged KV only on sampled steps, and the sequence
a :class:`PerLayer`, so that it gathers only the layers the run measures).

With ``background=True`` the caller's thread only copies the K/V and queries of a sampled step
(into a one-slot queue; a step sampled while the worker is busy is dropped and counted) and a
daemon thread measures them; ``wait()`` blocks until it is done, ``close()`` stops it.

Sampling, within a budget of CPU time: shadow work may cost at most ``budget_frac`` of the CPU
time the observed process spends otherwise (its engine's work) since the runner saw its first
step, so tokens per CPU-second drop by at most about ``budget_frac``. The runner adapts its
sampling rate to that budget: rate = min(``sample_rate``, ``budget_frac`` x engine CPU per
offered step / CPU per sampled step), both moving averages (the first run pays one-time costs:
it counts as spent, the estimate starts with the second, unless :meth:`ShadowRunner.warm_up`
paid them), so samples spread evenly over the run instead of coming in bursts; a drawn step
is still skipped if spent + the runs in flight (queued or being measured) and one more, at
the dearest recent run's cost, would exceed the budget (``steps_skipped_budget``;
:mod:`kvdiag.kernels.shadow_budget`). ``sample_rate`` is therefore the ceiling; the rate in
force and the achieved rate (sampled / offered) are reported in each :class:`ShadowBudget`. ``budget_frac=None``: no budget, the rate is ``sample_rate``.
Shadow CPU is counted as: inline, the whole process's CPU during the run (torch's intra-op
threads included, the engine waits meanwhile); in the background, the caller's thread for the
copy plus the worker thread. Only the first ``max_batch`` sequences are copied, and of them
only the layers of :meth:`ShadowRunner.layers_of_run` (``layers_per_run``; None: all).

Measured per layer and kv head, for each method (a :class:`ShadowCompression` event):
``ratio`` = original K+V bytes / stored bytes; ``k_rel_error`` = ||K - K_hat||_F / ||K||_F over
the head's tokens and channels (same for V); ``attn_score_error`` = mean over the head's query
heads and queries of the total variation distance 0.5 * sum |p - p_hat| between exact and
compressed attention probabilities; ``attn_out_rel_error`` = ||O - O_hat||_F / ||O||_F over the
head's query heads, O = p V; ``encode_ns``/``decode_ns`` = the layer's encode/decode wall time
divided by the number of kv heads. Locality of the exact probabilities (last query) is emitted
as :class:`ShadowLocality` events when ``locality`` is on.

Exceptions inside shadow work are caught per method and layer and handled by the one error
policy of :mod:`kvdiag.events.hooks`: every one counted in ``errors``, the first of each (place,
exception type) emitted as :class:`~kvdiag.events.schema.CollectorError`
(``collector="shadow:<method>"``), each place's total at :meth:`ShadowRunner.close`; they never
propagate.
Live tensors are only read (cloned) and never written.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence as SequenceABC
import threading
import time
from typing import Callable, Optional, Sequence, Union

import torch

from kvdiag.events.hooks import HookErrors, UsesHookErrors
from kvdiag.kernels.attention import attention_probs, locality_events
from kvdiag.kernels.methods import DEFAULT_METHODS, Method, parse_method, parse_methods
from kvdiag.kernels.shadow_budget import Budget
from kvdiag.events.schema import ShadowBudget, ShadowCompression
from kvdiag.events.sinks import NullSink, Sink

LayersKV = Sequence[tuple[torch.Tensor, torch.Tensor]]
Queries = Sequence[torch.Tensor]


def _resolve(x):
    return x() if callable(x) else x


class PerLayer(SequenceABC):
    """``num_layers`` values, each computed by ``fetch(layer)`` on first access: an engine hands
    the runner its KV and queries this way, so that only the layers a run measures are
    gathered (:meth:`ShadowRunner.layers_of_run`)."""

    def __init__(self, num_layers: int, fetch: Callable[[int], object]) -> None:
        self._fetch, self._values = fetch, [None] * num_layers

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, layer: int):
        if self._values[layer] is None:
            self._values[layer] = self._fetch(layer)
        return self._values[layer]


class CpuClock:
    """The CPU-time clocks the budget is kept in (tests inject their own)."""

    def process_ns(self) -> int:
        """CPU nanoseconds of the whole process (every thread), user + system."""
        return time.process_time_ns()

    def thread_ns(self) -> int:
        """CPU nanoseconds of the calling thread."""
        return time.thread_time_ns()


BUDGET_REPORT_S = 5.0  # most seconds between two ShadowBudget events while steps are offered
# tokens of the warm-up's random KV beyond the methods' full-precision windows: whole groups (of
# up to 256 tokens) and a partial one, so that every kernel a live step calls is compiled
WARM_UP_TOKENS = 300
def _budget_attr(name: str, doc: str) -> property:
    """A :class:`ShadowRunner` attribute kept in its :class:`Budget`."""
    return property(lambda self: getattr(self.budget, name),
                    lambda self, value: setattr(self.budget, name, value), doc=doc)


class ShadowRunner(UsesHookErrors):
    """See the module docstring. ``scaling``: softmax scale (head_dim ** -0.5 when None)."""

    def __init__(self, sink: Sink, methods: Union[str, Sequence[str], Sequence[Method]] = DEFAULT_METHODS,
                 sample_rate: float = 0.05, budget_frac: Optional[float] = 0.02, locality: bool = True,
                 max_batch: int = 1, scaling: Optional[float] = None, seed: int = 0,
                 cpu_clock: Optional[CpuClock] = None, background: bool = False,
                 layers_per_run: Optional[int] = None) -> None:
        # the one error policy of code run inside an engine (kvdiag.events.hooks): errors per place
        self.error_policy = HookErrors(sink)
        if isinstance(methods, str):
            self.methods = parse_methods(methods)
        else:
            self.methods = [m if isinstance(m, Method) else parse_method(m) for m in methods]
        self.budget = Budget(sample_rate, budget_frac, seed)  # which steps are measured
        self.locality = locality
        self.max_batch = max_batch
        if layers_per_run is not None and layers_per_run < 1:
            raise ValueError(f"layers_per_run: expected None (all) or >= 1, got {layers_per_run}")
        self.layers_per_run = layers_per_run
        self.scaling = scaling
        self.cpu = cpu_clock or CpuClock()
        self._last_report_ns = time.monotonic_ns()
        self.runs = 0
        self.sampled = 0
        self.dropped = 0  # sampled steps not measured because the worker was still busy
        self._lock = threading.Lock()
        self._in_flight = 0  # runs queued or being measured by the worker (under the lock)
        self._queue: Optional[queue.Queue] = queue.Queue(maxsize=1) if background else None
        self._thread: Optional[threading.Thread] = None
        if background:
            self._thread = threading.Thread(target=self._work, name="kvdiag-shadow", daemon=True)
            self._thread.start()

    sample_rate = _budget_attr("sample_rate", "The sampling rate's ceiling.")
    budget_frac = _budget_attr("budget_frac", "Shadow CPU allowed per engine CPU (None: no budget).")
    rate = _budget_attr("rate", "The sampling rate in force.")
    spent_ns = _budget_attr("spent_ns", "Shadow CPU so far, ns.")
    run_ns = _budget_attr("run_ns", "Moving average of the shadow CPU per run, ns.")
    engine_step_ns = _budget_attr("engine_step_ns", "Moving average of the engine CPU per offered step, ns.")
    offered = _budget_attr("offered", "Steps offered for sampling (should_sample calls).")
    skipped_budget = _budget_attr("skipped_budget", "Steps drawn but skipped by the budget guard.")

    # ------------------------------------------------------------ sampling

    def engine_ns(self, now_ns: Optional[int] = None) -> int:
        """CPU the process spent outside shadow work since the first offered step."""
        return self.budget.engine_ns(self.cpu.process_ns() if now_ns is None else now_ns)

    def target_rate(self) -> float:
        """The sampling rate the budget allows now, at most ``sample_rate``."""
        return self.budget.target_rate()

    def should_sample(self) -> bool:
        """Decide whether the coming step is sampled (:meth:`Budget.offer` at the process CPU
        now); the budget is reported at least every :data:`BUDGET_REPORT_S` seconds."""
        now = self.cpu.process_ns()
        with self._lock:
            sampled = self.budget.offer(now, self._in_flight)
        if time.monotonic_ns() - self._last_report_ns >= BUDGET_REPORT_S * 1e9:
            self.report_budget()
        return sampled

    def maybe_run(self, step_id: int, layers_kv: Union[LayersKV, Callable[[], LayersKV]],
                  queries: Union[Queries, Callable[[], Queries]], sampled: Optional[bool] = None) -> bool:
        """Run the shadow measurements if this step is sampled (``sampled`` overrides the draw,
        for callers that decided earlier with :meth:`should_sample`). Never raises."""
        if sampled is None:
            sampled = self.should_sample()
        if not sampled:
            return False
        inline = self._queue is None
        start = self.cpu.process_ns() if inline else self.cpu.thread_ns()
        try:
            all_kv = _resolve(layers_kv)
            layers = self.layers_of_run(len(all_kv), self.sampled)
            snapshot = self._snapshot(all_kv, _resolve(queries), layers)
            if inline:
                self._measure(snapshot, layers)
            else:
                with self._lock:
                    self._in_flight += 1  # before the worker can take it
                try:
                    self._queue.put_nowait((snapshot, layers))
                except queue.Full:
                    self.dropped += 1
                    with self._lock:
                        self._in_flight -= 1
        except Exception as exc:  # gathering inputs failed: count it, never reach the server
            self._error("shadow", exc)
        finally:
            self._account((self.cpu.process_ns() if inline else self.cpu.thread_ns()) - start, run_done=inline)
            self.sampled += 1
            self.report_budget()
        return True

    def report_budget(self) -> None:
        """Record one :class:`ShadowBudget` with the counts so far (never raises). The runner
        does after each sampled step and at least every :data:`BUDGET_REPORT_S` seconds of
        offered steps, so that the last one in a log is current; engines call it at the end."""
        try:
            self._last_report_ns = time.monotonic_ns()
            with self._lock:
                spent = self.spent_ns
            self.sink.record(ShadowBudget(
                ts_ns=time.time_ns(), steps_offered=max(self.offered, self.sampled),
                steps_sampled=self.sampled, steps_skipped_budget=self.skipped_budget,
                steps_dropped=self.dropped, spent_ns=max(spent, 0), elapsed_ns=self.engine_ns(),
                budget_frac=self.budget_frac, clock="cpu", sample_rate=self.rate,
                sample_rate_max=self.sample_rate))
        except Exception as exc:
            self._error("shadow", exc)

    def _account(self, ns: int, run_done: bool) -> None:
        """Add ``ns`` of shadow CPU (:meth:`Budget.account`; the worker thread calls too)."""
        with self._lock:
            self.budget.account(ns, run_done)

    # ------------------------------------------------------------ background worker

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                start = self.cpu.thread_ns()
                try:
                    self._measure(*item)
                except Exception as exc:
                    self._error("shadow", exc)
                with self._lock:
                    self.budget.account(self.cpu.thread_ns() - start, run_done=True)
                    self._in_flight -= 1
            finally:
                self._queue.task_done()

    def wait(self) -> None:
        """Block until the background worker has measured every queued step."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Stop the background worker (after the queued work) and record the final counts."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self.offered:
            self.report_budget()
        self.error_policy.report_totals()

    # ------------------------------------------------------------ measurement

    def layers_of_run(self, num_layers: int, run_index: int) -> list[int]:
        """The layers a sampled step measures: all, or ``layers_per_run`` of them spread over
        the depth, ``(run_index + i * num_layers // n) % num_layers``, so that consecutive runs
        cycle through every layer equally (each once per ``num_layers`` runs per slot).
        Measuring a few layers of many steps costs the budget in smaller, even pieces than
        every layer of few steps, and the steps are the independent samples."""
        n = self.layers_per_run
        if n is None or n >= num_layers:
            return list(range(num_layers))
        return sorted({(run_index + i * num_layers // n) % num_layers for i in range(n)})

    def _snapshot(self, layers_kv: LayersKV, queries: Queries, layers: Sequence[int]):
        """Private copies of the first ``max_batch`` sequences' K, V and queries of ``layers``."""
        with torch.no_grad():
            return [(layers_kv[i][0][: self.max_batch].detach().clone(),
                     layers_kv[i][1][: self.max_batch].detach().clone(),
                     queries[i][: self.max_batch].detach().float().clone()) for i in layers]

    def run(self, step_id: int, layers_kv: LayersKV, queries: Queries) -> None:
        """Measure every method on every layer of one step, in the caller's thread (no
        sampling, no budget)."""
        layers = list(range(len(layers_kv)))
        self._measure(self._snapshot(layers_kv, queries, layers), layers)

    def _measure(self, snapshot, layers: Sequence[int]) -> None:
        self.runs += 1
        ts = time.time_ns()
        with torch.no_grad():
            for layer, (k, v, q) in zip(layers, snapshot):
                self._layer(layer, k, v, q, ts, self.sink)
        self.sink.flush()

    def warm_up(self, kv_heads: int, query_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> float:
        """Pay a first run's one-time costs now (imports, the CPU kernels loaded from numba's
        cache or compiled for this head_dim): every method on random K, V and one query of this
        shape, nothing recorded, nothing counted against the budget. Call it before the engine
        takes traffic, else the first sampled step pays them inline (about a second with a
        warm numba cache, several cold); after it, the first run's cost enters the budget's
        estimates like any other's. Never raises; a method that fails here is reported as
        it would be live. Returns the wall seconds it took."""
        t0 = time.perf_counter()
        try:
            gen = torch.Generator().manual_seed(0)
            tokens = WARM_UP_TOKENS + max((spec.residual_tokens for m in self.methods
                                           for spec in (m.k_spec, m.v_spec) if spec is not None), default=0)
            k, v = (torch.randn(1, kv_heads, tokens, head_dim, generator=gen).to(dtype) for _ in range(2))
            q = torch.randn(1, query_heads, 1, head_dim, generator=gen)
            with torch.no_grad():
                self._layer(0, k, v, q, time.time_ns(), NullSink())
            with self._lock:
                self.budget.one_time_costs_paid()
        except Exception as exc:
            self._error("shadow:warm-up", exc)
        return time.perf_counter() - t0

    def _layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, ts: int, sink: Sink) -> None:
        scaling = self.scaling if self.scaling is not None else k.shape[-1] ** -0.5
        kh, qh = k.shape[1], q.shape[1]
        group = qh // kh
        p = attention_probs(q, k, scaling)
        out = torch.matmul(p, v.float().repeat_interleave(group, dim=1))
        if self.locality:
            for ev in locality_events(layer, p[:, :, -1, :], ts):
                sink.record(ev)
        attn_mass = p.sum(2).reshape(p.shape[0], kh, group, -1).sum(2)
        kf, vf = k.float(), v.float()
        for method in self.methods:
            try:
                self._method(layer, method, k, v, kf, vf, q, p, out, attn_mass, scaling, ts, sink)
            except Exception as exc:
                self._error(f"shadow:{method.name}", exc)

    def _method(self, layer, method, k, v, kf, vf, q, p, out, attn_mass, scaling, ts, sink: Sink) -> None:
        kh, group = k.shape[1], q.shape[1] // k.shape[1]
        t0 = time.perf_counter_ns()
        compressed = method.compress(k, v, attn_mass)
        t1 = time.perf_counter_ns()
        k_hat, v_hat, keep = compressed.decode()
        t2 = time.perf_counter_ns()
        p_hat = attention_probs(q, k_hat, scaling, keep)
        out_hat = torch.matmul(p_hat, v_hat.float().repeat_interleave(group, dim=1))
        ratio = compressed.ratio()
        k_err = _rel_err(kf, k_hat.float(), dims=(0, 2, 3))
        v_err = _rel_err(vf, v_hat.float(), dims=(0, 2, 3))
        tv = 0.5 * (p - p_hat).abs().sum(-1)  # [B, QH, Tq]
        tv = tv.reshape(tv.shape[0], kh, group, -1).mean(dim=(0, 2, 3))
        o_err = _rel_err(out.reshape(out.shape[0], kh, group, *out.shape[2:]),
                         out_hat.reshape(out.shape[0], kh, group, *out.shape[2:]), dims=(0, 2, 3, 4))
        enc_ns, dec_ns = (t1 - t0) // kh, (t2 - t1) // kh
        for h in range(kh):
            sink.record(ShadowCompression(
                ts_ns=ts, layer=layer, head=h, method=method.name, seq_len_tokens=k.shape[2],
                ratio=ratio, k_rel_error=float(k_err[h]), v_rel_error=float(v_err[h]),
                attn_score_error=float(tv[h]), attn_out_rel_error=float(o_err[h]),
                encode_ns=enc_ns, decode_ns=dec_ns))

    def _error(self, collector: str, exc: Exception) -> None:
        """:class:`kvdiag.events.hooks.HookErrors`: counted, the first of each (place, type) reported,
        each place's total at :meth:`close`; never raised."""
        self.error_policy.failed(collector, exc)


def _rel_err(x: torch.Tensor, x_hat: torch.Tensor, dims) -> torch.Tensor:
    """||x - x_hat|| / ||x|| per head (dim 1), norms over ``dims``."""
    num = (x - x_hat).double().pow(2).sum(dims).sqrt()
    den = x.double().pow(2).sum(dims).sqrt()
    return num / den.clamp_min(1e-300)
