"""What the rules need from the block and KV-event streams, folded as the events pass, so
that no raw block event is kept: ``kvdiag top`` judges a day-long stream in flat memory, and
the doctor computes the same figures by the same fold over a recorded log.

:class:`BlockFacts` reads a :class:`kvdiag.pool.blockledger.BlockLedger` (the one owner of block
state, which folds every block event, arrival and finish; the caller applies each event to it
first, and the ledger calls back before the first such event after a pending row) and writes
one row per ``EngineStep`` and per ``KVPoolSample`` (frame :data:`FACTS_TAG`):

- ``blocks_held``: the ledger's ``holdings`` after every block event with ``ts_ns`` at or
  before the row's (for a step, the start of its forward pass). A live stream delivers a step
  after block events of its own forward pass; the holdings at the step's start are looked up
  in a ring of the latest :data:`RING_BLOCK_EVENTS` block events (``late_rows`` counts the
  rows older than the ring, which take its oldest entry).
  NaN until the ledger has seen a block event (an engine that reports none).
- ``active_allocated`` / ``active_hits``: ``BlockAllocated`` / ``PrefixHit`` events so far of
  the requests whose arrival was seen and that have not finished: the blocks the forecast
  (:func:`kvdiag.diagnosis.pressure_rules.forecast_frame`) counts as already held by active requests.
- ``evictions``: ``BlockEvicted`` events since the previous row (the evictions after the last
  row are in a ``tail`` row at the last block event, in :meth:`BlockFacts.frames` only).

And one row per batch of the engine's KV-event stream (frame :data:`KV_BATCHES_TAG`: the
``seq`` and ``ts_ns`` of consecutive ``prefix_cache_*`` events, with their count), from which
:func:`kvdiag.diagnosis.kv_stream_rules.kv_event_gaps` counts batches received; and the stream's health
(frame :data:`KV_HEALTH_TAG`, one row: :class:`kvdiag.pool.kv_stream_health.StreamHealthCounts`,
the pool size from ``KVPoolInfo`` or the engine's ``EngineMetrics.num_blocks``) for
:func:`kvdiag.diagnosis.kv_stream_rules.kv_stream_health`.
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import Iterable, NamedTuple, Optional

import numpy as np
import pandas as pd

from kvdiag.events import schema as s
from kvdiag.pool.blockledger import NEVER_NS, BlockLedger
from kvdiag.pool.kv_stream_health import StreamHealth, StreamHealthCounts

FACTS_TAG = "block_facts"
KV_BATCHES_TAG = "kv_event_batches"
KV_HEALTH_TAG = "kv_stream_health"
KV_HEALTH_COLUMNS = list(StreamHealthCounts.__dataclass_fields__)
"""Columns of the health row (one per node with KV events; ``ts_ns``: its ``last_ts_ns``)."""
FACTS_COLUMNS = ["ts_ns", "kind", "blocks_held", "active_allocated", "active_hits", "evictions"]
KV_BATCHES_COLUMNS = ["ts_ns", "seq", "events"]
RING_BLOCK_EVENTS = 65_536
"""Block events remembered for the lookup of a step's holdings at its start (at 50,000 block
events/s, 1.3 s: longer than an engine step takes to be reported)."""

_NO_BLOCKS = float("nan")
_KINDS = ("step", "pool", "tail")
_DTYPES = {"b": "int8", "i": "int32", "q": "int64", "d": "float64"}
_STEP, _POOL, _TAIL = range(3)

BLOCK_EVENTS = (s.BlockAllocated, s.PrefixHit, s.BlockDeduplicated, s.BlockReleased, s.BlockEvicted)
KV_EVENTS = (s.PrefixCacheStored, s.PrefixCacheRemoved, s.PrefixCacheCleared)


class BlockFacts:
    """Folds the stream into the rows of the module docstring; ``ledger`` is read, never
    written (the caller applies every event to it before calling the matching method); it
    keeps the holdings ring and the open requests' counts these rows read (the ledger's
    ``track_holdings``, ``open_allocated``, ``open_hits``, ``evictions``). ``keep_rows=False``:
    no row is kept (a state no rule reads), :meth:`step` still returns a step's holdings."""

    def __init__(self, ledger: BlockLedger, ring_block_events: int = RING_BLOCK_EVENTS,
                 keep_rows: bool = True) -> None:
        self.ledger = ledger
        self.keep_rows = keep_rows  # False: a step's holdings returned, no row kept (the exporter)
        ledger.track_holdings(ring_block_events)
        ledger.on_watch = self._settle_now
        self._ring_ts: deque[int] = ledger.ring_ts
        self._ring_held: deque[int] = ledger.ring_held
        self._evictions_mark = 0  # the ledger's evictions at the last row
        self.late_rows = 0
        # rows no later block, arrival or finish has followed yet: events of their instant may
        # still come (settled by the first event after them, which the ledger watches for, or
        # provisionally by copy_rows)
        self._pending: deque[int] = deque()
        self._pending_ts: Optional[int] = None
        # the rows, column by column in typed arrays (29 bytes a row); kind: index in _KINDS
        self.rows: dict[str, array] = {c: array(code) for c, code in zip(FACTS_COLUMNS, "qbdiii")}
        self.batches: dict[str, array] = {c: array("q") for c in KV_BATCHES_COLUMNS}
        self._batch: Optional[tuple[int, int]] = None
        self.health = StreamHealth()
        self._engine_pool: Optional[int] = None

    @property
    def active_allocated(self) -> int:
        """``BlockAllocated`` events so far of the requests arrived and not finished (the
        ledger's open requests)."""
        return self.ledger.open_allocated

    @property
    def active_hits(self) -> int:
        return self.ledger.open_hits

    @property
    def evictions(self) -> int:
        """``BlockEvicted`` events since the last row."""
        return self.ledger.evictions - self._evictions_mark

    # ---------------------------------------------------------------- per event
    # block events, arrivals and finishes are the ledger's (it calls _settle_now before the
    # first of them after a pending row); steps and pool samples write rows here

    def _settle_now(self, ts_ns: int) -> None:
        """Before the ledger folds a block event, arrival or finish at ``ts_ns``."""
        self._settle(ts_ns, self._held_now())

    def _settle(self, ts_ns: int, held: float) -> None:
        """The pending rows before ``ts_ns`` take the state before the event at ``ts_ns``."""
        rows, pend = self.rows, self._pending
        row_ts = rows["ts_ns"]
        ledger = self.ledger
        while pend and row_ts[pend[0]] < ts_ns:
            i = pend.popleft()
            rows["blocks_held"][i] = held
            rows["active_allocated"][i] = ledger.open_allocated
            rows["active_hits"][i] = ledger.open_hits
            rows["evictions"][i] += ledger.evictions - self._evictions_mark
            self._evictions_mark = ledger.evictions
        self._set_pending_ts(row_ts[pend[0]] if pend else None)

    def _set_pending_ts(self, ts_ns: Optional[int]) -> None:
        self._pending_ts = ts_ns
        self.ledger.watch_ts = NEVER_NS if ts_ns is None else ts_ns

    def step(self, ev: s.EngineStep) -> float:
        """Writes the step's row; returns its ``blocks_held`` (NaN before any block event)."""
        return self._row(ev.ts_ns, _STEP)

    def pool_sample(self, ev: s.KVPoolSample) -> None:
        self._row(ev.ts_ns, _POOL)

    def kv_event(self, ev) -> None:
        """A ``prefix_cache_*`` event: counted in its batch's row and folded into
        :attr:`health` (a duplicate batch's events count in neither)."""
        pool = self.ledger.num_blocks or self._engine_pool
        if pool and pool != self.health.counts_pool:
            self.health.set_pool_blocks(pool)
        if (ev.seq, ev.ts_ns) != self._batch and not self.health.batch(ev.seq, ev.ts_ns):
            return
        self.health.event(ev)
        key = (ev.seq, ev.ts_ns)
        if key != self._batch:
            self._batch = key
            if not self.keep_rows:
                return
            for col, v in zip(KV_BATCHES_COLUMNS, (ev.ts_ns, ev.seq, 0)):
                self.batches[col].append(v)
        if self.keep_rows:
            self.batches["events"][-1] += 1

    def engine_metrics(self, ev: s.EngineMetrics) -> None:
        """The engine's own pool size (``num_blocks`` of its cache config): the KV-event
        stream's balance check uses it where no ``KVPoolInfo`` gives one."""
        if ev.num_blocks:
            self._engine_pool = ev.num_blocks

    def _row(self, ts_ns: int, kind: int) -> float:
        rows = self.rows
        ring = self._ring_ts
        if ring and ring[-1] > ts_ns:  # reported after later block events: look it up
            held = self.held_at(ts_ns)
            if not self.keep_rows:
                return held
        else:
            held = self._held_now()
            if not self.keep_rows:
                return held
            self._pending.append(len(rows["ts_ns"]))
            if self._pending_ts is None:
                self._set_pending_ts(ts_ns)
        for col, v in zip(FACTS_COLUMNS, (ts_ns, kind, held, self.active_allocated,
                                          self.active_hits, self.evictions)):
            rows[col].append(v)
        self._evictions_mark = self.ledger.evictions
        return held

    def _held_now(self) -> float:
        return self.ledger.holdings if self._ring_ts else _NO_BLOCKS

    def held_at(self, ts_ns: int) -> float:
        """The ledger's holdings after the last remembered block event at or before ``ts_ns``
        (a walk back from the newest: a step arrives shortly after it starts)."""
        ts, held = self._ring_ts, self._ring_held
        if not ts or ts[-1] <= ts_ns:
            return self._held_now()
        for i in range(len(ts) - 1, -1, -1):
            if ts[i] <= ts_ns:
                return held[i]
        if len(ts) == ts.maxlen:  # older than the ring: its oldest entry, counted
            self.late_rows += 1
            return held[0]
        return _NO_BLOCKS  # before the first block event

    # ---------------------------------------------------------------- frames

    def copy_rows(self) -> tuple[dict[str, array], dict[str, array]]:
        """The rows so far (copies, cheap: typed arrays), with a ``tail`` row for the evictions
        after the last row; for :func:`frames` outside the caller's lock."""
        rows = {c: array(v.typecode, v) for c, v in self.rows.items()}
        for i in self._pending:  # as if settled now
            rows["blocks_held"][i] = self._held_now()
            rows["active_allocated"][i] = self.active_allocated
            rows["active_hits"][i] = self.active_hits
        if self.evictions and self._ring_ts:
            for col, v in zip(FACTS_COLUMNS, (self._ring_ts[-1], _TAIL, self.ledger.holdings,
                                              self.active_allocated, self.active_hits, self.evictions)):
                rows[col].append(v)
        return rows, {c: array(v.typecode, v) for c, v in self.batches.items()}

    def frames(self, node: str) -> dict[str, pd.DataFrame]:
        """The rows so far as frames (with ``node``), keyed by their tags."""
        return frames(*self.copy_rows(), node, health=self.health.counts)


