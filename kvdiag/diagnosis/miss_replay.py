"""A recorded log replayed through the miss-cause fold
(:class:`kvdiag.diagnosis.miss_causes.MissCauseFold`): its events in order, from the log file
or rebuilt from loaded frames, cut into time windows of missed tokens by cause.
"""

from __future__ import annotations

from typing import Iterable

import pandas as pd

from kvdiag.diagnosis.frames import node_events
from kvdiag.diagnosis.miss_causes import REPLAY_EVENTS, MissCauseFold
from kvdiag.diagnosis.miss_tally import MissCauses, RequestMisses
from kvdiag.events.schema import Event, RequestFinished


def miss_causes_of_events(events: Iterable[Event], *, engine: str = "", window_s: float = 60.0,
                          **fold_kwargs) -> MissCauses:
    """Replay ``events`` (in order) through one :class:`MissCauseFold` and cut the finished
    requests into ``window_s`` windows."""
    recs: list[RequestMisses] = []
    fold = MissCauseFold(engine=engine, on_request=recs.append, **fold_kwargs)
    fold.feed_all(events)
    return MissCauses(fold.tally, [], recs, 0, fold.block_size_tokens, fold.capacity_blocks).cut(window_s)


def log_file_events(path) -> Iterable[Event]:
    """The :data:`REPLAY_EVENTS` of one event log file, streamed in file order (unreadable lines
    skipped silently: the reader that loaded the log reported them)."""
    from kvdiag.events.eventlog import ReadOutcome, iter_events
    return (e for e in iter_events(path, outcome=ReadOutcome()) if type(e) in REPLAY_EVENTS)


def miss_causes_of_logs(logs, window_s: float = 60.0) -> dict[str, MissCauses]:
    """Per node of ``logs`` with finished requests, its :class:`MissCauses` in ``window_s``
    windows (:func:`replays`)."""
    return {node: m.cut(window_s) for node, m in replays(logs).items()}


def replays(logs) -> dict[str, MissCauses]:
    """Per node of ``logs`` with finished requests, its log replayed through the fold, once
    (kept in ``logs.misses``): the node's log file in file order (the loaded frames leave out
    ``BlockStored``, whose generated blocks the shadow needs), or its frames for a Parquet
    dataset."""
    from pathlib import Path
    if logs.misses:
        return logs.misses
    out = {}
    for node in logs.nodes:
        if not logs.has(RequestFinished) or not (logs.frame(RequestFinished)["node"] == node).any():
            continue
        path = logs.paths.get(node)
        events = (log_file_events(path) if path is not None and Path(path).is_file()
                  else node_events(logs, node, REPLAY_EVENTS))
        out[node] = miss_causes_of_events(events, engine=logs.headers[node].engine or "")
    logs.misses.update(out)
    return out


EXPLAINED_TAG = "miss_explained"
"""The derived frame of :func:`explained_frame`."""


def explained_frame(logs) -> pd.DataFrame:
    """Per finished request with explained tokens
    (:func:`kvdiag.diagnosis.miss_tally.explained_tokens`): ``ts_ns`` (its finish), ``node``,
    ``tokens``. Handed over in ``logs.derived`` (``kvdiag top``: its live fold's
    :class:`kvdiag.diagnosis.miss_tally.ExplainedLog`), else from :func:`replays` of the whole
    log, cut to a window's span."""
    if EXPLAINED_TAG in logs.derived:
        return logs.derived[EXPLAINED_TAG]
    base = logs.whole or logs
    if EXPLAINED_TAG not in base.derived:
        rows = [(r.ts_ns, node, r.explained_tokens) for node, m in replays(base).items()
                for r in m.requests if r.explained_tokens]
        base.derived[EXPLAINED_TAG] = explained_rows(rows)
    df = base.derived[EXPLAINED_TAG]
    if base is not logs and logs.span_ns is not None:
        start, end = logs.span_ns
        df = logs.derived[EXPLAINED_TAG] = df[(df["ts_ns"] >= start) & (df["ts_ns"] < end)]
    return df


def explained_rows(rows: Iterable[tuple[int, str, int]]) -> pd.DataFrame:
    """The :func:`explained_frame` of ``(ts_ns, node, tokens)`` rows."""
    df = pd.DataFrame(list(rows), columns=["ts_ns", "node", "tokens"])
    return df.astype({"ts_ns": "int64", "tokens": "int64"})
