"""Incremental state behind ``kvdiag top``: events in, an immutable :class:`Snapshot` out.

``LiveState.feed(event)`` is O(1) per event (a few dict updates); ``snapshot(now_ns)`` costs
O(history bins + live requests), independent of how many events were seen, so a log of
10,000 requests snapshots as fast as a short one. Histories are binned by event time
(``bin_s``), so a replay at any speed, or a test with a fixed clock, gives the same picture.

Pure: no UI library is imported (the TUI renders what this returns).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from kvdiag.events import schema as s
from kvdiag.pool.blockfacts import BlockFacts
from kvdiag.pool.blockledger import ANOMALY_KINDS, BlockLedger
from kvdiag.diagnosis import leaks
from kvdiag.pool import pressure
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.miss_causes import FOLD_EVENTS as MISS_FOLD_EVENTS, MissCauseFold
from kvdiag.diagnosis.rules import RELEASE_GRACE_NS
from kvdiag.live.snapshot import LatencyView, MemoryView, PoolView, RequestRow, RequestsView, Snapshot
from kvdiag.live.views.engine import SOURCE as ENGINE_SOURCE, EngineFold
from kvdiag.live.views.health import HealthFold
from kvdiag.live.views.memory import MemoryFold
from kvdiag.live.views.series import Series
from kvdiag.live.views.shadow import ShadowFold
from kvdiag.live.views.sharing import SharingFold
from kvdiag.live.views.curves import CurveFold, chain_handlers
LATENCY_WINDOWS = 6
"""TTFT/TPOT percentiles cover requests finished in the last 6 rate windows (60 s by default):
P99 needs more requests than a 10 s window of a small server holds."""
TOP_REQUESTS = 20
RECENT_FINISHED = 200


def percentile(values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (``q`` in 0-100) of ``values``: the smallest value with at least
    q% of the values at or below it; ``None`` for an empty list."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


@dataclass(slots=True)
class _Bin:
    ttft_ns: list = field(default_factory=list)
    tpot_ns: list = field(default_factory=list)
    queue_ns: list = field(default_factory=list)  # queue waits of requests finished in the bin
    generated_tokens: int = 0
    finished_output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    events: int = 0
    kv_read_bytes: float = 0.0  # KV blocks held at each engine step x block bytes, summed
    step_ns: int = 0  # durations of those steps, summed


@dataclass(slots=True)
class _Request:
    request_id: str
    arrived_ns: int
    prompt_tokens: int = 0
    state: str = "waiting"
    hit_tokens: int = 0
    hit_blocks: int = 0
    arrival_seen: bool = False  # a RequestArrived was seen (its prompt length is known)
    scheduled_seen: bool = False  # admitted by the scheduler (a RequestScheduled was seen)
    max_new_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    ttft_ns: Optional[int] = None
    finished_ns: Optional[int] = None
    queue_ns: Optional[int] = None  # first scheduling - arrival (kvdiag.diagnosis.user_latency)


class LiveState:
    """Accumulates events; :meth:`snapshot` returns an immutable :class:`Snapshot`."""

    def __init__(self, bin_s: float = 1.0, history_bins: int = 120, rate_window_s: float = 10.0,
                 source: str = "", keep_facts_rows: bool = True) -> None:
        """``keep_facts_rows``: keep the block facts' rows, which the live rules read
        (:class:`kvdiag.live.rules.LiveRules`, top); a state no rule reads (the exporter's)
        keeps none, and its memory stays flat."""
        self.bin_ns = int(bin_s * 1e9)
        self.bin_s = bin_s
        self.history_bins = history_bins
        self.rate_window_bins = max(1, round(rate_window_s / bin_s))
        self.source = source
        self.header: Optional[s.LogHeader] = None
        self.start_ns: Optional[int] = None
        self.events = 0
        self.bins: dict[int, _Bin] = {}
        self.series: dict[str, Series] = {k: Series() for k in ("kv_pool", "occupancy")}
        # the views that need no request or block state (kvdiag/live/views)
        self.memory = MemoryFold()
        self.shadow = ShadowFold()
        self.health = HealthFold()
        self.engine = EngineFold()  # the engine's /metrics (the outside view's pool, hits, latency)
        self.sharing = SharingFold(lambda: self.finished_count, self.engine)
        # pool
        self.pool_info: Optional[s.KVPoolInfo] = None
        self.pool_sample: Optional[s.KVPoolSample] = None
        self.ledger = BlockLedger()  # the one owner of block state (held, cached, per request, leaks)
        self.facts = BlockFacts(self.ledger, keep_rows=keep_facts_rows)  # what the rules need from block events
        self.preemptions = 0
        self.peak_copy_bytes_per_s: Optional[float] = None  # the log's bandwidth probe
        self.kv_read_bytes_total = 0.0  # demanded KV read of every step counted, and their time
        self.kv_read_step_ns_total = 0
        # requests
        self.live: dict[str, _Request] = {}
        self.finished: OrderedDict[str, _Request] = OrderedDict()
        self.finished_count = 0
        self.saw_steps = False
        self.saw_scheduled = False
        self.rule_findings: tuple[Finding, ...] = ()  # run_rules over the events so far, run by the caller
        self._handlers = {t: h.__get__(self) for t, h in _HANDLERS.items()}
        for fold in (self.memory, self.shadow, self.health, self.sharing, self.engine):
            self._handlers.update(fold.handlers)
        metrics_view = self._handlers.get(s.EngineMetrics)

        def on_metrics(ev, b, idx) -> None:  # the engine's pool size for the KV-event stream
            self.facts.engine_metrics(ev)
            if metrics_view is not None:
                metrics_view(ev, b, idx)
        self._handlers[s.EngineMetrics] = on_metrics
        # why missed prompt tokens missed: the doctor's one definition, fed before the handlers
        self.misses = MissCauseFold()
        for cls in MISS_FOLD_EVENTS:
            self._handlers[cls] = _fold_first(self.misses.feed, self._handlers.get(cls))
        self.curves = CurveFold(self.block_size_tokens, lambda: self.pool_info.num_blocks if self.pool_info else None)
        chain_handlers(self._handlers, self.curves.handlers)
        for t in (s.BlockAllocated, s.BlockReleased, s.BlockEvicted):  # the ledger's alone
            assert t not in self._handlers, f"{t.__name__} is folded by the ledger alone"
        self._get_handler = self._handlers.get
        self._evictions_mark = 0  # the ledger's evictions already counted in a bin
        self.ledger.on_new_holder = self._new_holder

    @property
    def shadow_budget(self) -> Optional[s.ShadowBudget]:
        """The shadow's latest budget report (the exporter's gauge)."""
        return self.shadow.budget

    @property
    def block_events_seen(self) -> bool:
        return self.ledger.block_events > 0

    @property
    def blocks_held(self) -> int:
        """Sum over requests of the blocks each holds (the ledger's ``holdings``)."""
        return self.ledger.holdings

    # ------------------------------------------------------------------ feeding

    def set_header(self, header: s.LogHeader) -> None:
        self.header = header
        self.misses.set_engine(header.engine)
        if header.start_ns and self.start_ns is None:
            self.start_ns = header.start_ns

    @property
    def bad_events(self) -> int:
        """Events the fold could not fold (malformed: raised), counted and skipped."""
        return self.ledger.bad_events

    def feed_all(self, events: Iterable[s.Event]) -> None:
        """Fold events in order, in one loop: the ledger's (:meth:`BlockLedger.apply_all`),
        which folds the block events that dominate a busy engine's stream itself and hands
        every other event to its handler here; an event that raises is counted in
        ``bad_events`` and skipped."""
        if self.start_ns is None:
            events = iter(events)
            for first in events:
                if first.ts_ns is not None:
                    self.start_ns = first.ts_ns
                self.ledger.apply_all((first,), self._other, self.bin_ns, self._count_bin)
                break
            else:
                return
        self.ledger.apply_all(events, self._other, self.bin_ns, self._count_bin)

    def feed(self, ev: s.Event) -> None:
        """Fold one event into the state (:meth:`feed_all` of one)."""
        self.feed_all((ev,))

    def _count_bin(self, idx: int, n: int) -> None:
        """``n`` events fell in bin ``idx`` (and the evictions the ledger counted since the last call)."""
        b = self.bins.get(idx)
        if b is None:
            b = self.bins[idx] = _Bin()
        b.events += n
        self.events += n
        evictions = self.ledger.evictions
        b.evictions += evictions - self._evictions_mark
        self._evictions_mark = evictions

    def _other(self, ev: s.Event) -> None:
        """An event other than the three block events the ledger folds alone."""
        h = self._get_handler(type(ev))
        if h is not None:
            idx = ev.ts_ns // self.bin_ns
            b = self.bins.get(idx)
            if b is None:
                b = self.bins[idx] = _Bin()
            h(ev, b, idx)

    def _bin(self, ts_ns: int) -> _Bin:
        idx = ts_ns // self.bin_ns
        b = self.bins.get(idx)
        if b is None:
            b = self.bins[idx] = _Bin()
        return b

    def _request(self, request_id: str, ts_ns: int) -> _Request:
        req = self.live.get(request_id)
        if req is None:
            req = self.finished.get(request_id)
        if req is None:
            req = self.live[request_id] = _Request(request_id, ts_ns)
        return req

    def _on_arrived(self, ev: s.RequestArrived, b: _Bin, idx: int) -> None:
        req = self._request(ev.request_id, ev.ts_ns)
        req.arrived_ns = ev.ts_ns
        req.prompt_tokens = ev.prompt_tokens
        req.arrival_seen = True
        req.max_new_tokens = ev.max_new_tokens

    def _on_scheduled(self, ev: s.RequestScheduled, b: _Bin, idx: int) -> None:
        req = self._request(ev.request_id, ev.ts_ns)
        if not req.scheduled_seen:  # the first scheduling; a preempted request is scheduled again
            req.queue_ns = ev.ts_ns - req.arrived_ns if req.arrival_seen else ev.queue_ns
        req.scheduled_seen = self.saw_scheduled = True
        if req.finished_ns is None:
            req.state = "running"

    def _on_first_token(self, ev: s.RequestFirstToken, b: _Bin, idx: int) -> None:
        req = self._request(ev.request_id, ev.ts_ns)
        req.ttft_ns = ev.ttft_ns
        if req.finished_ns is None:
            req.state = "running"
        b.generated_tokens += 1

    def _on_finished(self, ev: s.RequestFinished, b: _Bin, idx: int) -> None:
        req = self.live.pop(ev.request_id, None) or self.finished.get(ev.request_id)
        if req is None:
            req = _Request(ev.request_id, ev.ts_ns - (ev.e2e_ns or 0))
        req.prompt_tokens = ev.prompt_tokens
        req.output_tokens = ev.output_tokens
        req.state = ev.status
        req.finished_ns = ev.ts_ns
        if ev.ttft_ns is not None:
            req.ttft_ns = ev.ttft_ns
        self.finished[ev.request_id] = req
        self.finished.move_to_end(ev.request_id)
        while len(self.finished) > RECENT_FINISHED:
            self.finished.popitem(last=False)
        self.finished_count += 1
        b.finished_output_tokens += ev.output_tokens
        if ev.status == "finished":
            self.sharing.finished(ev)
            b.prompt_tokens += ev.prompt_tokens
            b.cached_tokens += ev.cached_prompt_tokens
            if req.queue_ns is not None:
                b.queue_ns.append(req.queue_ns)
            if req.ttft_ns is not None:
                b.ttft_ns.append(req.ttft_ns)
                if ev.e2e_ns is not None and ev.output_tokens > 1:
                    b.tpot_ns.append((ev.e2e_ns - req.ttft_ns) / (ev.output_tokens - 1))

    def _on_preempted(self, ev: s.RequestPreempted, b: _Bin, idx: int) -> None:
        self.preemptions += 1
        req = self.live.get(ev.request_id)
        if req is not None:
            req.state = "waiting"

    def _on_step(self, ev: s.EngineStep, b: _Bin, idx: int) -> None:
        """Also the step's demanded KV read (kvdiag.diagnosis.bandwidth): blocks held when it
        started (the block facts' row: a live feed sees the step after its own block events)
        x block bytes, over its duration."""
        self.saw_steps = True
        b.generated_tokens += ev.decode_tokens
        held = self.facts.step(ev)
        if self.pool_info is not None and self.ledger.block_events and ev.duration_ns > 0:
            read = held * self.pool_info.block_bytes
            b.kv_read_bytes += read
            b.step_ns += ev.duration_ns
            self.kv_read_bytes_total += read
            self.kv_read_step_ns_total += ev.duration_ns

    def _on_probe(self, ev: s.MemoryBandwidthProbe, b: _Bin, idx: int) -> None:
        self.peak_copy_bytes_per_s = ev.copy_bandwidth_bytes_per_s or None

    def _on_pool_info(self, ev: s.KVPoolInfo, b: _Bin, idx: int) -> None:
        self.pool_info = ev

    # block state is the ledger's (kvdiag.pool.blockledger: holdings, cache, bad releases; it
    # folds every block event before the handlers below see one): they add only the
    # per-request figures top shows. BlockAllocated, BlockReleased and BlockEvicted reach no
    # handler: a request first seen by its allocation gets its row from _new_holder.

    def _new_holder(self, request_id: str, ts_ns: int) -> None:
        """A ``BlockAllocated`` made ``request_id``, which held no block, a holder."""
        self._request(request_id, ts_ns)

    def _on_hit(self, ev: s.PrefixHit, b: _Bin, idx: int) -> None:
        req = self._request(ev.request_id, ev.ts_ns)
        req.hit_tokens += ev.num_tokens
        req.hit_blocks += 1

    def _on_deduplicated(self, ev, b: _Bin, idx: int) -> None:
        """``BlockDeduplicated``: the request now holds the cached ``block_id`` (its duplicate
        is given back by the ``BlockReleased`` that follows)."""
        self._request(ev.request_id, ev.ts_ns)

    def _on_pool_sample(self, ev: s.KVPoolSample, b: _Bin, idx: int) -> None:
        self.pool_sample = ev
        self.facts.pool_sample(ev)
        if ev.num_blocks:
            self.series["occupancy"].set(idx, ev.blocks_used / ev.num_blocks)
        if self.pool_info is not None:
            used = ev.blocks_used + ev.blocks_cached
            self.series["kv_pool"].set(idx, used * self.pool_info.block_bytes)

    # ------------------------------------------------------------------ snapshot

    def _bins_window(self, last: int, n: int) -> list[_Bin]:
        return [self.bins[i] for i in range(last - n + 1, last + 1) if i in self.bins]

    def snapshot(self, now_ns: int, paused: bool = False, finished_source: bool = False) -> Snapshot:
        """The state as of ``now_ns`` (bins after ``now_ns`` are not shown)."""
        last = now_ns // self.bin_ns
        first = last - self.history_bins + 1
        self._trim(first)
        self._record_derived(last)
        window = self._bins_window(last, self.rate_window_bins)
        window_s = self.rate_window_bins * self.bin_s
        latency_window = self._bins_window(last, self.rate_window_bins * LATENCY_WINDOWS)
        pool = self._pool_view(first, last, window, window_s, now_ns)
        memory = self._memory_view(first, last, now_ns)
        sharing = self.sharing.view(first, last, self._engine_history(first, last), self.pool_info)
        sharing = replace(sharing, miss_causes=tuple(self.misses.tally.by_cause().items()),
                          missed_tokens=self.misses.tally.missed_tokens)
        latency = self._latency_view(first, last, window, window_s, latency_window, now_ns)
        requests = self._requests_view(now_ns)
        health = self.health.view()
        header = self.header
        snap = Snapshot(
            now_ns=now_ns, start_ns=self.start_ns or now_ns, source=self.source, paused=paused,
            events=self.events, events_per_s=sum(b.events for b in window) / window_s,
            bin_s=self.bin_s, engine=header.engine if header else "", model=header.model if header else "",
            memory=memory, pool=pool, sharing=sharing,
            compression=self.shadow.compression_view(self.pool_info.num_layers if self.pool_info else 0),
            locality=self.shadow.locality_view(), latency=latency, requests=requests, health=health,
            alerts=(), finished_source=finished_source)
        return replace(snap, alerts=self._alerts(snap), curves=self.curves.view())

    def _trim(self, first: int) -> None:
        for idx in [i for i in self.bins if i < first - self.rate_window_bins * LATENCY_WINDOWS]:
            del self.bins[idx]
        for series in self.series.values():
            series.trim(first)
        self.memory.trim(first)
        self.sharing.trim(first)
        self.engine.trim(first)

    def _engine_history(self, first: int, last: int) -> tuple:
        """The engine's token hit rate of the requests finished in each bin first..last."""
        out = []
        for idx in range(first, last + 1):
            b = self.bins.get(idx)
            out.append(b.cached_tokens / b.prompt_tokens if b and b.prompt_tokens else None)
        return tuple(out)

    def _memory_view(self, first: int, last: int, now_ns: int) -> MemoryView:
        """The memory fold's view, with the KV pool's bytes (used and cached; total)."""
        kv_used = kv_total = None
        info = self.pool_info
        if info is not None:
            kv_total = info.num_blocks * info.block_bytes
            blocks = self._pool_blocks()
            if blocks is not None:
                kv_used = (blocks[0] + blocks[1]) * info.block_bytes
        return self.memory.view(first, last, now_ns, kv_used, kv_total,
                                self.series["kv_pool"].history(first, last, 10), self.health.hint)

    def _record_derived(self, last: int) -> None:
        """Without pool samples, the gauges come from block events: record them for this bin."""
        if self.pool_sample is not None:
            return
        blocks = self._pool_blocks()
        if blocks is None:
            return
        if self.pool_info is not None:
            self.series["kv_pool"].set(last, (blocks[0] + blocks[1]) * self.pool_info.block_bytes)
            if self.pool_info.num_blocks:
                self.series["occupancy"].set(last, blocks[0] / self.pool_info.num_blocks)

    def block_size_tokens(self) -> Optional[int]:
        """Tokens per KV block: the pool's figure, else the header's (None without either)."""
        if self.pool_info is not None:
            return self.pool_info.block_size_tokens
        return self.header.block_size_tokens if self.header else None

    def kv_demand(self) -> Optional[tuple[float, float]]:
        """(needed blocks, free blocks) of ``forecast.memory_pressure`` now, over the live
        requests admitted by the scheduler (:mod:`kvdiag.pool.pressure`); None without a
        pool sample or a block size. Requests without max_new_tokens are assumed to produce
        the P90 output length of the recently finished requests."""
        sample = self.pool_sample
        block_size = self.block_size_tokens()
        if sample is None or not block_size:
            return None
        active = [r for r in self.live.values()
                  if r.arrival_seen and (r.scheduled_seen or not self.saw_scheduled)]
        fallback = pressure.fallback_output_tokens(
            [r.output_tokens for r in self.finished.values() if r.output_tokens is not None])
        expected = sum(pressure.expected_blocks(
            r.prompt_tokens, r.max_new_tokens if r.max_new_tokens is not None else fallback,
            r.hit_blocks, block_size) for r in active)
        opened = self.ledger.open  # BlockAllocated events since arrival (the forecast's blocks taken)
        allocated = sum(opened[r.request_id][0] for r in active if r.request_id in opened)
        return float(pressure.needed_blocks(expected, allocated)), float(sample.blocks_free + sample.blocks_cached)

    def _pool_blocks(self) -> Optional[tuple[int, int]]:
        """(blocks held by requests, blocks held only by the prefix cache): the latest pool
        sample, else the ledger's counts."""
        if self.pool_sample is not None:
            return self.pool_sample.blocks_used, self.pool_sample.blocks_cached
        ledger = self.ledger
        if self.pool_info is None and not ledger.holders and not ledger.cached:
            return None
        return ledger.held_blocks, ledger.cached_blocks

    def _pool_view(self, first: int, last: int, window: list[_Bin], window_s: float, now_ns: int) -> PoolView:
        info, sample = self.pool_info, self.pool_sample
        blocks = self._pool_blocks()
        num_blocks = sample.num_blocks if sample else (info.num_blocks if info else None)
        block_size = self.block_size_tokens()
        used, cached = blocks if blocks else (None, None)
        block_occ = used / num_blocks if used is not None and num_blocks else None
        token_occ = None
        inconsistency = ""
        if sample is not None and block_size and sample.blocks_used:
            slots = sample.blocks_used * block_size
            token_occ = sample.tokens_held / slots
            if token_occ > 1:  # more tokens than slots: the sampler counted shared blocks per request
                inconsistency = (f"pool sample: {sample.tokens_held} tokens held > {slots} slots of "
                                 f"{sample.blocks_used} used blocks; token occupancy not shown")
                token_occ = None
        alloc_frag = self.memory.allocator_fragmentation()
        ledger = self.ledger
        has_pool = info is not None or sample is not None or bool(ledger.holders)
        seen = ledger.block_events > 0
        holding = ledger.finished_holding_count(now_ns, RELEASE_GRACE_NS) if seen else (None, None)
        if not has_pool:
            gauges = self._engine_pool_view(first, last)
            if gauges is not None:
                return gauges
        return PoolView(
            num_blocks=num_blocks, block_size_tokens=block_size, blocks_used=used, blocks_cached=cached,
            block_occupancy=block_occ, token_occupancy=token_occ,
            pool_fragmentation=1.0 - token_occ if token_occ is not None else None,
            allocator_fragmentation=alloc_frag,
            evictions_per_s=sum(b.evictions for b in window) / window_s if has_pool else None,
            preemptions=self.preemptions,
            running_requests=sample.running_requests if sample else None,
            waiting_requests=sample.waiting_requests if sample else None,
            occupancy_history=self.series["occupancy"].history(first, last, 10),
            reason="" if has_pool else "no KV pool events: the server needs the kvdiag agent (kvdiag demo runs one)",
            inconsistency=inconsistency,
            ledger_held_blocks=ledger.held_blocks if seen else None,
            ledger_cached_blocks=ledger.cached_blocks if seen else None,
            ledger_free_blocks=ledger.free_blocks if seen else None,
            finished_holding_requests=holding[0], finished_holding_blocks=holding[1],
            block_anomalies=tuple((k, ledger.anomaly_counts[k]) for k in ANOMALY_KINDS) if seen else ())

    def _engine_pool_view(self, first: int, last: int) -> Optional[PoolView]:
        """Without the agent's pool events: the pool as the engine's /metrics gauges say
        (:meth:`kvdiag.live.views.engine.EngineFold.pool`), None without a usage gauge."""
        g = self.engine.pool()
        if g is None:
            return None
        return PoolView(
            num_blocks=g["num_blocks"], block_size_tokens=g["block_size_tokens"], blocks_used=g["blocks_used"],
            blocks_cached=None, block_occupancy=g["usage"], token_occupancy=None, pool_fragmentation=None,
            allocator_fragmentation=self.memory.allocator_fragmentation(), evictions_per_s=None,
            preemptions=g["preemptions"], running_requests=g["running"], waiting_requests=g["waiting"],
            occupancy_history=self.engine.usage.history(first, last, 10), reason="",
            source=f"{ENGINE_SOURCE}: KV cache usage gauge")

    def _engine_latency_view(self, first: int, last: int, window_s: float, now_ns: int) -> Optional[LatencyView]:
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
            queue_p99_history=none,
            p99_verdict=next((f for f in self.rule_findings if f.rule == "p99.regression"), None), reason="",
            nvml_memory_util_pct=self.memory.memory_util_pct(),
            source=f"{ENGINE_SOURCE} histograms since {at} (within buckets)")

    def _latency_view(self, first: int, last: int, window: list[_Bin], window_s: float,
                      latency_window: list[_Bin], now_ns: int) -> LatencyView:
        ttft = [v for b in latency_window for v in b.ttft_ns]
        tpot = [v for b in latency_window for v in b.tpot_ns]
        queue = [v for b in latency_window for v in b.queue_ns]
        ms = 1e-6

        def scaled(v: Optional[float]) -> Optional[float]:
            return v * ms if v is not None else None

        p50s, p99s, tp99s, qp99s, toks, kv = [], [], [], [], [], []
        peak = self.peak_copy_bytes_per_s
        for idx in range(first, last + 1):
            b = self.bins.get(idx)
            rate = b.kv_read_bytes / (b.step_ns / 1e9) if b and b.step_ns else None
            kv.append(None if rate is None else rate / peak * 100 if peak else rate / 1e9)
            p50s.append(scaled(percentile(b.ttft_ns, 50)) if b else None)
            p99s.append(scaled(percentile(b.ttft_ns, 99)) if b else None)
            tp99s.append(scaled(percentile(b.tpot_ns, 99)) if b else None)
            qp99s.append(scaled(percentile(b.queue_ns, 99)) if b else None)
            toks.append(self._generated(b) / self.bin_s if b else (0.0 if self.finished_count else None))
        seen = self.finished_count or self.saw_steps
        if not seen:
            engine = self._engine_latency_view(first, last, window_s, now_ns)
            if engine is not None:
                return engine
        step_ns = sum(b.step_ns for b in window)
        kv_rate = sum(b.kv_read_bytes for b in window) / (step_ns / 1e9) if step_ns else None
        return LatencyView(
            ttft_p50_ms=scaled(percentile(ttft, 50)), ttft_p99_ms=scaled(percentile(ttft, 99)),
            tpot_p50_ms=scaled(percentile(tpot, 50)), tpot_p99_ms=scaled(percentile(tpot, 99)),
            queue_p50_ms=scaled(percentile(queue, 50)), queue_p99_ms=scaled(percentile(queue, 99)),
            queue_p99_history=tuple(qp99s),
            queue_reason="" if self.saw_scheduled or not seen else "the engine emits no scheduling events",
            tokens_per_s=sum(self._generated(b) for b in window) / window_s if seen else None,
            ttft_p50_history=tuple(p50s), ttft_p99_history=tuple(p99s), tpot_p99_history=tuple(tp99s),
            tokens_history=tuple(toks),
            p99_verdict=next((f for f in self.rule_findings if f.rule == "p99.regression"), None),
            reason="" if seen else "no finished requests yet",
            kv_read_bytes_per_s=kv_rate,
            kv_bandwidth_utilisation=kv_rate / peak if kv_rate is not None and peak else None,
            kv_bandwidth_history=tuple(kv) if any(v is not None for v in kv) else (),
            kv_bandwidth_history_unit="%" if peak else "GB/s",
            nvml_memory_util_pct=self.memory.memory_util_pct())

    def _generated(self, b: _Bin) -> float:
        """Generated tokens in a bin: first tokens + decode tokens of engine steps when the
        engine reports steps, else output tokens of requests finished in the bin."""
        return b.generated_tokens if self.saw_steps else b.finished_output_tokens

    def _requests_view(self, now_ns: int) -> RequestsView:
        info, header = self.pool_info, self.header
        block_bytes = info.block_bytes if info else None
        bpt = header.bytes_per_token if header and header.bytes_per_token else None

        blocks_of = self.ledger.blocks_of

        def kv_bytes(r: _Request) -> Optional[int]:
            blocks = blocks_of(r.request_id)
            if blocks and block_bytes:
                return len(blocks) * block_bytes
            if self.block_events_seen or r.finished_ns is not None or r.state == "waiting":
                return 0  # the engine reports blocks and this request holds none
            return r.prompt_tokens * bpt if bpt is not None else None  # no block events: estimate

        live = heapq.nlargest(TOP_REQUESTS, self.live.values(),
                              key=lambda r: (kv_bytes(r) or 0, -r.arrived_ns))
        rows = [_row(r, kv_bytes(r), now_ns, blocks_of(r.request_id)) for r in live]
        for r in reversed(self.finished.values()):
            if len(rows) >= TOP_REQUESTS:
                break
            rows.append(_row(r, kv_bytes(r), now_ns, blocks_of(r.request_id)))
        reason = "" if rows else "no requests seen yet"
        return RequestsView(rows=tuple(rows), live=len(self.live), finished=self.finished_count, reason=reason)

    def _alerts(self, snap: Snapshot) -> tuple[Finding, ...]:
        """The rules' findings (:func:`kvdiag.diagnosis.doctor.run_rules`, run by the caller
        over the events seen so far, in ``rule_findings``; the release-path and double-release
        rules from the block ledger, over every event), then collector health: events
        dropped, collector errors and collectors not available here."""
        out: list[Finding] = list(self.rule_findings)
        if self.ledger.block_events:  # the leak rules the ledger decides, judged on all events
            ledger_rules = {f.rule: f for f in leaks.ledger_findings(self.ledger, now_ns=snap.now_ns)}
            merged = []
            for f in out:  # in the doctor's order: the ledger's rules where release_paths stands
                merged.append(ledger_rules.pop(f.rule, f))
                if f.rule == "leak.release_paths":
                    merged += [ledger_rules.pop(r) for r in list(ledger_rules)]
            out = merged + list(ledger_rules.values())
        if snap.pool.inconsistency:
            out.append(Finding("collector.pool_samples", "warn", "KV pool samples inconsistent",
                               snap.pool.inconsistency, {}))
        if snap.health.dropped_events or snap.health.gaps:
            out.append(Finding("collector.gaps", "warn", "collector gaps",
                               f"{snap.health.dropped_events} events dropped in {snap.health.gaps} gaps",
                               {"dropped_events": snap.health.dropped_events}))
        for collector, count, message in snap.health.errors:
            out.append(Finding(f"collector.errors.{collector}", "warn", f"{collector} errors",
                               f"{count} errors; last: {message}", {"count": count}))
        for collector, hint in snap.health.unavailable:
            out.append(Finding(f"collector.unavailable.{collector}", "n/a", f"{collector} unavailable",
                               hint or "not available on this host", {}))
        # failures and warnings first; among the rest, why data is missing before rules that
        # had no data to judge
        order = {"fail": 0, "warn": 1, "n/a": 2, "pass": 3}
        return tuple(sorted(out, key=lambda f: (order[f.status], not f.rule.startswith("collector."))))


