"""The latency samples the P99 rules compare, folded as the events pass into per-time-bucket
sketches (:class:`kvdiag.diagnosis.sketch.SketchSeries`), so that no step or request row is
needed to judge them: ``kvdiag top`` (:class:`kvdiag.live.rules.LiveRules`) folds the stream,
the doctor folds a recorded log by the same :class:`LatencyFacts` (:func:`series`), and a
series is a function of its samples alone, so both hold the same state.

Series (values in ns, each at the time it was measured), as :mod:`kvdiag.diagnosis.latency`
defines them:

- ``step``: ``EngineStep.duration_ns`` at the step's ``ts_ns``, after the node's warm-up: the
  steps at or before its first request that finished normally are left out. Those carry one-time costs (the first shapes compiled, weights paged in) and
  in a log of a few hundred steps, whose P99 is one of its largest values, two of them set the
  P99 of every window they fall in (a 2.5x slowdown later in the log read as a drop). Until the
  first finish the steps are held aside; a copy of the series includes them, so that a node
  that has finished nothing yet (or an engine that reports steps but no requests) is judged
  on all its steps, and past :data:`WARMUP_MAX_STEPS` held steps none is warm-up.
- ``ttft``: time to first token of a request that finished normally (``RequestFinished.status
  == "finished"``): the finish's ``ttft_ns``, else its first ``RequestFirstToken``'s; at the
  first token's time (the first-token event's ``ts_ns``, else arrival + TTFT).
- ``per_token``: ``(e2e - ttft) / (output_tokens - 1)`` of such a request with at least 2
  output tokens (``e2e``: the finish's ``e2e_ns``, else finish - first arrival); at its finish.

A request's arrival and first token are held until it finishes (state bounded by the requests
in flight). A request finished twice counts twice (the frame-based
:func:`kvdiag.diagnosis.latency.request_latency` kept the last finish only).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

from kvdiag.events import schema as s
from kvdiag.diagnosis.sketch import SketchSeries

SERIES = ("step", "ttft", "per_token")
FLUSH_SAMPLES = 8_192
"""Samples buffered before they go into the sketches (a numpy call per bucket touched: batching
keeps the fold's cost per event small); :meth:`LatencyFacts.copy_series` flushes first."""
WARMUP_MAX_STEPS = 65_536
"""Steps held before a node's first finished request; at this many, they are no warm-up but
the node's serving (an engine that reports no requests), and join the series."""
INPUTS = (s.EngineStep, s.RequestArrived, s.RequestFirstToken, s.RequestFinished)
_RANK = {s.RequestArrived: 0, s.RequestFirstToken: 1, s.EngineStep: 1, s.RequestFinished: 2}


class LatencyFacts:
    """The fold of the module docstring: :attr:`series` by name."""

    def __init__(self) -> None:
        self.series: dict[str, SketchSeries] = {name: SketchSeries() for name in SERIES}
        # request id -> [first arrival ts_ns, first first-token ts_ns, its ttft_ns]
        self._open: dict[str, list] = {}
        self._steps_ts: list[int] = []
        self._steps_v: list[float] = []
        # the first normal finish (None: not yet; -1: serving without finishes, no warm-up)
        self.serving_since_ns: Optional[int] = None
        self._held_ts: list[int] = []  # steps before it: warm-up unless no finish comes
        self._held_v: list[float] = []
        self._req: dict[str, tuple[list[int], list[float]]] = {"ttft": ([], []), "per_token": ([], [])}

    def record(self, events: Iterable[s.Event]) -> None:
        """Fold ``events`` (others than :data:`INPUTS` are ignored)."""
        st_ts, st_v = self._steps_ts, self._steps_v
        for ev in events:
            t = type(ev)
            if t is s.EngineStep:
                since = self.serving_since_ns
                if since is None:
                    self._hold(ev.ts_ns, ev.duration_ns)
                elif ev.ts_ns > since:  # (else: the warm-up, left out)
                    st_ts.append(ev.ts_ns)
                    st_v.append(ev.duration_ns)
            elif t is s.RequestArrived:
                self._open.setdefault(ev.request_id, [ev.ts_ns, None, None])
            elif t is s.RequestFirstToken:
                rec = self._open.setdefault(ev.request_id, [None, None, None])
                if rec[1] is None:
                    rec[1], rec[2] = ev.ts_ns, _opt(ev.ttft_ns)
            elif t is s.RequestFinished:
                self._finished(ev)
        if len(st_ts) + len(self._req["ttft"][0]) + len(self._req["per_token"][0]) >= FLUSH_SAMPLES:
            self.flush()

    def _hold(self, ts_ns: int, duration_ns: float) -> None:
        """A step before the node's first finished request (module docstring)."""
        self._held_ts.append(ts_ns)
        self._held_v.append(duration_ns)
        if len(self._held_ts) >= WARMUP_MAX_STEPS:  # serving without finishing requests
            self._start_serving(-1)

    def _start_serving(self, since_ns: int) -> None:
        """The node serves from ``since_ns`` on: held steps after it join the series, the
        others are the warm-up."""
        self.serving_since_ns = since_ns
        for ts, v in zip(self._held_ts, self._held_v):
            if ts > since_ns:
                self._steps_ts.append(ts)
                self._steps_v.append(v)
        self._held_ts, self._held_v = [], []

    def _finished(self, ev: s.RequestFinished) -> None:
        arrived, ft_ns, ft_ttft = self._open.pop(ev.request_id, None) or (None, None, None)
        if ev.status != "finished":
            return
        if self.serving_since_ns is None:
            self._start_serving(ev.ts_ns)
        ttft = _num(_opt(ev.ttft_ns) if _opt(ev.ttft_ns) is not None else ft_ttft)
        e2e = _num(_opt(ev.e2e_ns)) if _opt(ev.e2e_ns) is not None else (
            ev.ts_ns - arrived if arrived is not None else math.nan)
        if arrived is None:
            arrived = ev.ts_ns - e2e
        first_ns = ft_ns if ft_ns is not None else arrived + ttft
        if math.isfinite(ttft) and math.isfinite(first_ns):
            ts, v = self._req["ttft"]
            ts.append(int(first_ns))
            v.append(ttft)
        out = ev.output_tokens
        if out is not None and out >= 2:
            per = (e2e - ttft) / (out - 1)
            if math.isfinite(per):
                ts, v = self._req["per_token"]
                ts.append(ev.ts_ns)
                v.append(per)

    def flush(self) -> None:
        """Move the pending samples into the sketches (in batches: numpy per call)."""
        if self._steps_ts:
            self.series["step"].add(self._steps_ts, self._steps_v)
            self._steps_ts.clear()
            self._steps_v.clear()
        for name, (ts, v) in self._req.items():
            if ts:
                self.series[name].add(ts, v)
                ts.clear()
                v.clear()

    def copy_series(self) -> dict[str, SketchSeries]:
        """Copies of the series (under the caller's lock; read outside it), with the steps
        held before a first finished request, as long as none came (module docstring)."""
        self.flush()
        out = {name: sr.copy() for name, sr in self.series.items()}
        if self._held_ts:
            out["step"].add(self._held_ts, self._held_v)
        return out


def _opt(x):
    """None for a missing value (None, or NaN in a frame rebuilt as events)."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _num(x) -> float:
    return math.nan if x is None else float(x)


def fold(events: Iterable[s.Event]) -> LatencyFacts:
    """A fresh :class:`LatencyFacts` over ``events`` of one node in time order (an arrival and
    a first token before a finish of the same instant): the doctor's path."""
    ordered = sorted((ev for ev in events if type(ev) in _RANK),
                     key=lambda ev: (ev.ts_ns, _RANK[type(ev)]))
    facts = LatencyFacts()
    facts.record(ordered)
    facts.flush()
    return facts


def series(logs) -> dict[str, SketchSeries]:
    """The latency series of ``logs`` (a :class:`kvdiag.diagnosis.frames.Logs`): handed over by
    ``kvdiag top`` (``logs.sketches``) or folded now from the frames, per node, and merged."""
    if logs.sketches:
        return logs.sketches
    from kvdiag.diagnosis.frames import node_events  # the frames as events, per node

    out = {name: SketchSeries() for name in SERIES}
    for node in logs.nodes:
        facts = fold(node_events(logs, node, INPUTS))
        for name, sr in facts.copy_series().items():
            out[name].merge(sr)
    logs.sketches.update(out)
    return out
