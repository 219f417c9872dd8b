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
other rules still judge one by one) are kept column by column in immutable chunks, each as
narrow as its values allow (:mod:`kvdiag.live.columns`), without the fields no rule reads
(:data:`NOT_JUDGED`): about 0.3 byte per event of a vLLM-shaped stream, still growing with the
stream (``benchmarks/bench_top.py --rss --with-rules``).
"""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from kvdiag.pool import blockfacts
from kvdiag.diagnosis import latency_facts as latencyfacts
from kvdiag.events import schema as s
from kvdiag.diagnosis import doctor, frames as logs
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.miss_replay import EXPLAINED_TAG, explained_rows
from kvdiag.diagnosis.miss_tally import ExplainedLog
from kvdiag.live.columns import Table

SKIPPED = frozenset((*blockfacts.BLOCK_EVENTS, *blockfacts.KV_EVENTS,
                     *(cls for cls in s.EVENT_TYPES if s.event_tag(cls) in logs.UNUSED_BY_REPORTS)))
"""Event types the rules read only through the block facts, and those the doctor does not read
at all (:data:`kvdiag.diagnosis.frames.UNUSED_BY_REPORTS`: ``BlockStored``, one per block the
engine caches, which the miss causes fold as they pass)."""
_TIMED = frozenset(latencyfacts.INPUTS)
NOT_JUDGED = {s.RequestArrived: frozenset(("token_ids", "chunk_hashes", "conversation_id")),
              s.EngineStep: frozenset(("step_id", "phase"))}
"""Fields no rule reads, not kept (their columns hold None): a prompt's content (a few KB a
request) is judged by the shadow, which runs in the agent, not by the rules; a step's id and
phase and a request's conversation are shown by top's panels, never judged (kept as Python
objects they cost ~40-90 bytes a row)."""


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

    tables: dict[str, Table]
    facts_rows: dict
    facts_batches: dict
    events: int
    kv_health: Optional[object] = None  # the KV-event stream's StreamHealthCounts (kvdiag.pool.kv_stream_health)
    latency: Optional[dict] = None  # the latency series (kvdiag.diagnosis.latency_facts), by name
    explained: Optional[ExplainedLog] = None  # the miss causes' explained tokens (sharing.consistency)


class LiveRules:
    """Runs :func:`kvdiag.diagnosis.doctor.run_rules` over every event seen so far, so that at
    the end of a log top's alerts are the doctor's findings on that log."""

    def __init__(self, period_s: float = 15.0, max_share: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tables: dict[type, Table] = {}
        self.period_s = period_s
        self.max_share = max_share
        self.last_run_s: Optional[float] = None  # duration of the last run
        self.findings: tuple[Finding, ...] = ()
        self._clock = clock
        self._next = clock()  # the first verdict as soon as there are events
        self._seen = 0
        self.events = 0
        self.latency = latencyfacts.LatencyFacts()  # what the P99 rules compare, as sketches

    def record(self, events: list[s.Event], seen: Optional[int] = None) -> None:
        """Keep the events the rules judge one by one (the caller folds every event, block
        events included, into its ``LiveState`` and so its block facts). ``seen``: the events
        the caller folded when ``events`` holds only those its fold sorted out as not block
        events (``LiveState.feed_all(events, others)``: 3% of a busy engine's stream), so
        that no second pass reads every event; None: ``events`` is every event."""
        tables = self.tables
        timed = []  # what the latency fold reads (2% of a vLLM-shaped stream)
        skipped = SKIPPED
        for ev in events:
            t = type(ev)
            if t in skipped:
                continue
            if t in _TIMED:
                timed.append(ev)
            table = tables.get(t)
            if table is None:
                table = tables[t] = Table(t, NOT_JUDGED.get(t, frozenset()))
            table.append(ev)
        self.latency.record(timed)
        n = len(events) if seen is None else seen
        self._seen += n
        self.events += n

    def fold(self, state, events: list[s.Event]) -> None:
        """Fold ``events`` into ``state`` (a :class:`kvdiag.live.state.LiveState`) and keep what
        the rules judge, as top does: the rules read the events the state's fold sorted out as
        not block events (``feed_all(events, others)``), with no second pass over every event."""
        others: list = []
        state.feed_all(events, others)
        self.record(others, len(events))

    def due(self, finished: bool = False) -> bool:
        """New events and the period is over, or the source has ended (the final verdict)."""
        return self._seen > 0 and (finished or self._clock() >= self._next)

    def take(self, state) -> RuleInputs:
        """Copies of what the rules read (under the caller's lock; run outside it): the kept
        events' tables and, from ``state`` (a :class:`kvdiag.live.state.LiveState`), its block
        facts and its miss-cause fold's explained tokens."""
        self._seen = 0
        facts = state.facts
        rows, batches = facts.copy_rows()
        return RuleInputs({s.event_tag(cls): t.copy() for cls, t in self.tables.items()}, rows, batches,
                          self.events, facts.health.counts, self.latency.copy_series(),
                          state.misses.explained.copy())

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
        if inputs.explained is not None:
            ex = inputs.explained
            derived[EXPLAINED_TAG] = explained_rows(zip(ex.ts_ns, [node] * len(ex.ts_ns), ex.tokens))
        hdr = header or s.LogHeader(schema_version=s.SCHEMA_VERSION)
        return logs.Logs(headers={node: hdr}, frames=frames, derived=derived,
                         sketches=dict(inputs.latency or {}))
