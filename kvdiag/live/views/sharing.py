"""Prefix sharing: the engine's hit rate (its finished requests, else its counters' increase
since the first scrape seen) against the shadow caches' (``ShadowSharing``) over the same
requests, and the what-if table of every shadow configuration."""

from __future__ import annotations

import math
from typing import Callable, Optional

from kvdiag.events import schema as s
from kvdiag.simulation.live_sharing import engine_token_hit_rate, headline_config, sharing_window
from kvdiag.diagnosis.rules import MIN_SHARING_REQUESTS, sharing_gap_status, too_few, unexplained_gap
from kvdiag.live.snapshot import SharingView, WhatIfPoint
from kvdiag.live.views.engine import EngineFold
from kvdiag.live.views.series import Series
from kvdiag.live.views.shadow import NO_SHADOW


class SharingFold:
    """``finished_count``: how many requests have finished (the requests' fold keeps it);
    ``explained_between(start_ns, end_ns)``: the miss causes' explained tokens of the requests
    finished in ``(start_ns, end_ns]`` (:meth:`kvdiag.diagnosis.miss_tally.ExplainedLog.between`),
    which ``sharing.consistency`` does not count against the engine."""

    def __init__(self, finished_count: Callable[[], int], engine: EngineFold,
                 explained_between: Callable[[Optional[int], Optional[int]], int] = lambda a, b: 0) -> None:
        self._finished_count = finished_count
        self._explained_between = explained_between
        self.engine = engine  # the engine's /metrics: its counters' increases since the join
        self.shadow: dict[tuple, s.ShadowSharing] = {}
        self.baseline: dict[tuple, s.ShadowSharing] = {}  # each configuration's first result
        self.drained: dict[tuple, s.ShadowSharing] = {}  # its latest with no request in flight
        self.drained_prompt_tokens: dict[tuple, int] = {}  # of the requests finished by then
        self.series: dict[tuple, Series] = {}
        self.engine_prompt_tokens = 0  # of the requests finished (status "finished") here
        self.engine_cached_tokens = 0
        self.handlers = {s.ShadowSharing: self.on_shadow_sharing}

    def finished(self, ev: s.RequestFinished) -> None:
        """A request finished (status "finished"): its prompt and cached tokens count."""
        self.engine_prompt_tokens += ev.prompt_tokens
        self.engine_cached_tokens += ev.cached_prompt_tokens

    def on_shadow_sharing(self, ev: s.ShadowSharing, b, idx: int) -> None:
        key = (ev.policy, ev.block_size_tokens, ev.capacity_blocks)
        self.shadow[key] = ev
        base = self.baseline.setdefault(key, ev)
        if ev.requests and ev.requests == self._finished_count():  # every request it counted finished
            self.drained[key] = ev
            self.drained_prompt_tokens[key] = self.engine_prompt_tokens
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = Series()
        window = sharing_window(base, ev)
        if window is None:
            series.set(idx, ev.token_hit_rate)
        elif window.shadow_hit_rate is not None:
            series.set(idx, window.shadow_hit_rate)

    def trim(self, first: int) -> None:
        for series in self.series.values():
            series.trim(first)

    def engine_hit_rate(self) -> Optional[float]:
        """Over the requests finished since this state began, else the increase of the
        engine's counters since its first metrics scrape seen here (never their totals since
        the engine started: the client may have joined late)."""
        delta = self.engine.delta
        return engine_token_hit_rate(self.engine_prompt_tokens, self.engine_cached_tokens,
                                     delta("prefix_cache_queries_tokens"), delta("prefix_cache_hits_tokens"))

    def engine_counters_since_ns(self) -> Optional[int]:
        """The scrape the engine hit rate's counter increases start from, when it is read from
        the counters (no finished requests seen); else None."""
        if self.engine_prompt_tokens or not self.engine.delta("prefix_cache_queries_tokens"):
            return None
        return self.engine.since_ns()

    def headline_key(self, pool_info: Optional[s.KVPoolInfo]) -> Optional[tuple]:
        """The shadow configuration closest to the engine's (the same choice as the
        ``sharing.consistency`` rule makes)."""
        if not self.shadow:
            return None
        return headline_config(self.shadow, pool_info.block_size_tokens if pool_info else None,
                               pool_info.num_blocks if pool_info else None)

    def view(self, first: int, last: int, engine_history: tuple, pool_info: Optional[s.KVPoolInfo]) -> SharingView:
        """``engine_history``: the engine's hit rate per bin first..last (the requests' bins)."""
        engine = self.engine_hit_rate()
        key = self.headline_key(pool_info)
        head = self.shadow.get(key) if key else None
        shadow_cfg = point(head) if head else None
        if engine is None and head is not None and head.engine_hit_rate is not None:
            engine = head.engine_hit_rate
        shadow = head.token_hit_rate if head else None
        window = sharing_window(self.baseline[key], head) if head is not None else None
        same: Optional[int] = None  # requests both sides cover (None: no such comparison)
        span: tuple = (None, None, None)  # their finishes' (start_ns, end_ns] and prompt tokens
        if window is not None:  # both sides over the same requests, since the first result seen
            engine, shadow, same = window.engine_hit_rate, window.shadow_hit_rate, window.requests
            span = (window.start_ns, window.end_ns, window.prompt_tokens)
        elif key in self.drained and self.drained[key].engine_hit_rate is not None:
            # results without the same-requests counters (an older agent): the latest taken with
            # no request in flight, when the shadow (at arrival) and the engine (at finish)
            # counted the same requests (the doctor's sharing.consistency makes the same choice)
            d = self.drained[key]
            same, shadow, engine = d.requests, d.token_hit_rate, d.engine_hit_rate
            span = (None, d.ts_ns, self.drained_prompt_tokens[key])
        gap = shadow - engine if shadow is not None and engine is not None and same is not None else None
        unexplained = None
        if same is not None and same < MIN_SHARING_REQUESTS:
            status, gap = too_few(same, MIN_SHARING_REQUESTS, "finished requests in the window"), None
        elif gap is not None:
            explained = self._explained_between(span[0], span[1]) if gap > 0 else 0
            unexplained = unexplained_gap(gap, explained, span[2])
            status = sharing_gap_status(unexplained)
        else:
            status = ""
        what_if = tuple(sorted((point(ev) for ev in self.shadow.values()), key=lambda p: (
            p.policy, p.block_size_tokens, p.capacity_blocks if p.capacity_blocks is not None else math.inf)))
        return SharingView(
            engine_hit_rate=engine, shadow_hit_rate=shadow,
            shadow_config=shadow_cfg, gap=gap,
            engine_history=engine_history,
            shadow_history=self.series[key].history(first, last, 30) if key else (None,) * (last - first + 1),
            what_if=what_if, finished_requests=self._finished_count(),
            reason="" if head else NO_SHADOW,
            window_start_ns=window.start_ns if window is not None else None,
            window_requests=window.requests if window is not None else None, gap_status=status,
            unexplained_gap=unexplained,
            engine_counters_since_ns=self.engine_counters_since_ns())


def point(ev: s.ShadowSharing) -> WhatIfPoint:
    return WhatIfPoint(ev.policy, ev.block_size_tokens, ev.capacity_blocks, ev.token_hit_rate,
                       ev.block_hit_rate, ev.requests)
