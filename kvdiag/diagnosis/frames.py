"""Several event logs (one per node) seen as one: every frame gains a ``node`` column.

Timestamps are wall-clock nanoseconds in every log, so rows of several nodes share one time
axis. A node is named by its header's ``node``, else its ``host``, else the file's stem;
repeated names get ``#2``, ``#3`` appended so that two logs never fold into one node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, NewType, Optional

import warnings

import numpy as np
import pandas as pd

from kvdiag.events.eventlog import LogFormatError, read_log
from kvdiag.events.schema import Event, KVPoolInfo, LogHeader, TAGS, event_tag, fields_of

NodeName = NewType("NodeName", str)


def _tag(tag_or_cls: str | type[Event]) -> str:
    return tag_or_cls if isinstance(tag_or_cls, str) else event_tag(tag_or_cls)


def empty_frame(tag_or_cls: str | type[Event]) -> pd.DataFrame:
    """An empty frame with the event's columns and ``node`` (only ts_ns and node for a tag
    this schema version does not know)."""
    tag = _tag(tag_or_cls)
    cols = fields_of(TAGS[tag]) if tag in TAGS else ("ts_ns",)
    return pd.DataFrame(columns=[*cols, "node"])


@dataclass
class Logs:
    """Frames of one or more logs. ``frames[tag]`` holds every node's rows of that event type
    with a ``node`` column; ``headers[node]`` is each log's header."""

    headers: dict[NodeName, LogHeader]
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    paths: dict[NodeName, str] = field(default_factory=dict)
    span_ns: Optional[tuple[int, int]] = None  # set by window(): its [start, end)
    whole: Optional["Logs"] = field(default=None, repr=False)
    """For a window, the logs it was cut from: state built up before the window (the blocks
    requests hold) is read there."""
    derived: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)
    """Figures folded from the events rather than recorded (:mod:`kvdiag.diagnosis.block_facts`),
    by tag, with ``ts_ns`` and ``node`` columns; cut with the frames by :meth:`window`."""
    sketches: dict = field(default_factory=dict, repr=False)
    """The latency series (:func:`kvdiag.diagnosis.latency_facts.series`, by name), handed over by ``kvdiag
    top`` or folded on first use; a window folds its own."""
    misses: dict = field(default_factory=dict, repr=False)
    """Per node, the miss-cause replay of its log (:func:`kvdiag.diagnosis.miss_replay.replays`),
    folded on first use."""

    @property
    def nodes(self) -> list[NodeName]:
        return list(self.headers)

    def frame(self, tag_or_cls: str | type[Event]) -> pd.DataFrame:
        """All nodes' rows of one event type (an empty frame with the right columns if none)."""
        tag = _tag(tag_or_cls)
        df = self.frames.get(tag)
        return empty_frame(tag) if df is None else df

    def has(self, tag_or_cls: str | type[Event]) -> bool:
        return len(self.frame(tag_or_cls)) > 0

    def time_range_ns(self) -> tuple[int, int]:
        """First and last event timestamp over all nodes ((0, 0) for no events); for a
        window, its bounds (its KVPoolInfo rows, kept whole, do not widen it)."""
        if self.span_ns is not None:
            return self.span_ns[0], self.span_ns[1] - 1
        lo, hi = None, None
        for df in self.frames.values():
            if len(df):
                a, b = int(df["ts_ns"].min()), int(df["ts_ns"].max())
                lo = a if lo is None else min(lo, a)
                hi = b if hi is None else max(hi, b)
        return (lo or 0, hi or 0)

    def last_ts_ns(self) -> dict[NodeName, int]:
        """The last event timestamp of each node."""
        return self._extreme_ts_ns(max)

    def first_ts_ns(self) -> dict[NodeName, int]:
        """The first event timestamp of each node."""
        return self._extreme_ts_ns(min)

    def _extreme_ts_ns(self, pick) -> dict[NodeName, int]:
        out: dict[NodeName, int] = {}
        for df in self.frames.values():
            if len(df):
                agg = df.groupby("node")["ts_ns"].agg("max" if pick is max else "min")
                for node, t in agg.items():
                    out[node] = pick(out.get(node, int(t)), int(t))
        return out

    def num_events(self) -> int:
        return sum(len(df) for df in self.frames.values())

    def block_bytes(self, node: NodeName) -> Optional[int]:
        """Bytes of one KV block on ``node``: the pool's own figure, else the header's
        bytes_per_token x block_size_tokens, else None."""
        info = self.frame(KVPoolInfo)
        info = info[info["node"] == node]
        if len(info):
            return int(info["block_bytes"].iloc[-1])
        h = self.headers[node]
        if h.bytes_per_token and h.block_size_tokens:
            return int(h.bytes_per_token * h.block_size_tokens)
        return None

    def block_size_tokens(self, node: NodeName) -> Optional[int]:
        """Tokens per KV block on ``node`` (the pool's figure, else the header's)."""
        info = self.frame(KVPoolInfo)
        info = info[info["node"] == node]
        if len(info):
            return int(info["block_size_tokens"].iloc[-1])
        return self.headers[node].block_size_tokens

    def bytes_per_token(self, node: NodeName) -> Optional[int]:
        """KV bytes of one token on ``node`` (header, else block bytes / block size)."""
        h = self.headers[node]
        if h.bytes_per_token:
            return int(h.bytes_per_token)
        bb, bs = self.block_bytes(node), self.block_size_tokens(node)
        return bb // bs if bb and bs else None

    def window(self, start_ns: int, end_ns: int) -> "Logs":
        """The events with ``start_ns <= ts_ns < end_ns`` (KVPoolInfo is kept whole: it
        describes the pool, not a moment)."""
        pool_tag = event_tag(KVPoolInfo)
        frames = {
            tag: df if tag == pool_tag else df[(df["ts_ns"] >= start_ns) & (df["ts_ns"] < end_ns)]
            for tag, df in self.frames.items()
        }
        whole = self.whole or self
        derived = {tag: df[(df["ts_ns"] >= start_ns) & (df["ts_ns"] < end_ns)]
                   for tag, df in _derived_of(whole).items()}
        return Logs(self.headers, frames, self.paths, span_ns=(start_ns, end_ns), whole=whole,
                    derived=derived)


