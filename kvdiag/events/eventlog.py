"""The event log: append-only JSONL, a header line first, one event per line; its header, and
reading it back. :mod:`kvdiag.events.log_writer` writes it (a ``kill -9`` loses at most the
last flush interval; the reader skips the truncated last line with a warning).

Reading streams the file: lines are decoded in batches and folded into one pandas DataFrame
per event type, whose columns are the event's fields (units in their names).
"""

from __future__ import annotations

import collections
import gc
import gzip
import os
import socket
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import msgspec
import pandas as pd

from kvdiag import __version__
from kvdiag.events.line_errors import lenient_parse, non_finite_message, validation_message
from kvdiag.events.log_frames import to_frame
from kvdiag.events.schema import (
    SCHEMA_MAJOR,
    SCHEMA_VERSION,
    TAGS,
    AnyEvent,
    Event,
    LogHeader,
    event_tag,
    fields_of,
    parse_version,
)

__all__ = ["EventLog", "LogFormatError", "ReadOutcome", "iter_events", "make_header",
           "read_header", "read_log"]


class LogFormatError(ValueError):
    """A log that cannot be read; the message is ``file:line: what was expected``."""


def make_header(**fields) -> LogHeader:
    """A header for this process: version, host, pid and start time filled in."""
    defaults = dict(schema_version=SCHEMA_VERSION, kvdiag_version=__version__, host=socket.gethostname(), pid=os.getpid(),
                    start_ns=time.time_ns())
    defaults.update(fields)
    if not defaults.get("node"):
        defaults["node"] = defaults["host"]
    return LogHeader(**defaults)


# ---------------------------------------------------------------------------- reading

_header_decoder = msgspec.json.Decoder(LogHeader)
_event_decoder = msgspec.json.Decoder(AnyEvent)
_FRAME_PIECE_ROWS = 50_000


@dataclass
class EventLog:
    """A log read into one DataFrame per event type (keyed by the event's ``type`` tag)."""

    path: Path
    header: LogHeader
    frames: dict[str, pd.DataFrame]
    problems: list[str] = field(default_factory=list)
    unknown_types: dict[str, int] = field(default_factory=dict)
    cut: Optional[str] = None  # why the log ends early (a writer killed mid-line), if it does

    def frame(self, tag_or_cls: str | type[Event]) -> pd.DataFrame:
        """The events of one type; an empty frame with the right columns when there are none."""
        tag = tag_or_cls if isinstance(tag_or_cls, str) else event_tag(tag_or_cls)
        if tag in self.frames:
            return self.frames[tag]
        return pd.DataFrame(columns=list(fields_of(TAGS[tag])))

    def __len__(self) -> int:
        return sum(len(f) for f in self.frames.values())


_CHUNK_BYTES = 4 << 20


class _Chunks:
    """Blocks of whole lines of a plain or gzip log, as ``(first_lineno, bytes)``.

    Every block but the last ends with a newline; the last holds what follows the final
    newline (a line cut by a killed writer). A gzip stream cut short ends the iteration with
    ``truncated`` set instead of raising.
    """

    def __init__(self, path: Path):
        self.path = path
        self.truncated = False

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        opener = gzip.open if _is_gzip(self.path) else open
        try:
            f = opener(self.path, "rb")
        except FileNotFoundError:
            raise LogFormatError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise LogFormatError(f"{self.path}: is a directory, expected a kvdiag log") from None
        lineno, rest = 1, b""
        with f:
            while True:
                try:
                    data = f.read1(_CHUNK_BYTES)  # read1: a cut gzip keeps the bytes before the cut
                except (EOFError, zlib.error, gzip.BadGzipFile):
                    self.truncated = True
                    data = b""
                if not data:
                    break
                data = rest + data
                cut = data.rfind(b"\n") + 1
                rest = data[cut:]
                if cut:
                    yield lineno, data[:cut]
                    lineno += data.count(b"\n", 0, cut)
        if rest:
            yield lineno, rest


