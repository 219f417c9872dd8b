"""The engine's own ``/metrics`` as this client saw them (``EngineMetrics``): what fills the
pool, prefix-sharing and latency panels of a server watched from outside, without a kvdiag
agent (``kvdiag top --pid``, :class:`kvdiag.live.outside_sources.OutsideSource`).

Joined mid-stream: the first scrape seen is the baseline. Counters (prefix-cache queries and
hits, preemptions, generated tokens) and histograms (TTFT, inter-token, queue) are shown as
their increases since then, never as totals since the engine started; gauges (KV cache usage,
running and waiting requests) as read. A counter that falls (the engine restarted) makes that
scrape the new baseline.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from kvdiag.events import schema as s
from kvdiag.live.views.series import Series

COUNTERS = ("prefix_cache_queries_tokens", "prefix_cache_hits_tokens", "num_preemptions", "generation_tokens")
LATENCY_HISTOGRAMS = {"ttft": "ttft_s", "tpot": "inter_token_s", "queue": "queue_s"}
"""Latency panel row -> ``EngineMetrics.histograms`` key (the offline reading's
:data:`kvdiag.diagnosis.user_latency.ENGINE_HISTOGRAMS`: vLLM's inter-token histogram stands for
TPOT, one observation per output token)."""
SOURCE = "engine /metrics"


class EngineFold:
    """The first (baseline) and latest ``EngineMetrics``, the usage gauge per bin and the
    generated-tokens counter of the recent scrapes (for a windowed rate)."""

    def __init__(self) -> None:
        self.first: Optional[s.EngineMetrics] = None
        self.latest: Optional[s.EngineMetrics] = None
        self.usage = Series()  # kv_cache_usage per bin
        self.generated: deque[tuple[int, float]] = deque()  # (ts_ns, generation_tokens) of scrapes
        self.handlers = {s.EngineMetrics: self.on_metrics}

    def on_metrics(self, ev: s.EngineMetrics, b, idx: int) -> None:
        prev = self.latest
        if prev is not None and any(
                getattr(ev, c) is not None and getattr(prev, c) is not None and getattr(ev, c) < getattr(prev, c)
                for c in COUNTERS):
            self.first = None  # restarted: count from its restart
            self.generated.clear()
        if self.first is None:
            self.first = ev
        self.latest = ev
        if ev.kv_cache_usage is not None:
            self.usage.set(idx, ev.kv_cache_usage)
        if ev.generation_tokens is not None:
            self.generated.append((ev.ts_ns, ev.generation_tokens))

    def trim(self, first: int) -> None:
        self.usage.trim(first)

    def since_ns(self) -> Optional[int]:
        """When the increases start: the baseline scrape (None before a second scrape)."""
        return self.first.ts_ns if self.first is not None and self.latest is not self.first else None

    def delta(self, name: str) -> Optional[float]:
        """Increase of counter ``name`` since the baseline (None before a second scrape, or
        when either scrape lacks it)."""
        m, m0 = self.latest, self.first
        if m is None or m0 is None or m is m0:
            return None
        now, then = getattr(m, name), getattr(m0, name)
        return now - then if now is not None and then is not None else None

    def tokens_per_s(self, now_ns: int, window_ns: int) -> Optional[float]:
        """Generated tokens per second over the scrapes of the last ``window_ns`` (the counter's
        increase over their time span; None with fewer than two)."""
        while len(self.generated) > 2 and self.generated[1][0] < now_ns - window_ns:
            self.generated.popleft()
        recent = [(t, v) for t, v in self.generated if t >= now_ns - window_ns]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return None
        return (recent[-1][1] - recent[0][1]) / ((recent[-1][0] - recent[0][0]) / 1e9)

    def latency_s(self, row: str) -> Optional[tuple[float, float, int]]:
        """(P50, P99, observations) in seconds of latency ``row`` (:data:`LATENCY_HISTOGRAMS`)
        over the histogram's increase since the baseline, interpolated within buckets as
        PromQL's ``histogram_quantile`` (:mod:`kvdiag.diagnosis.engine_latency`); None without
        an increase."""
        from kvdiag.diagnosis.engine_latency import histogram_increase, histogram_quantile

        key = LATENCY_HISTOGRAMS[row]
        if self.first is None or self.latest is self.first:
            return None
        inc = histogram_increase(self.first.histograms.get(key, []), self.latest.histograms.get(key, []))
        if inc is None:
            return None
        return histogram_quantile(0.5, inc), histogram_quantile(0.99, inc), int(max(c for _, c in inc))

    def pool(self) -> Optional[dict]:
        """The pool as the engine's gauges say: ``usage`` (fraction of blocks in use, e.g. vLLM's
        ``kv_cache_usage_perc``), ``num_blocks``, ``block_size_tokens``, ``blocks_used`` (usage x
        blocks, rounded: vLLM's gauge is 1 - free / total), running and waiting requests and
        preemptions since the baseline; None without a usage gauge."""
        m = self.latest
        if m is None or m.kv_cache_usage is None:
            return None
        used = round(m.kv_cache_usage * m.num_blocks) if m.num_blocks else None
        preempted = self.delta("num_preemptions")
        return dict(usage=m.kv_cache_usage, num_blocks=m.num_blocks, block_size_tokens=m.block_size_tokens,
                    blocks_used=used,
                    running=int(m.num_requests_running) if m.num_requests_running is not None else None,
                    waiting=int(m.num_requests_waiting) if m.num_requests_waiting is not None else None,
                    preemptions=int(preempted) if preempted is not None else 0)
