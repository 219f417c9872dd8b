"""The doctor's rules (``kvdiag.diagnosis.doctor.run_rules``) live, for the alerts of ``kvdiag
top``: the first run as soon as events arrive, then every ``period_s``, and once more when a
replayed log ends, so that top's final verdict is the doctor's on that log. Its cost is
measured on each run and the period grows so that it stays under ``max_share`` of one core.
A failing run becomes a finding, never an exception. Pure: no UI library is imported here.

No raw block event is kept: the block and KV-event streams (98% of a busy GPU engine's
events) are folded as they pass into the block facts (:mod:`kvdiag.pool.blockfacts`, kept by
``LiveState`` over its ledger), which the rules read as the doctor reads them from a log. The
latencies ``p99.regression`` compares (engine steps, TTFT, TPOT) are folded into
per-time-bucket sketches (:mod:`kvdiag.diagnosis.latency_facts`, bounded: a fixed number of buckets), the
same fold the doctor runs over a log. The other events (requests, steps, samples: what the
other rules still judge one by one) are kept column by column in typed arrays, 4 or 8 bytes a
number, without the fields no rule reads (:data:`NOT_JUDGED`): about 1 byte per event of a
vLLM-shaped stream (``benchmarks/bench_top.py --rss --with-rules``).
"""

from __future__ import annotations

import ctypes
import sys
import time
import typing
from array import array
from dataclasses import dataclass
from typing import Callable, Optional

import msgspec
import numpy as np

from kvdiag.pool import blockfacts
from kvdiag.diagnosis import latency_facts as latencyfacts
from kvdiag.events import schema as s
from kvdiag.diagnosis import doctor, frames as logs
from kvdiag.diagnosis.findings import Finding

SKIPPED = frozenset((*blockfacts.BLOCK_EVENTS, *blockfacts.KV_EVENTS))
"""Event types the rules read only through the block facts."""
_TIMED = frozenset(latencyfacts.INPUTS)
NOT_JUDGED = {s.RequestArrived: frozenset(("token_ids", "chunk_hashes", "conversation_id")),
              s.EngineStep: frozenset(("step_id", "phase"))}
"""Fields no rule reads, not kept (their columns hold None): a prompt's content (a few KB a
request) is judged by the shadow, which runs in the agent, not by the rules; a step's id and
phase and a request's conversation are shown by top's panels, never judged (kept as Python
objects they cost ~40-90 bytes a row)."""