def _is_gzip(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"\x1f\x8b"
    except OSError:
        return False


def _parse_header(path: Path, line: bytes) -> LogHeader:
    try:
        header = _header_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise LogFormatError(f"{path}:1: expected a kvdiag log header line ({exc})") from None
    try:
        major, _ = parse_version(header.schema_version)
    except ValueError:
        raise LogFormatError(f"{path}:1: expected schema_version MAJOR.MINOR, "
                             f"got {header.schema_version!r}") from None
    if major > SCHEMA_MAJOR:
        raise LogFormatError(
            f"{path}:1: log schema {header.schema_version} is newer than this kvdiag reads "
            f"({SCHEMA_MAJOR}.x); upgrade kvdiag to read it")
    return header


def read_header(path: str | os.PathLike) -> LogHeader:
    """The header of a log; raises LogFormatError if the file is not a kvdiag log."""
    path = Path(path)
    for _, block in _Chunks(path):
        return _parse_header(path, block.split(b"\n", 1)[0])
    raise LogFormatError(f"{path}: empty file, expected a kvdiag log header line")


@dataclass
class ReadOutcome:
    """What reading a log left out: unreadable lines (``file:line: why``) and the cut, if the
    log ends early (a writer killed mid-line)."""

    header: Optional[LogHeader] = None
    problems: list[str] = field(default_factory=list)
    cut: Optional[str] = None


class _EventStream:
    """Decodes the event lines of a log block by block, collecting problems on the side."""

    def __init__(self, path: Path, strict: bool,
                 on_progress: Optional[Callable[[int], None]] = None, warn: bool = True):
        self.path = path
        self.warn = warn
        self.strict = strict
        self.on_progress = on_progress
        self.header: Optional[LogHeader] = None
        self.problems: list[str] = []
        self.unknown_types: dict[str, int] = {}
        self.cut: Optional[str] = None

    def batches(self) -> Iterator[list[Event]]:
        chunks = _Chunks(self.path)
        for lineno, block in chunks:
            if self.header is None:
                first, _, block = block.partition(b"\n")
                self.header = _parse_header(self.path, first)
                lineno += 1
            if block.endswith(b"\n"):
                yield self._decode(lineno, block)
            elif block:  # no newline at the end: the writer may have died mid-line
                yield self._decode(lineno, block, last_line=True)
        if self.header is None:
            raise LogFormatError(f"{self.path}: empty file, expected a kvdiag log header line")
        if chunks.truncated:
            self.cut = (f"{self.path}: compressed stream ends early (writer killed?); "
                        f"read everything before the cut")
            if self.warn:
                warnings.warn(self.cut)

    def _decode(self, first_lineno: int, block: bytes, last_line: bool = False) -> list[Event]:
        n_lines = block.count(b"\n") + (not block.endswith(b"\n"))
        if not last_line:
            try:
                events = _event_decoder.decode_lines(block)
                self._progress(n_lines)
                return events
            except msgspec.DecodeError:
                pass  # locate the bad lines one by one
        events = []
        lines = block.split(b"\n")
        if block.endswith(b"\n"):
            lines.pop()
        for offset, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                events.append(_event_decoder.decode(line))
            except msgspec.DecodeError as exc:
                is_last = last_line and offset == len(lines) - 1
                self._problem(first_lineno + offset, line, exc, is_last)
        self._progress(n_lines)
        return events

    def _problem(self, lineno: int, line: bytes, exc: Exception, last_line: bool) -> None:
        try:
            obj = msgspec.json.decode(line)
        except msgspec.DecodeError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("type"), str) and obj["type"] not in TAGS:
            # an event type from a newer minor version: skip it, readable logs stay readable
            self.unknown_types[obj["type"]] = self.unknown_types.get(obj["type"], 0) + 1
            return
        if last_line and obj is None:
            self.cut = (f"{self.path}:{lineno}: skipped a truncated last line "
                        f"(the writer stopped mid-line)")
            if self.warn:
                warnings.warn(self.cut)
            return
        message = f"{self.path}:{lineno}: {_why(exc, line, obj)}"
        if self.strict:
            raise LogFormatError(message)
        self.problems.append(message)

    def _progress(self, n: int) -> None:
        if self.on_progress is not None:
            self.on_progress(n)


