"""Capacity curves: the LRU token hit rate at 0.5x, 1x, 2x and 4x of the current pool, per
tier, folded from the stream (:mod:`kvdiag.simulation.curve_rows` and
:mod:`kvdiag.simulation.capacity_curve`: the rows and the stack
distances of ``kvdiag replay --curve``)."""

from __future__ import annotations

from typing import Callable, Optional

from kvdiag.events import schema as s
from kvdiag.simulation.capacity_curve import POOL_MULTIPLES, ReuseCurve, max_keys_for_pool
from kvdiag.simulation.curve_rows import RequestRows, StoreRows
from kvdiag.traces.trace import DEFAULT_BLOCK_TOKENS
from kvdiag.live.snapshot import CurvePoint, CurveRow, CurvesView

_TOP_TIERS = ("pool", "default", "GPU", "gpu")  # tiers whose basis is the engine's pool


def chain_handlers(handlers: dict, extra: dict) -> None:
    """Add ``extra``'s handlers to a LiveState handler table; where a type already has one,
    both run (the existing one first)."""
    for t, h in extra.items():
        prev = handlers.get(t)
        if prev is None:
            handlers[t] = h
        else:
            def both(ev, b, idx, _prev=prev, _h=h) -> None:
                _prev(ev, b, idx)
                _h(ev, b, idx)
            handlers[t] = both


class CurveFold:
    """``block_size()``: tokens per block of request rows (the pool's, else the header's);
    ``pool_blocks()``: the pool's block count (the multiples' basis; also sets the memory
    bound, :func:`~kvdiag.simulation.capacity_curve.max_keys_for_pool`, when a curve starts)."""

    def __init__(self, block_size: Callable[[], Optional[int]],
                 pool_blocks: Callable[[], Optional[int]], hash_algorithm: str = "fast") -> None:
        self._block_size = block_size
        self._pool_blocks = pool_blocks
        self.hash_algorithm = hash_algorithm
        self.requests: Optional[RequestRows] = None
        self.tiers: dict[str, StoreRows] = {}
        self.handlers = {s.RequestArrived: self.on_arrived, s.BlockStored: self.on_stored,
                         s.RequestFinished: self.on_finished, s.PrefixCacheStored: self.on_kv_stored,
                         s.PrefixCacheRemoved: self.on_kv_removed,
                         s.PrefixCacheCleared: self.on_kv_cleared}

    def _curve(self, block_size: Optional[int]) -> ReuseCurve:
        return ReuseCurve(block_size or DEFAULT_BLOCK_TOKENS, max_keys_for_pool(self._pool_blocks()))

    def on_arrived(self, ev: s.RequestArrived, b, idx: int) -> None:
        if self.requests is None:
            if ev.token_ids is None and ev.chunk_hashes is None:
                return
            self.requests = RequestRows(self._curve(self._block_size()), self.hash_algorithm)
        self.requests.arrived(ev)

    def on_stored(self, ev: s.BlockStored, b, idx: int) -> None:
        if self.requests is not None:
            self.requests.stored(ev)

    def on_finished(self, ev: s.RequestFinished, b, idx: int) -> None:
        if self.requests is not None:
            self.requests.finished(ev)

    def on_kv_stored(self, ev: s.PrefixCacheStored, b, idx: int) -> None:
        tier = ev.medium or "default"
        rows = self.tiers.get(tier)
        if rows is None:
            rows = self.tiers[tier] = StoreRows(self._curve(ev.block_size_tokens), self.hash_algorithm)
        rows.stored(ev)

    def on_kv_removed(self, ev: s.PrefixCacheRemoved, b, idx: int) -> None:
        rows = self.tiers.get(ev.medium or "default")
        if rows is not None:
            rows.removed(ev)

    def on_kv_cleared(self, ev: s.PrefixCacheCleared, b, idx: int) -> None:
        for rows in self.tiers.values():
            rows.cleared()

    def view(self) -> CurvesView:
        """One row per tier: hit rates at POOL_MULTIPLES x its basis capacity."""
        pool = self._pool_blocks()
        sources = [("pool", self.requests.curve, None)] if self.requests is not None else []
        sources += [(t, r.curve, r) for t, r in sorted(self.tiers.items())]
        rows = []
        for tier, curve, store in sources:
            if (tier in _TOP_TIERS or store is None) and pool:
                basis, name = pool, "pool"
            elif store is not None and store.peak_resident_blocks:
                basis, name = store.peak_resident_blocks, "peak resident"
            else:
                basis, name = None, ""
            caps = [round(m * basis) for m in POOL_MULTIPLES] if basis else []
            rates = curve.token_hit_rates(caps) if caps else []
            rows.append(CurveRow(
                tier=tier, block_size_tokens=curve.block_size_tokens, basis_blocks=basis, basis=name,
                points=tuple(CurvePoint(m, c, r) for m, c, r in zip(POOL_MULTIPLES, caps, rates)),
                requests=curve.requests, distinct_keys=curve.distinct_keys, max_keys=curve.max_keys))
        if not rows:
            return CurvesView()
        return CurvesView(rows=tuple(rows), reason="")
