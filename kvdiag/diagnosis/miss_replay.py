"""A recorded log replayed through the miss-cause fold
(:class:`kvdiag.diagnosis.miss_causes.MissCauseFold`): its events in order, from the log file
or rebuilt from loaded frames, cut into time windows of missed tokens by cause.
"""

from __future__ import annotations

from typing import Iterable

from kvdiag.diagnosis.frames import node_events
from kvdiag.diagnosis.miss_causes import REPLAY_EVENTS, MissCauseFold
from kvdiag.diagnosis.miss_tally import MissCauses, MissTally, MissWindow, RequestMisses
from kvdiag.events.schema import Event, RequestFinished


def miss_causes_of_events(events: Iterable[Event], *, engine: str = "", window_s: float = 60.0,
                          **fold_kwargs) -> MissCauses:
    """Replay ``events`` (in order) through one :class:`MissCauseFold` and cut the finished
    requests into ``window_s`` windows."""
    recs: list[RequestMisses] = []
    fold = MissCauseFold(engine=engine, on_request=recs.append, **fold_kwargs)
    fold.feed_all(events)
    window_ns = max(int(window_s * 1e9), 1)
    windows: list[MissWindow] = []
    if recs:
        t0 = min(r.ts_ns for r in recs)
        by: dict[int, MissTally] = {}
        for r in recs:
            by.setdefault((r.ts_ns - t0) // window_ns, MissTally()).add(r)
        windows = [MissWindow(t0 + k * window_ns, t0 + (k + 1) * window_ns, by[k]) for k in sorted(by)]
    return MissCauses(fold.tally, windows, recs, window_ns, fold.block_size_tokens, fold.capacity_blocks)


def log_file_events(path) -> Iterable[Event]:
    """The :data:`REPLAY_EVENTS` of one event log file, streamed in file order (unreadable lines
    skipped silently: the reader that loaded the log reported them)."""
    from kvdiag.events.eventlog import ReadOutcome, iter_events
    return (e for e in iter_events(path, outcome=ReadOutcome()) if type(e) in REPLAY_EVENTS)


def miss_causes_of_logs(logs, window_s: float = 60.0) -> dict[str, MissCauses]:
    """Per node of ``logs`` with finished requests, its :class:`MissCauses`: the node's log
    file replayed in file order (the loaded frames leave out ``BlockStored``, whose generated
    blocks the shadow needs), or its frames for a Parquet dataset."""
    from pathlib import Path
    out = {}
    for node in logs.nodes:
        if not logs.has(RequestFinished) or not (logs.frame(RequestFinished)["node"] == node).any():
            continue
        path = logs.paths.get(node)
        events = (log_file_events(path) if path is not None and Path(path).is_file()
                  else node_events(logs, node, REPLAY_EVENTS))
        out[node] = miss_causes_of_events(events, engine=logs.headers[node].engine or "",
                                          window_s=window_s)
    return out