def _why(exc: Exception, line: bytes, obj: object) -> str:
    """``type.field: expected ..., got VALUE`` where the reader can name the field (a value
    out of range, a NaN or Infinity literal), else ``expected a kvdiag event line (...)``."""
    if obj is None:
        obj = lenient_parse(line)
        message = non_finite_message(obj) if isinstance(obj, dict) else None
    elif isinstance(obj, dict) and isinstance(exc, msgspec.ValidationError):
        message = validation_message(exc)
        field, _, what = message.partition(": ")
        if field in obj and " got " not in what and " found " not in what:
            message += f", got {msgspec.json.encode(obj[field]).decode()[:60]}"
    else:
        message = None
    if message is None:
        return f"expected a kvdiag event line ({exc})"
    kind = obj.get("type") if isinstance(obj.get("type"), str) else "event"
    return f"{kind}.{message}"


def iter_events(path: str | os.PathLike, strict: bool = False,
                outcome: Optional["ReadOutcome"] = None) -> Iterator[Event]:
    """Stream the events of a log in file order. Bad lines are skipped (``strict``: raise
    LogFormatError); a truncated last line is skipped. Given ``outcome``, the header, the
    skipped lines and the cut are recorded there; otherwise they are warnings (the first 20
    skipped lines)."""
    stream = _EventStream(Path(path), strict, warn=outcome is None)
    for batch in stream.batches():
        yield from batch
    if outcome is not None:
        outcome.header, outcome.problems, outcome.cut = stream.header, stream.problems, stream.cut
        return
    for message in stream.problems[:20]:
        warnings.warn(message)


def read_log(path: str | os.PathLike, types: Optional[Iterable[str | type[Event]]] = None,
             strict: bool = False,
             on_progress: Optional[Callable[[int], None]] = None) -> EventLog:
    """Read a log into one DataFrame per event type.

    ``types`` restricts which event types are kept (others are decoded and discarded);
    ``on_progress(n_lines)`` is called as batches are read (for a progress bar). Memory is
    that of the resulting DataFrames plus one batch of lines.
    """
    wanted = None if types is None else {
        t if isinstance(t, str) else event_tag(t) for t in types}
    # Millions of short-lived tuples would trigger the cyclic GC over and over (they hold no
    # cycles); pausing it while reading makes the read ~1.5x faster.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _read_log(Path(path), wanted, strict, on_progress)
    finally:
        if gc_was_enabled:
            gc.enable()


def _read_log(path: Path, wanted: Optional[set[str]], strict: bool,
              on_progress: Optional[Callable[[int], None]]) -> EventLog:
    stream = _EventStream(path, strict, on_progress)
    rows: collections.defaultdict[type, list[tuple]] = collections.defaultdict(list)
    pieces: dict[type, list[pd.DataFrame]] = {}
    astuple = msgspec.structs.astuple
    for batch in stream.batches():
        for event in batch:
            rows[type(event)].append(astuple(event))
        for cls, bucket in list(rows.items()):
            if wanted is not None and event_tag(cls) not in wanted:
                del rows[cls]
            elif len(bucket) >= _FRAME_PIECE_ROWS:
                pieces.setdefault(cls, []).append(to_frame(cls, bucket))
                rows[cls] = []
    frames = {}
    for cls in set(rows) | set(pieces):
        parts = pieces.get(cls, [])
        if rows.get(cls):
            parts.append(to_frame(cls, rows[cls]))
        frames[event_tag(cls)] = parts[0] if len(parts) == 1 else pd.concat(parts, ignore_index=True)
    return EventLog(path=path, header=stream.header, frames=frames,
                    problems=stream.problems, unknown_types=stream.unknown_types, cut=stream.cut)