def frames(rows: dict[str, array], batches: dict[str, array], node: str,
           health: Optional[StreamHealthCounts] = None) -> dict[str, pd.DataFrame]:
    """Frames of rows copied by :meth:`BlockFacts.copy_rows` (and the stream health, when
    given and the stream had events)."""
    facts = pd.DataFrame({c: (np.frombuffer(v, dtype=_DTYPES[v.typecode]) if len(v) else
                              np.array([], dtype=_DTYPES[v.typecode])).astype(
                                  "float64" if v.typecode == "d" else "int64")
                          for c, v in rows.items()}, columns=FACTS_COLUMNS)
    facts["kind"] = np.array(_KINDS, dtype=object)[facts["kind"].to_numpy(dtype="int64")] if len(facts) else []
    out = pd.DataFrame({c: np.frombuffer(v, dtype="int64") if len(v) else np.array([], dtype="int64")
                        for c, v in batches.items()}, columns=KV_BATCHES_COLUMNS)
    facts["node"], out["node"] = node, node
    rows_h = [health.as_dict()] if health is not None and health.events else []
    h = pd.DataFrame(rows_h, columns=KV_HEALTH_COLUMNS)
    h["ts_ns"], h["node"] = h["last_ts_ns"].astype("int64"), node  # windows cut rows by ts_ns
    return {FACTS_TAG: facts, KV_BATCHES_TAG: out, KV_HEALTH_TAG: h}


