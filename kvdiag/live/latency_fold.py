"""Latency and throughput of ``kvdiag top``: TTFT, TPOT and queue-wait percentiles of the
requests finished in the latency window, generated tokens/s, and the engine steps' demanded KV
read (blocks held x block bytes over the step's duration, against the log's copy-bandwidth
probe); without finished requests or steps, the engine's /metrics histograms."""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

from kvdiag.events import schema as s
from kvdiag.pool.blockfacts import BlockFacts
from kvdiag.pool.blockledger import BlockLedger
from kvdiag.diagnosis.findings import Finding
from kvdiag.live.pool_fold import PoolFold
from kvdiag.live.requests_fold import RequestsFold
from kvdiag.live.snapshot import LatencyView
from kvdiag.live.time_bins import Bin
from kvdiag.live.views.engine import SOURCE as ENGINE_SOURCE, EngineFold
from kvdiag.live.views.memory import MemoryFold

LATENCY_WINDOWS = 6
"""TTFT/TPOT percentiles cover requests finished in the last 6 rate windows (60 s by default):
P99 needs more requests than a 10 s window of a small server holds."""


def percentile(values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (``q`` in 0-100) of ``values``: the smallest value with at least
    q% of the values at or below it; ``None`` for an empty list."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _scaled(v: Optional[float]) -> Optional[float]:
    """Nanoseconds to milliseconds (None stays None)."""
    return v * 1e-6 if v is not None else None


class LatencyFold:
    """Folds engine steps (generated tokens, demanded KV read) and the bandwidth probe; reads
    the time ``bins`` (the requests' latencies land there), the requests, the pool's block
    bytes and ``rule_findings()`` (the p99 regression verdict)."""

    def __init__(self, bins: dict[int, Bin], bin_s: float, requests: RequestsFold, pool: PoolFold,
                 ledger: BlockLedger, facts: BlockFacts, engine: EngineFold, memory: MemoryFold,
                 rule_findings: Callable[[], tuple[Finding, ...]]) -> None:
        self.bins = bins
        self.bin_s = bin_s
        self.requests = requests
        self.pool = pool
        self.ledger = ledger
        self.facts = facts
        self.engine = engine
        self.memory = memory
        self._rule_findings = rule_findings
        self.saw_steps = False
        self.peak_copy_bytes_per_s: Optional[float] = None  # the log's bandwidth probe
        self.kv_read_bytes_total = 0.0  # demanded KV read of every step counted, and their time
        self.kv_read_step_ns_total = 0
        self.handlers = {s.EngineStep: self.on_step, s.MemoryBandwidthProbe: self.on_probe}

    def on_step(self, ev: s.EngineStep, b: Bin, idx: int) -> None:
        """Also the step's demanded KV read (kvdiag.diagnosis.bandwidth): blocks held when it
        started (the block facts' row: a live feed sees the step after its own block events)
        x block bytes, over its duration."""
        self.saw_steps = True
        b.generated_tokens += ev.decode_tokens
        held = self.facts.step(ev)
        info = self.pool.info
        if info is not None and self.ledger.block_events and ev.duration_ns > 0:
            read = held * info.block_bytes
            b.kv_read_bytes += read
            b.step_ns += ev.duration_ns
            self.kv_read_bytes_total += read
            self.kv_read_step_ns_total += ev.duration_ns

    def on_probe(self, ev: s.MemoryBandwidthProbe, b: Bin, idx: int) -> None:
        self.peak_copy_bytes_per_s = ev.copy_bandwidth_bytes_per_s or None

    def _p99_verdict(self) -> Optional[Finding]:
        return next((f for f in self._rule_findings() if f.rule == "p99.regression"), None)

    def generated(self, b: Bin) -> float:
        """Generated tokens in a bin: first tokens + decode tokens of engine steps when the
        engine reports steps, else output tokens of requests finished in the bin."""
        return b.generated_tokens if self.saw_steps else b.finished_output_tokens

    def _histories(self, first: int, last: int) -> tuple[tuple, ...]:
        """Per bin first..last: TTFT P50 and P99, TPOT P99, queue P99 (ms), generated tokens/s
        and the KV read rate (% of the probe's peak, else GB/s)."""
        p50s, p99s, tp99s, qp99s, toks, kv = [], [], [], [], [], []
        peak = self.peak_copy_bytes_per_s
        finished_count = self.requests.finished_count
        for idx in range(first, last + 1):
            b = self.bins.get(idx)
            rate = b.kv_read_bytes / (b.step_ns / 1e9) if b and b.step_ns else None
            kv.append(None if rate is None else rate / peak * 100 if peak else rate / 1e9)
            p50s.append(_scaled(percentile(b.ttft_ns, 50)) if b else None)
            p99s.append(_scaled(percentile(b.ttft_ns, 99)) if b else None)
            tp99s.append(_scaled(percentile(b.tpot_ns, 99)) if b else None)
            qp99s.append(_scaled(percentile(b.queue_ns, 99)) if b else None)
            toks.append(self.generated(b) / self.bin_s if b else (0.0 if finished_count else None))
        return tuple(p50s), tuple(p99s), tuple(tp99s), tuple(qp99s), tuple(toks), tuple(kv)

    def view(self, first: int, last: int, window: list[Bin], window_s: float,
             latency_window: list[Bin], now_ns: int) -> LatencyView:
        ttft = [v for b in latency_window for v in b.ttft_ns]
        tpot = [v for b in latency_window for v in b.tpot_ns]
        queue = [v for b in latency_window for v in b.queue_ns]
        p50s, p99s, tp99s, qp99s, toks, kv = self._histories(first, last)
        peak = self.peak_copy_bytes_per_s
        seen = self.requests.finished_count or self.saw_steps
        if not seen:
            engine = self._engine_view(first, last, window_s, now_ns)
            if engine is not None:
                return engine
        step_ns = sum(b.step_ns for b in window)
        kv_rate = sum(b.kv_read_bytes for b in window) / (step_ns / 1e9) if step_ns else None
        return LatencyView(
            ttft_p50_ms=_scaled(percentile(ttft, 50)), ttft_p99_ms=_scaled(percentile(ttft, 99)),
            tpot_p50_ms=_scaled(percentile(tpot, 50)), tpot_p99_ms=_scaled(percentile(tpot, 99)),
            queue_p50_ms=_scaled(percentile(queue, 50)), queue_p99_ms=_scaled(percentile(queue, 99)),
            queue_p99_history=qp99s,
            queue_reason="" if self.requests.saw_scheduled or not seen else "the engine emits no scheduling events",
            tokens_per_s=sum(self.generated(b) for b in window) / window_s if seen else None,
            ttft_p50_history=p50s, ttft_p99_history=p99s, tpot_p99_history=tp99s,
            tokens_history=toks,
            p99_verdict=self._p99_verdict(),
            reason="" if seen else "no finished requests yet",
            kv_read_bytes_per_s=kv_rate,
            kv_bandwidth_utilisation=kv_rate / peak if kv_rate is not None and peak else None,
            kv_bandwidth_history=kv if any(v is not None for v in kv) else (),
            kv_bandwidth_history_unit="%" if peak else "GB/s",
            nvml_memory_util_pct=self.memory.memory_util_pct())

    def _engine_view(self, first: int, last: int, window_s: float, now_ns: int) -> Optional[LatencyView]:
        """Without finished requests: the engine's /metrics histograms, their increase since
        the join (:meth:`kvdiag.live.views.engine.EngineFold.latency_s`); None without one."""
        rows = {r: self.engine.latency_s(r) for r in ("ttft", "tpot", "queue")}
        if all(v is None for v in rows.values()):
            return None
        ms = lambda r, i: rows[r][i] * 1e3 if rows[r] is not None else None  # noqa: E731
        since = self.engine.since_ns()
        at = time.strftime("%H:%M:%S", time.localtime(since / 1e9)) if since else "?"
        none = (None,) * (last - first + 1)
        return LatencyView(
            ttft_p50_ms=ms("ttft", 0), ttft_p99_ms=ms("ttft", 1), tpot_p50_ms=ms("tpot", 0), tpot_p99_ms=ms("tpot", 1),
            queue_p50_ms=ms("queue", 0), queue_p99_ms=ms("queue", 1),
            queue_reason="" if rows["queue"] is not None else "the engine's /metrics have no queue-time histogram",
            tokens_per_s=self.engine.tokens_per_s(now_ns, int(window_s * 1e9)),
            ttft_p50_history=none, ttft_p99_history=none, tpot_p99_history=none, tokens_history=none,
            queue_p99_history=none, p99_verdict=self._p99_verdict(), reason="",
            nvml_memory_util_pct=self.memory.memory_util_pct(),
            source=f"{ENGINE_SOURCE} histograms since {at} (within buckets)")
