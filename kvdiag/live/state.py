"""Incremental state behind ``kvdiag top``: events in, an immutable :class:`Snapshot` out.

``LiveState.feed(event)`` is O(1) per event (a few dict updates); ``snapshot(now_ns)`` costs
O(history bins + live requests), independent of how many events were seen, so a log of
10,000 requests snapshots as fast as a short one. Histories are binned by event time
(``bin_s``), so a replay at any speed, or a test with a fixed clock, gives the same picture.

``LiveState`` is the composition: it owns the block ledger, the time bins and the header, and
dispatches each event to the fold of its view (``requests``, ``pool``, ``latency`` here;
memory, shadow, health, engine, sharing and curves in :mod:`kvdiag.live.views`), whose parts
:meth:`LiveState.snapshot` assembles. Pure: no UI library is imported (the TUI renders what
this returns).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional

from kvdiag.events import schema as s
from kvdiag.pool.blockfacts import BlockFacts
from kvdiag.pool.blockledger import BlockLedger
from kvdiag.pool import pressure
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.miss_causes import FOLD_EVENTS as MISS_FOLD_EVENTS, MissCauseFold
from kvdiag.live.alerts import alerts
from kvdiag.live.latency_fold import LATENCY_WINDOWS, LatencyFold
from kvdiag.live.pool_fold import PoolFold
from kvdiag.live.requests_fold import RequestsFold
from kvdiag.live.snapshot import MemoryView, Snapshot
from kvdiag.live.time_bins import Bin
from kvdiag.live.views.engine import EngineFold
from kvdiag.live.views.health import HealthFold
from kvdiag.live.views.memory import MemoryFold
from kvdiag.live.views.shadow import ShadowFold
from kvdiag.live.views.sharing import SharingFold
from kvdiag.live.views.curves import CurveFold, chain_handlers


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
        self.bins: dict[int, Bin] = {}
        self.rule_findings: tuple[Finding, ...] = ()  # run_rules over the events so far, run by the caller
        self.ledger = BlockLedger()  # the one owner of block state (held, cached, per request, leaks)
        self.facts = BlockFacts(self.ledger, keep_rows=keep_facts_rows)  # what the rules need from block events
        # the views that need no request or block state (kvdiag/live/views)
        self.memory = MemoryFold()
        self.shadow = ShadowFold()
        self.health = HealthFold()
        self.engine = EngineFold()  # the engine's /metrics (the outside view's pool, hits, latency)
        self.sharing = SharingFold(lambda: self.requests.finished_count, self.engine,
                                   lambda start, end: self.misses.explained.between(start, end))
        # the views over the requests and the pool
        self.requests = RequestsFold(self.ledger, self.sharing.finished)
        self.pool = PoolFold(self.ledger, self.facts, self.memory, self.engine, self.block_size_tokens,
                             lambda: self.requests.preemptions)
        self.latency = LatencyFold(self.bins, bin_s, self.requests, self.pool, self.ledger, self.facts,
                                   self.engine, self.memory, lambda: self.rule_findings)
        # why missed prompt tokens missed: the doctor's one definition (the engine's evictions
        # from the ledger, which folds them)
        self.misses = MissCauseFold(ledger=self.ledger)
        self.curves = CurveFold(self.block_size_tokens, lambda: self.pool.info.num_blocks if self.pool.info else None)
        self._handlers = self._handler_table()
        self._get_handler = self._handlers.get
        self._evictions_mark = 0  # the ledger's evictions already counted in a bin
        self.ledger.on_new_holder = self.requests.new_holder

    def _handler_table(self) -> dict:
        """Event type -> handler(ev, bin, bin index): each fold's own, the block facts' KV
        events, the miss-cause fold before the handlers of its types, the curves after."""
        kv_event = lambda ev, b, idx: self.facts.kv_event(ev)  # noqa: E731
        handlers = {s.PrefixCacheStored: kv_event, s.PrefixCacheRemoved: kv_event, s.PrefixCacheCleared: kv_event}
        for fold in (self.requests, self.pool, self.latency, self.memory, self.shadow, self.health,
                     self.sharing, self.engine):
            handlers.update(fold.handlers)
        metrics_view = handlers.get(s.EngineMetrics)

        def on_metrics(ev, b, idx) -> None:  # the engine's pool size for the KV-event stream
            self.facts.engine_metrics(ev)
            if metrics_view is not None:
                metrics_view(ev, b, idx)
        handlers[s.EngineMetrics] = on_metrics
        for cls in MISS_FOLD_EVENTS:
            handlers[cls] = _fold_first(self.misses.feed, handlers.get(cls))
        chain_handlers(handlers, self.curves.handlers)
        for t in (s.BlockAllocated, s.BlockReleased, s.BlockEvicted):  # the ledger's alone
            assert t not in handlers, f"{t.__name__} is folded by the ledger alone"
        return handlers

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

    def feed_all(self, events: Iterable[s.Event], others: Optional[list] = None) -> None:
        """Fold events in order, in one loop: the ledger's (:meth:`BlockLedger.apply_all`),
        which folds the block events that dominate a busy engine's stream itself and hands
        every other event to its handler here; an event that raises is counted in
        ``bad_events`` and skipped. ``others``: a list the events other than
        ``BlockAllocated``, ``BlockReleased`` and ``BlockEvicted`` are appended to, in order
        (what :meth:`kvdiag.live.rules.LiveRules.record` reads, sorted out by this loop
        instead of by a second pass over every event)."""
        other = self._other
        if others is not None:
            keep, fold = others.append, other

            def other(ev: s.Event) -> None:
                keep(ev)
                fold(ev)
        if self.start_ns is None:
            events = iter(events)
            for first in events:
                if first.ts_ns is not None:
                    self.start_ns = first.ts_ns
                self.ledger.apply_all((first,), other, self.bin_ns, self._count_bin)
                break
            else:
                return
        self.ledger.apply_all(events, other, self.bin_ns, self._count_bin)

    def feed(self, ev: s.Event) -> None:
        """Fold one event into the state (:meth:`feed_all` of one)."""
        self.feed_all((ev,))

    def _count_bin(self, idx: int, n: int) -> None:
        """``n`` events fell in bin ``idx`` (and the evictions the ledger counted since the last call)."""
        b = self.bins.get(idx)
        if b is None:
            b = self.bins[idx] = Bin()
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
                b = self.bins[idx] = Bin()
            h(ev, b, idx)

    # ------------------------------------------------------------------ snapshot

    def _bins_window(self, last: int, n: int) -> list[Bin]:
        return [self.bins[i] for i in range(last - n + 1, last + 1) if i in self.bins]

    def snapshot(self, now_ns: int, paused: bool = False, finished_source: bool = False) -> Snapshot:
        """The state as of ``now_ns`` (bins after ``now_ns`` are not shown)."""
        last = now_ns // self.bin_ns
        first = last - self.history_bins + 1
        self._trim(first)
        self.pool.record_derived(last)
        window = self._bins_window(last, self.rate_window_bins)
        window_s = self.rate_window_bins * self.bin_s
        latency_window = self._bins_window(last, self.rate_window_bins * LATENCY_WINDOWS)
        info = self.pool.info
        pool = self.pool.view(first, last, window, window_s, now_ns)
        memory = self._memory_view(first, last, now_ns)
        sharing = self.sharing.view(first, last, self._engine_history(first, last), info)
        sharing = replace(sharing, miss_causes=tuple(self.misses.tally.by_cause().items()),
                          missed_tokens=self.misses.tally.missed_tokens)
        latency = self.latency.view(first, last, window, window_s, latency_window, now_ns)
        header = self.header
        bpt = header.bytes_per_token if header and header.bytes_per_token else None
        requests = self.requests.view(now_ns, info.block_bytes if info else None, bpt)
        health = self.health.view()
        snap = Snapshot(
            now_ns=now_ns, start_ns=self.start_ns or now_ns, source=self.source, paused=paused,
            events=self.events, events_per_s=sum(b.events for b in window) / window_s,
            bin_s=self.bin_s, engine=header.engine if header else "", model=header.model if header else "",
            memory=memory, pool=pool, sharing=sharing,
            compression=self.shadow.compression_view(info.num_layers if info else 0),
            locality=self.shadow.locality_view(), latency=latency, requests=requests, health=health,
            alerts=(), finished_source=finished_source)
        return replace(snap, alerts=alerts(snap, self.rule_findings, self.ledger), curves=self.curves.view())

    def _trim(self, first: int) -> None:
        for idx in [i for i in self.bins if i < first - self.rate_window_bins * LATENCY_WINDOWS]:
            del self.bins[idx]
        self.pool.trim(first)
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
        kv_used, kv_total = self.pool.kv_bytes()
        return self.memory.view(first, last, now_ns, kv_used, kv_total,
                                self.pool.series["kv_pool"].history(first, last, 10), self.health.hint)

    def block_size_tokens(self) -> Optional[int]:
        """Tokens per KV block: the pool's figure, else the header's (None without either)."""
        if self.pool.info is not None:
            return self.pool.info.block_size_tokens
        return self.header.block_size_tokens if self.header else None

    def kv_demand(self) -> Optional[tuple[float, float]]:
        """(needed blocks, free blocks) of ``forecast.memory_pressure`` now, over the live
        requests admitted by the scheduler (:mod:`kvdiag.pool.pressure`); None without a
        pool sample or a block size. Requests without max_new_tokens are assumed to produce
        the P90 output length of the recently finished requests."""
        sample = self.pool.sample
        block_size = self.block_size_tokens()
        if sample is None or not block_size:
            return None
        active = [r for r in self.requests.live.values()
                  if r.arrival_seen and (r.scheduled_seen or not self.requests.saw_scheduled)]
        fallback = pressure.fallback_output_tokens(
            [r.output_tokens for r in self.requests.finished.values() if r.output_tokens is not None])
        expected = sum(pressure.expected_blocks(
            r.prompt_tokens, r.max_new_tokens if r.max_new_tokens is not None else fallback,
            r.hit_blocks, block_size) for r in active)
        opened = self.ledger.open  # BlockAllocated events since arrival (the forecast's blocks taken)
        allocated = sum(opened[r.request_id][0] for r in active if r.request_id in opened)
        return float(pressure.needed_blocks(expected, allocated)), float(sample.blocks_free + sample.blocks_cached)


def _fold_first(fold, handler):
    """A handler that passes the event to ``fold`` first, then to ``handler`` (if any)."""
    if handler is None:
        return lambda ev, b, idx: fold(ev)

    def both(ev, b, idx) -> None:
        fold(ev)
        handler(ev, b, idx)
    return both