def _column_kind(tp) -> str:
    """How a schema field is stored: int, opt_int, float, bool, str or obj (a list)."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    tp = getattr(tp, "__supertype__", tp)  # NewType
    args = typing.get_args(tp)
    if args and type(None) in args and len(args) == 2:  # Optional[X]
        inner = _column_kind(next(a for a in args if a is not type(None)))
        return {"int": "opt_int", "float": "opt_float"}.get(inner, "obj")
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(tp, "obj")


_DTYPES = {"i": "int32", "q": "int64", "d": "float64", "b": "int8"}


class _Strings:
    """A column of strings as UTF-8 bytes end to end, with each one's end offset: no Python
    object per row (a request id kept as a str costs ~60 bytes and pins the allocator's
    arenas between rule runs). ``append`` raises TypeError for a non-str (the table then
    keeps that column as a list)."""

    __slots__ = ("data", "ends")

    def __init__(self) -> None:
        self.data = bytearray()
        self.ends = array("q")

    def append(self, value: str) -> None:
        if type(value) is not str:
            raise TypeError("not a str")
        self.data += value.encode()
        self.ends.append(len(self.data))

    def __len__(self) -> int:
        return len(self.ends)

    def tolist(self, shared: Optional[dict] = None) -> list[str]:
        """The strings; ``shared``: one str object per distinct value across the columns
        decoded with the same dict (a request id appears in four tables)."""
        data, out, start = bytes(self.data), [], 0
        shared = {} if shared is None else shared
        for end in self.ends:
            value = data[start:end].decode()
            out.append(shared.setdefault(value, value))
            start = end
        return out

    def copy(self) -> "_Strings":
        out = _Strings()
        out.data, out.ends = bytearray(self.data), array("q", self.ends)
        return out


class _Table:
    """One event type's rows, column by column: numbers in typed arrays (ints 32-bit until a
    value needs 64; ``opt_*``: values and a presence mask), strings as bytes (:class:`_Strings`);
    a value that does not fit its column's type (a malformed event) turns that column into a
    list."""

    def __init__(self, cls: type) -> None:
        self.fields = s.fields_of(cls)
        types = {f.name: f.type for f in msgspec.structs.fields(cls)}
        dropped = NOT_JUDGED.get(cls, ())
        self.kinds = ["none" if f in dropped else _column_kind(types[f]) for f in self.fields]
        self.rows = 0
        self.cols: list = []
        self.masks: list = []
        for kind in self.kinds:
            self.cols.append(None if kind == "none" else array("i") if kind in ("int", "opt_int")
                             else array("d") if kind in ("float", "opt_float") else array("b") if kind == "bool"
                             else _Strings() if kind == "str" else [])
            self.masks.append(array("b") if kind.startswith("opt_") else None)

    def append(self, ev) -> None:
        self.rows += 1
        for i, v in enumerate(msgspec.structs.astuple(ev)):
            col = self.cols[i]
            if col is None:  # a field not kept
                continue
            mask = self.masks[i]
            if mask is not None and type(col) is array:
                mask.append(v is not None)
                v = 0 if v is None else v
            try:
                col.append(v)
            except OverflowError:  # int32 until a value needs 64 bits
                if type(col) is array and col.typecode == "i":
                    self.cols[i] = col = array("q", col)
                    try:
                        col.append(v)
                        continue
                    except (TypeError, OverflowError):
                        pass
                self._to_list(i).append(v)
            except TypeError:
                self._to_list(i).append(v)

    def _to_list(self, i: int) -> list:
        col, mask = self.cols[i], self.masks[i]
        values = col.tolist()
        if mask is not None:  # (zip stops before the failing value's mask entry)
            values = [v if m else None for v, m in zip(values, mask)]
        self.cols[i] = values
        self.masks[i] = None
        self.kinds[i] = "obj"
        return values

    def copy(self) -> "_Table":
        out = _Table.__new__(_Table)
        out.fields, out.kinds, out.rows = self.fields, list(self.kinds), self.rows
        out.cols = [array(c.typecode, c) if type(c) is array else None if c is None
                    else c.copy() if type(c) is _Strings else list(c) for c in self.cols]
        out.masks = [None if m is None else array("b", m) for m in self.masks]
        return out

    def frame(self, node: str, shared: Optional[dict] = None):
        """The rows as the doctor's frame (the dtypes pandas gives the same rows read from a
        log: int64 without None, float64 with NaN for a None among numbers, object if all None);
        ``shared``: see :meth:`_Strings.tolist`."""
        import pandas as pd

        data = {}
        for name, kind, col, mask in zip(self.fields, self.kinds, self.cols, self.masks):
            if col is None:
                data[name] = np.full(self.rows, None, dtype=object)
                continue
            if type(col) is _Strings:
                data[name] = np.array(col.tolist(shared), dtype=object)
                continue
            if type(col) is not array:
                data[name] = pd.Series(col, dtype=None if col else "object")
                continue
            dtype = _DTYPES[col.typecode]
            values = (np.frombuffer(col, dtype=dtype) if len(col) else np.array([], dtype=dtype)).astype(
                "int64" if col.typecode in "iq" else dtype)
            if kind == "bool":
                values = values.astype(bool)
            if mask is not None:
                present = np.frombuffer(mask, dtype="int8").astype(bool) if len(mask) else np.zeros(0, bool)
                if len(present) and not present.any():
                    values = np.full(len(present), None, dtype=object)
                elif not present.all():
                    values = np.where(present, values.astype("float64"), np.nan)
            data[name] = values
        df = pd.DataFrame(data, columns=list(self.fields))
        df["node"] = node
        return df


def release_freed_memory() -> None:
    """Give back to the OS the memory a rules run allocated and freed (its frames): pyarrow's
    pool (pandas' strings) and glibc's heap keep freed pages for reuse otherwise, and a run
    over a long session's inputs would leave top's RSS at the run's peak (measured: ~+40 MiB
    at 20 M events, ``benchmarks/bench_top.py --rss --with-rules``). A no-op where neither
    is present."""
    pa = sys.modules.get("pyarrow")
    if pa is not None:
        pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL(None).malloc_trim(0)  # glibc only
    except (OSError, AttributeError):
        pass


@dataclass
class RuleInputs:
    """What one run of the rules reads: the kept events' tables and the block facts' rows
    (copies taken under the caller's lock)."""

    tables: dict[str, _Table]
    facts_rows: dict
    facts_batches: dict
    events: int
    kv_health: Optional[object] = None  # the KV-event stream's StreamHealthCounts (kvdiag.pool.kv_stream_health)
    latency: Optional[dict] = None  # the latency series (kvdiag.diagnosis.latency_facts), by name


class LiveRules:
    """Runs :func:`kvdiag.diagnosis.doctor.run_rules` over every event seen so far, so that at
    the end of a log top's alerts are the doctor's findings on that log."""

    def __init__(self, period_s: float = 15.0, max_share: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tables: dict[type, _Table] = {}
        self.period_s = period_s
        self.max_share = max_share
        self.last_run_s: Optional[float] = None  # duration of the last run
        self.findings: tuple[Finding, ...] = ()
        self._clock = clock
        self._next = clock()  # the first verdict as soon as there are events
        self._seen = 0
        self.events = 0
        self.latency = latencyfacts.LatencyFacts()  # what the P99 rules compare, as sketches

    def record(self, events: list[s.Event]) -> None:
        """Keep the events the rules judge one by one (the caller folds every event, block
        events included, into its ``LiveState`` and so its block facts)."""
        tables = self.tables
        timed = []  # what the latency fold reads (2% of a vLLM-shaped stream)
        skipped = SKIPPED
        for ev in [ev for ev in events if type(ev) not in skipped]:  # (97% are block events)
            t = type(ev)
            if t in _TIMED:
                timed.append(ev)
            table = tables.get(t)
            if table is None:
                table = tables[t] = _Table(t)
            table.append(ev)
        self.latency.record(timed)
        self._seen += len(events)
        self.events += len(events)

    def due(self, finished: bool = False) -> bool:
        """New events and the period is over, or the source has ended (the final verdict)."""
        return self._seen > 0 and (finished or self._clock() >= self._next)

    def take(self, facts: blockfacts.BlockFacts) -> RuleInputs:
        """Copies of what the rules read (under the caller's lock; run outside it)."""
        self._seen = 0
        rows, batches = facts.copy_rows()
        return RuleInputs({s.event_tag(cls): t.copy() for cls, t in self.tables.items()}, rows, batches,
                          self.events, facts.health.counts, self.latency.copy_series())

    def run(self, header: Optional[s.LogHeader], inputs: RuleInputs) -> tuple[Finding, ...]:
        """Run every rule over ``inputs``; returns (and keeps) the findings."""
        start = self._clock()
        try:
            findings, _ = doctor.run_rules(self._logs(header, inputs))
            self.findings = tuple(findings)
        except Exception as exc:  # a rule that breaks on partial live data must not stop top
            self.findings = (Finding("doctor.error", "n/a", "doctor rules failed on live data",
                                     f"{type(exc).__name__}: {exc}"),)
        release_freed_memory()
        self.last_run_s = self._clock() - start
        self.period_s = max(self.period_s, self.last_run_s / self.max_share)
        self._next = self._clock() + self.period_s
        return self.findings

    @staticmethod
    def _logs(header: Optional[s.LogHeader], inputs: RuleInputs) -> logs.Logs:
        node = (header.node or header.host) if header else ""
        node = node or "live"
        shared: dict = {}
        frames = {tag: table.frame(node, shared) for tag, table in inputs.tables.items()}
        derived = blockfacts.frames(inputs.facts_rows, inputs.facts_batches, node, health=inputs.kv_health)
        hdr = header or s.LogHeader(schema_version=s.SCHEMA_VERSION)
        return logs.Logs(headers={node: hdr}, frames=frames, derived=derived,
                         sketches=dict(inputs.latency or {}))