def _row(r: _Request, kv: Optional[int], now_ns: int, blocks) -> RequestRow:
    end = r.finished_ns if r.finished_ns is not None else now_ns
    return RequestRow(
        request_id=r.request_id, state=r.state, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
        blocks=len(blocks), kv_bytes=kv, hit_tokens=r.hit_tokens, hit_blocks=r.hit_blocks,
        age_s=max(0.0, (end - r.arrived_ns) / 1e9),
        ttft_ms=r.ttft_ns / 1e6 if r.ttft_ns is not None else None, block_ids=tuple(sorted(blocks)))


_HANDLERS = {
    s.RequestArrived: LiveState._on_arrived,
    s.RequestScheduled: LiveState._on_scheduled,
    s.RequestFirstToken: LiveState._on_first_token,
    s.RequestFinished: LiveState._on_finished,
    s.RequestPreempted: LiveState._on_preempted,
    s.EngineStep: LiveState._on_step,
    s.KVPoolInfo: LiveState._on_pool_info,
    s.PrefixHit: LiveState._on_hit,
    s.KVPoolSample: LiveState._on_pool_sample,
    s.MemoryBandwidthProbe: LiveState._on_probe,
    s.PrefixCacheStored: lambda self, ev, b, idx: self.facts.kv_event(ev),
    s.PrefixCacheRemoved: lambda self, ev, b, idx: self.facts.kv_event(ev),
    s.PrefixCacheCleared: lambda self, ev, b, idx: self.facts.kv_event(ev),
}
if hasattr(s, "BlockDeduplicated"):  # added to the schema by the engine adapter's work
    _HANDLERS[s.BlockDeduplicated] = LiveState._on_deduplicated


def _fold_first(fold, handler):
    """A handler that passes the event to ``fold`` first, then to ``handler`` (if any)."""
    if handler is None:
        return lambda ev, b, idx: fold(ev)

    def both(ev, b, idx) -> None:
        fold(ev)
        handler(ev, b, idx)
    return both
