"""Reading the lines of a JSONL trace: decoding with checks, and the lines skipped.

Each line is decoded by msgspec (typed, with range constraints, where the format allows), so
``NaN``/``Infinity``, integers beyond int64 and mistyped fields never reach an analysis. A line
that fails is a *problem* ``file:line: field: expected ...``: collected and skipped
(:class:`ReadOptions` ``strict=False``) or raised as :class:`TraceFormatError`. A last line
without a newline that is not JSON (a writer killed mid-line) is an error unless ``partial``.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Iterator, Optional, TypeVar

import msgspec

from kvdiag.events.line_errors import lenient_parse, non_finite_message, validation_message
from kvdiag.pool.prefix_cache import MAX_TS_S  # timestamps in seconds whose nanoseconds fit in int64
from kvdiag.events.schema import INT64_MAX

MAX_TS_MS = INT64_MAX // 10**6

Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_TS_S)]
Millis = Annotated[float, msgspec.Meta(ge=0, le=MAX_TS_MS)]

T = TypeVar("T")


class TraceFormatError(ValueError):
    """An unreadable trace; the message is ``file:line: [field: ]expected ...``."""


class BadLine(ValueError):
    """One line's problem, ``field: expected ...``; ``malformed``: the line is not JSON at all
    (for a last line without a newline: cut short by its writer)."""

    def __init__(self, message: str, malformed: bool = False) -> None:
        super().__init__(message)
        self.malformed = malformed


@dataclass
class ReadOptions:
    """How a reader treats bad lines: ``strict`` raises at the first (the library default);
    otherwise each is skipped and its message kept in ``problems``. ``partial`` accepts a last
    line cut short mid-line (dropped, not a problem)."""

    strict: bool = True
    partial: bool = False
    problems: list[str] = field(default_factory=list)

    def skip(self, message: str) -> None:
        """A bad line ``file:line: why``: raise (strict) or keep it."""
        if self.strict:
            raise TraceFormatError(message)
        self.problems.append(message)


def raw_lines(path: Path, opts: ReadOptions) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, bytes, is an unterminated last line) of each non-blank line of a plain or
    gzip file. A gzip stream that ends early is a cut (error unless ``partial``)."""
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        f = gzip.open(path, "rb") if gz else open(path, "rb")
    except OSError as exc:
        raise TraceFormatError(f"{path}:0: expected a readable trace file ({exc})") from None
    lineno = 0
    with f:
        while True:
            try:
                line = f.readline()
            except (EOFError, zlib.error, gzip.BadGzipFile, OSError) as exc:
                if not opts.partial:
                    raise TraceFormatError(f"{path}:{lineno + 1}: expected a complete compressed "
                                           f"stream ({exc}; pass --partial to use the lines "
                                           "before the cut)") from None
                return
            if not line:
                return
            lineno += 1
            if line.strip():
                yield lineno, line, not line.endswith(b"\n")


def decoded_lines(path: Path, decode: Callable[[bytes], T],
                  opts: ReadOptions) -> Iterator[tuple[int, T]]:
    """(line number, ``decode(line)``) for each line that decodes; a :class:`BadLine` is
    skipped through ``opts`` (see the module docstring for a cut last line)."""
    for lineno, line, unterminated in raw_lines(path, opts):
        try:
            value = decode(line)
        except BadLine as exc:
            if unterminated and exc.malformed:
                if opts.partial:
                    return
                raise TraceFormatError(f"{path}:{lineno}: expected a complete last line, found "
                                       "one cut short (writer killed?); pass --partial to use "
                                       "the lines before it") from None
            opts.skip(f"{path}:{lineno}: {exc}")
            continue
        yield lineno, value


def decode_json(line: bytes, decoder: Optional[msgspec.json.Decoder] = None):
    """One JSON line, typed by ``decoder`` (untyped without); raises :class:`BadLine`."""
    try:
        return (decoder or _ANY).decode(line)
    except msgspec.ValidationError as exc:
        raise BadLine(validation_message(exc)) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _malformed(line, exc) from None


_ANY = msgspec.json.Decoder()


def _malformed(line: bytes, exc: Exception) -> BadLine:
    """Why msgspec rejected a line: a NaN/Infinity literal (named by its field), or not JSON."""
    obj = lenient_parse(line)
    message = None if obj is None else non_finite_message(obj)
    if message is None:
        return BadLine(f"expected one JSON value per line ({exc})", malformed=True)
    return BadLine(message)
