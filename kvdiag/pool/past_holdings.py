"""The ledger's holdings at an instant already passed, without a write per block event.

A live stream delivers an engine step after block events of its own forward pass, and the
block facts (:mod:`kvdiag.pool.blockfacts`) want the holdings at the step's start: after the
last block event at or before it. Instead of remembering ``(ts_ns, holdings)`` after every
block event (two writes on the ledger's hottest path, a quarter of its cost), this keeps the
events the ledger folded and, for each one it did not fold on its fast path, the holdings
just before it (a *mark*). Every other event moved the holdings by a known step: a
``BlockAllocated`` +1, a ``BlockReleased`` -1, a ``BlockEvicted`` 0 (the fast paths of
:meth:`kvdiag.pool.blockledger.BlockLedger.apply_all`). A lookup walks back from the newest
folded event, undoing each, to the first block event at or before the instant: a step looks
back over its own forward pass, a few dozen events.

Bounded: the latest ``capacity`` block events are looked through (older instants take the
holdings after the oldest of them, and say so); the batches that hold them are kept, the
others let go, and an event no lookup needs (one that is not a block event) is not kept.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from kvdiag.events.schema import BlockAllocated, BlockDeduplicated, BlockEvicted, BlockReleased, PrefixHit

BLOCK_EVENTS = (BlockAllocated, PrefixHit, BlockDeduplicated, BlockReleased, BlockEvicted)
"""What a lookup looks for: the holdings after the last of these at or before an instant."""
_STEP = {BlockAllocated: 1, BlockReleased: -1, BlockEvicted: 0}
"""What an unmarked event (folded on the ledger's fast path) did to the holdings."""
_SKIPPED = -1
"""The mark of an event the ledger could not fold (holdings are never negative)."""
_BATCH_EVENTS = 8192
"""Events kept per batch: a short batch is extended by the next (a quiet live source hands
the ledger a few events at a time)."""


class _Batch:
    __slots__ = ("events", "marks", "block_events")

    def __init__(self) -> None:
        self.events: list = []  # what was folded, in order (None: an event no lookup needs)
        self.marks: dict[int, int] = {}  # position -> holdings just before that event
        self.block_events = 0  # block events folded from it (counted when the next one begins)


class PastHoldings:
    """Owned by the ledger (:meth:`kvdiag.pool.blockledger.BlockLedger.track_holdings`), which
    calls :meth:`begin` before each batch it folds, :meth:`mark` before each event it folds
    off the fast path and :meth:`end` after the batch; :meth:`at` and
    :meth:`newest_block_ts` read it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), 1)
        self._batches: deque[_Batch] = deque()
        self._kept_block_events = 0  # over the batches but the newest
        self._pos = -1  # the newest folded event's position in the newest batch
        self._block_events_at_begin = 0  # the ledger's count when the newest batch began

    # ---------------------------------------------------------------- written by the ledger

    def begin(self, events, block_events: int) -> tuple[list, int]:
        """A batch of events is about to be folded: returns (the list to fold, a copy of
        ``events`` that is kept; the position of its first event, for :meth:`mark`);
        ``block_events``: the ledger's count so far."""
        new = list(events)
        batches = self._batches
        if not batches or len(batches[-1].events) + len(new) > _BATCH_EVENTS:
            self._close_newest(block_events)
            batches.append(_Batch())
            self._block_events_at_begin = block_events
            self._pos = -1  # nothing of it folded yet
        batch = batches[-1]
        base = len(batch.events)
        batch.events.extend(new)
        return new, base

    def mark(self, pos: int, holdings_before: int, event_type: type) -> None:
        """The event at ``pos`` (``begin``'s position plus its index in the batch) is about to
        be folded off the fast path; the holdings just before it are ``holdings_before``."""
        batch = self._batches[-1]
        batch.marks[pos] = holdings_before
        if event_type not in _LOOKED_FOR:
            batch.events[pos] = None  # never looked for: let it go
        self._pos = pos

    def skip(self, pos: int) -> None:
        """The event at ``pos`` could not be folded (a bad event): lookups pass over it."""
        batch = self._batches[-1]
        batch.events[pos] = None
        batch.marks.setdefault(pos, _SKIPPED)  # marked: it raised part way, undone whole

    def end(self) -> None:
        """The batch begun last is folded whole."""
        self._pos = len(self._batches[-1].events) - 1

    def single(self, ev, holdings_before: int, block_events: int) -> None:
        """``ev`` is about to be folded by the per-event methods (off the fast path);
        ``holdings_before`` and ``block_events``: the ledger's counts before it."""
        _, pos = self.begin((ev,), block_events)
        self.mark(pos, holdings_before, type(ev))

    def _close_newest(self, block_events: int) -> None:
        """Count the newest batch among the kept ones, and let go of the oldest batches the
        lookups no longer reach."""
        if not self._batches:
            return
        newest = self._batches[-1]
        newest.block_events = block_events - self._block_events_at_begin
        self._kept_block_events += newest.block_events
        while len(self._batches) > 1 and self._kept_block_events - self._batches[0].block_events >= self.capacity:
            self._kept_block_events -= self._batches.popleft().block_events

    # ---------------------------------------------------------------- lookups

    def _walk(self):
        """(event or None, holdings-before mark or None) from the newest folded event back."""
        newest = self._batches[-1] if self._batches else None
        for batch in reversed(self._batches):
            events, marks = batch.events, batch.marks
            for i in range(self._pos if batch is newest else len(events) - 1, -1, -1):
                yield events[i], marks.get(i)

    def at(self, ts_ns: int, holdings_now: int) -> tuple[Optional[int], bool]:
        """(the holdings after the last block event at or before ``ts_ns``, late): late when
        that is older than the latest ``capacity`` block events (the holdings after the oldest
        of them); None when no block event is that old (before the first one). One loop, no
        call per event: a step looks back over its forward pass."""
        held = holdings_now
        seen = 0
        looked_for, step, capacity = _LOOKED_FOR, _STEP, self.capacity
        newest = self._batches[-1] if self._batches else None
        for batch in reversed(self._batches):
            events, marks = batch.events, batch.marks
            for i in range(self._pos if batch is newest else len(events) - 1, -1, -1):
                ev = events[i]
                if ev is not None:
                    t = type(ev)
                    if t in looked_for:
                        if ev.ts_ns <= ts_ns:
                            return held, False
                        seen += 1
                        if seen == capacity:
                            return held, True
                    before = marks.get(i)
                    held = held - step[t] if before is None else before
                else:
                    before = marks[i]
                    if before != _SKIPPED:
                        held = before
        return None, False

    def newest_block_ts(self) -> Optional[int]:
        """``ts_ns`` of the newest block event folded (None before the first)."""
        looked_for = _LOOKED_FOR
        newest = self._batches[-1] if self._batches else None
        for batch in reversed(self._batches):
            events = batch.events
            for i in range(self._pos if batch is newest else len(events) - 1, -1, -1):
                ev = events[i]
                if ev is not None and type(ev) in looked_for:
                    return ev.ts_ns
        return None

    def entries(self, holdings_now: int) -> list[tuple[int, int]]:
        """(ts_ns, holdings after it) of the latest ``capacity`` block events, oldest first
        (what a lookup reaches; for tests and inspection: O(events kept))."""
        out = []
        held = holdings_now
        for ev, before in self._walk():
            if ev is not None and type(ev) in _LOOKED_FOR:
                out.append((ev.ts_ns, held))
                if len(out) == self.capacity:
                    break
            if ev is not None:
                held = before if before is not None else held - _STEP[type(ev)]
            elif before != _SKIPPED:
                held = before
        return out[::-1]


_LOOKED_FOR = frozenset(BLOCK_EVENTS)