_RANK = {cls: 0 for cls in (s.RequestArrived, s.KVPoolInfo, *BLOCK_EVENTS, s.RequestFinished)}
_RANK.update({s.EngineStep: 1, s.KVPoolSample: 1})


class _EnginePool(NamedTuple):
    ts_ns: int
    num_blocks: int


def fold(events: Iterable[s.Event], engine_pool: Iterable[tuple[int, int]] = ()) -> BlockFacts:
    """A fresh ledger and :class:`BlockFacts` over ``events`` of one node, taken in time order
    with a step or pool sample after the block and request events of its instant (the offline
    path: the doctor's); ``engine_pool``: ``(ts_ns, num_blocks)`` of the node's ``EngineMetrics``
    (what :meth:`BlockFacts.engine_metrics` reads live), in the same time order."""
    events = [*events, *(_EnginePool(int(t), int(n)) for t, n in engine_pool)]
    ordered = sorted(events, key=lambda ev: (ev.ts_ns, _RANK.get(type(ev), 0), getattr(ev, "seq", 0)))
    ledger = BlockLedger()
    facts = BlockFacts(ledger)
    for ev in ordered:
        t = type(ev)
        if t in KV_EVENTS:
            facts.kv_event(ev)
            continue
        if t is _EnginePool:
            facts.engine_metrics(ev)
            continue
        ledger.apply(ev)
        handler = _FOLD.get(t)
        if handler is not None:
            handler(facts, ev)
    return facts


_FOLD = {s.EngineStep: BlockFacts.step, s.KVPoolSample: BlockFacts.pool_sample}