def _derived_of(logs: "Logs") -> dict[str, pd.DataFrame]:
    """The derived frames of ``logs``, folded now if not yet (a window is cut from them)."""
    from kvdiag.diagnosis import block_facts  # the fold reads these frames

    block_facts.ensure(logs)
    return logs.derived


def node_names(headers: Iterable[LogHeader], paths: Iterable[str | Path]) -> list[NodeName]:
    """One distinct label per log: header.node, else header.host, else the file stem."""
    return distinct_names(h.node or h.host or Path(p).name.split(".")[0] for h, p in zip(headers, paths))


def distinct_names(bases: Iterable[str]) -> list[NodeName]:
    """The names in order, a repeated one with ``#2``, ``#3`` appended."""
    seen: dict[str, int] = {}
    out = []
    for base in bases:
        seen[base] = seen.get(base, 0) + 1
        out.append(NodeName(base if seen[base] == 1 else f"{base}#{seen[base]}"))
    return out


def merge(logs: Iterable[tuple[LogHeader, Mapping[str, pd.DataFrame], str]]) -> Logs:
    """Merge ``(header, frames, path)`` triples (one per log) into one :class:`Logs`."""
    items = list(logs)
    names = node_names([h for h, _, _ in items], [p for _, _, p in items])
    per_tag: dict[str, list[pd.DataFrame]] = {}
    for name, (_, frames, _) in zip(names, items):
        for tag, df in frames.items():
            if len(df):
                per_tag.setdefault(tag, []).append(df.assign(node=name))
    frames = {
        tag: (pd.concat(dfs, ignore_index=True) if len(dfs) > 1 else dfs[0].reset_index(drop=True))
        .sort_values("ts_ns", kind="stable", ignore_index=True)
        for tag, dfs in per_tag.items()
    }
    return Logs(
        headers={n: h for n, (h, _, _) in zip(names, items)},
        frames=frames,
        paths={n: str(p) for n, (_, _, p) in zip(names, items)},
    )


UNUSED_BY_REPORTS = frozenset({"block_stored"})
"""Event types reports and the doctor do not read (BlockStored carries every block's token
ids: skipping it keeps the memory of a large log's frames down)."""


def load(paths: Iterable[str | Path], on_progress: Optional[Callable[[int], None]] = None,
         allow_truncated: bool = False, skip: frozenset[str] = UNUSED_BY_REPORTS,
         strict: bool = False) -> tuple[Logs, list[str]]:
    """Read and merge logs (a folder is a Parquet dataset of ``kvdiag export``: its logs are
    read back as they were read at export), leaving out the event types in ``skip``. Returns the merged logs
    and the reader's problems (unreadable lines that were skipped). Raises LogFormatError for
    a log that is not a kvdiag log, has no events, or (unless ``allow_truncated``) was cut
    short by a writer that stopped mid-line; with ``strict``, also for any unreadable line."""
    items, problems = [], []
    wanted = set(TAGS) - set(skip)
    for path in paths:
        if Path(path).is_dir():  # a Parquet dataset of kvdiag export: several logs
            from kvdiag.events.dataset import read_dataset  # pyarrow only when there is one
            more, skipped = read_dataset(path, skip=frozenset(skip))
            items += more
            problems += skipped
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reader's warnings: returned and raised here
            log = read_log(path, types=wanted, on_progress=on_progress, strict=strict)
        if log.cut and not allow_truncated:
            raise LogFormatError(f"{log.cut}; expected a complete log (pass --partial to "
                                 f"use the events before the cut)")
        if len(log) == 0:
            where = f"{path}:{2 + len(log.problems)}"
            raise LogFormatError(f"{where}: expected events after the header, found "
                                 + (f"only unreadable lines ({log.problems[0]})" if log.problems else "none"))
        problems += log.problems
        items.append((log.header, log.frames, str(path)))
    if not items:
        raise LogFormatError("no log given: expected at least one kvdiag log")
    return merge(items), problems


def node_events(logs: Logs, node: str, classes) -> list[Event]:
    """``node``'s events of ``classes`` rebuilt from the frames of ``logs`` as they were recorded
    (NaN cells: None, numpy values: Python ones), in time order; ties in the order of
    ``classes``, then of the log (for analyses that replay events)."""
    out = []
    for rank, cls in enumerate(classes):
        df = logs.frame(cls)
        df = df[df["node"] == node]
        names = [c for c in df.columns if c in cls.__struct_fields__]
        for i, row in enumerate(zip(*(df[c].tolist() for c in names))):
            kw = {k: _plain(v) for k, v in zip(names, row)}
            out.append((kw["ts_ns"], rank, i, cls(**kw)))
    out.sort(key=lambda p: p[:3])
    return [p[3] for p in out]


def _plain(v):
    """A frame cell as the event field it came from (NaN: None, arrays: lists)."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, np.generic):
        return v.item()
    return v
