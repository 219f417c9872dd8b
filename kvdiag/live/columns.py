"""The events the live rules judge one by one (:mod:`kvdiag.live.rules`), kept column by
column in immutable chunks of :data:`CHUNK_ROWS` rows, each as narrow as its values allow: the
frames they give back are those the doctor builds from the same events in a log (same values,
same dtypes), in about 1/2 to 1/4 of the bytes of 4- or 8-byte typed arrays.

A chunk of an integer column is stored in the narrowest signed type that holds its values
(int8 .. int64); ``ts_ns`` as the chunk's first value plus int differences (events come about
in time order, so the differences are small); an ``Optional`` number as values and a presence
mask; a string as UTF-8 bytes end to end with each one's length; a ``Literal`` of strings as
one small code per row and the distinct values. Chunks are never grown nor written after they
are made: a copy (:meth:`Table.copy`, taken under the caller's lock) shares them, and the
column's memory grows by whole chunks (no buffer grown by ``realloc`` leaves holes in the heap
as it moves). Rows wait in a list of at most ``CHUNK_ROWS`` tuples until a chunk is full.

A value that does not fit its column's type (a malformed event) turns that column into a list
of the values (kind ``obj``), as pandas would hold it.
"""

from __future__ import annotations

import typing
from typing import Optional

import msgspec
import numpy as np

from kvdiag.events import schema as s

CHUNK_ROWS = 4_096
"""Rows of one chunk (and most rows waiting as Python tuples)."""
DELTA_FIELDS = frozenset(("ts_ns",))
"""Integer fields stored as differences within a chunk."""
_INT_TYPES = (np.int8, np.int16, np.int32, np.int64)


def column_kind(tp) -> str:
    """How a schema field is stored: int, opt_int, float, opt_float, bool, str, opt_str, code
    (a ``Literal`` of strings) or obj (anything else: a list)."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    tp = getattr(tp, "__supertype__", tp)  # NewType
    if typing.get_origin(tp) is typing.Literal and all(type(a) is str for a in typing.get_args(tp)):
        return "code"
    args = typing.get_args(tp)
    if args and type(None) in args and len(args) == 2:  # Optional[X]
        inner = column_kind(next(a for a in args if a is not type(None)))
        return {"int": "opt_int", "float": "opt_float", "str": "opt_str"}.get(inner, "obj")
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(tp, "obj")


class _Malformed(Exception):
    """A value that does not fit its column's kind."""


def _narrow(values: np.ndarray) -> np.ndarray:
    """``values`` (int64) in the narrowest signed integer type that holds them all."""
    if not len(values):
        return values.astype(np.int8)
    lo, hi = int(values.min()), int(values.max())
    for t in _INT_TYPES:
        info = np.iinfo(t)
        if info.min <= lo and hi <= info.max:
            return values.astype(t)
    return values


def _ints(values: list) -> np.ndarray:
    """Python ints (bools count as 0/1, as a typed array takes them) as int64; raises
    _Malformed for anything else or a value beyond int64."""
    if not all(type(v) is int or type(v) is bool for v in values):
        raise _Malformed
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        raise _Malformed from None


def _floats(values: list) -> np.ndarray:
    if not all(type(v) is float or type(v) is int or type(v) is bool for v in values):
        raise _Malformed
    try:
        return np.array(values, dtype=np.float64)
    except OverflowError:  # an int beyond float64
        raise _Malformed from None


class Column:
    """One field's chunks (see the module docstring); ``kind`` as :func:`column_kind`."""

    __slots__ = ("kind", "delta", "chunks", "masks", "codes", "rows")

    def __init__(self, kind: str, delta: bool = False) -> None:
        self.kind = kind
        self.delta = delta and kind == "int"
        self.chunks: list = []  # per chunk: ndarray, (bytes, lengths) for strings, or a list (obj)
        self.masks: Optional[list] = [] if kind.startswith("opt_") else None  # per chunk: bool ndarray
        self.codes: dict[str, int] = {}  # kind code: value -> its code
        self.rows = 0

    def __len__(self) -> int:
        return self.rows

    def add(self, values: list) -> None:
        """Append a chunk of values (raises _Malformed when one does not fit the kind)."""
        kind = self.kind
        if kind == "obj":
            self.chunks.append(list(values))
        else:
            mask = None
            if self.masks is not None:
                mask = np.array([v is not None for v in values], dtype=bool)
                present = [v for v in values if v is not None]
            if kind in ("int", "bool", "opt_int"):
                a = _ints(present if mask is not None else values)
                if self.delta and len(a):
                    chunk: object = (int(a[0]), _narrow(np.diff(a)))
                else:
                    chunk = _narrow(a)
            elif kind in ("float", "opt_float"):
                chunk = _floats(present if mask is not None else values)
            elif kind in ("str", "opt_str"):
                strs = present if mask is not None else values
                if not all(type(v) is str for v in strs):
                    raise _Malformed
                parts = [v.encode() for v in strs]
                chunk = (b"".join(parts), _narrow(np.array([len(p) for p in parts], dtype=np.int64)))
            else:  # code
                if not all(type(v) is str for v in values):
                    raise _Malformed
                codes = self.codes
                chunk = _narrow(np.array([codes.setdefault(v, len(codes)) for v in values], dtype=np.int64))
            self.chunks.append(chunk)
            if mask is not None:
                self.masks.append(mask)
        self.rows += len(values)

    def values(self) -> list:
        """Every value as a Python object (None where absent)."""
        out: list = []
        for i in range(len(self.chunks)):
            out += self._chunk_values(i)
        return out

    def _chunk_values(self, i: int) -> list:
        chunk, kind = self.chunks[i], self.kind
        if kind == "obj":
            return list(chunk)
        if kind == "code":
            names = list(self.codes)
            return [names[c] for c in chunk.tolist()]
        if kind in ("str", "opt_str"):
            present = _decode(*chunk)
        else:
            present = self._numbers(chunk).tolist()
            if kind == "bool":
                present = [bool(v) for v in present]
        if self.masks is None:
            return present
        it = iter(present)
        return [next(it) if m else None for m in self.masks[i].tolist()]

    def _numbers(self, chunk) -> np.ndarray:
        if self.delta:
            first, diffs = chunk
            out = np.empty(len(diffs) + 1, dtype=np.int64)
            out[0] = first
            np.cumsum(diffs, dtype=np.int64, out=out[1:])
            out[1:] += first  # (int64 arithmetic wraps, and so comes back exact)
            return out
        return chunk.astype(np.float64 if self.kind in ("float", "opt_float") else np.int64)

    def array(self, shared: Optional[dict] = None) -> np.ndarray:
        """The column as the doctor's frame holds it (module docstring of :mod:`kvdiag.live.rules`)."""
        kind = self.kind
        if kind in ("str", "code") or (kind == "opt_str" and self.masks is not None):
            shared = {} if shared is None else shared
            vals = self.values()
            return np.array([v if v is None else shared.setdefault(v, v) for v in vals], dtype=object)
        numbers = [self._numbers(c) for c in self.chunks]
        values = (np.concatenate(numbers) if numbers else
                  np.array([], dtype=np.float64 if kind in ("float", "opt_float") else np.int64))
        if kind == "bool":
            return values.astype(bool)
        if self.masks is None:
            return values
        present = np.concatenate(self.masks) if self.masks else np.zeros(0, bool)
        if len(present) and not present.any():
            return np.full(len(present), None, dtype=object)
        full = np.zeros(len(present), dtype=values.dtype)
        full[present] = values
        if not present.all():
            return np.where(present, full.astype("float64"), np.nan)
        return full

    def copy(self) -> "Column":
        """A copy sharing the chunks (immutable)."""
        out = Column.__new__(Column)
        out.kind, out.delta, out.rows = self.kind, self.delta, self.rows
        out.chunks = list(self.chunks)
        out.masks = None if self.masks is None else list(self.masks)
        out.codes = dict(self.codes)
        return out


def _decode(data: bytes, lengths: np.ndarray) -> list[str]:
    out, start = [], 0
    for n in lengths.tolist():
        out.append(data[start:start + n].decode())
        start += n
    return out


class Table:
    """One event type's rows (module docstring); ``dropped``: fields not kept (their frame
    columns hold None)."""

    def __init__(self, cls: type, dropped: frozenset = frozenset()) -> None:
        self.fields = s.fields_of(cls)
        types = {f.name: f.type for f in msgspec.structs.fields(cls)}
        self._keep = [i for i, f in enumerate(self.fields) if f not in dropped]
        self._cols: list[Optional[Column]] = [
            Column(column_kind(types[f]), delta=f in DELTA_FIELDS) if f not in dropped else None
            for f in self.fields]
        self.pending: list[tuple] = []
        self.rows = 0

    def append(self, ev) -> None:
        self.pending.append(msgspec.structs.astuple(ev))
        self.rows += 1
        if len(self.pending) >= CHUNK_ROWS:
            self.flush()

    def flush(self) -> None:
        """Turn the waiting rows into a chunk of every column."""
        rows = self.pending
        if not rows:
            return
        for i in self._keep:
            col = self._cols[i]
            values = [r[i] for r in rows]
            try:
                col.add(values)
            except _Malformed:
                everything = col.values() + values
                col = self._cols[i] = Column("obj")
                col.add(everything)
        self.pending = []

    @property
    def cols(self) -> list[Optional[Column]]:
        """The columns (None for a field not kept), waiting rows included."""
        self.flush()
        return self._cols

    @property
    def kinds(self) -> list[str]:
        return ["none" if c is None else c.kind for c in self._cols]

    def copy(self) -> "Table":
        """A copy (cheap: the chunks are shared) of every row so far."""
        self.flush()
        out = Table.__new__(Table)
        out.fields, out._keep, out.rows, out.pending = self.fields, self._keep, self.rows, []
        out._cols = [None if c is None else c.copy() for c in self._cols]
        return out

    def frame(self, node: str, shared: Optional[dict] = None):
        """The rows as the doctor's frame (the dtypes pandas gives the same rows read from a
        log: int64 without None, float64 with NaN for a None among numbers, object if all None
        or for strings); ``shared``: one str object per distinct value across the frames built
        with the same dict (a request id appears in four tables)."""
        import pandas as pd

        self.flush()
        data = {}
        for name, col in zip(self.fields, self._cols):
            if col is None:
                data[name] = np.full(self.rows, None, dtype=object)
            elif col.kind == "obj":
                values = col.values()
                data[name] = pd.Series(values, dtype=None if values else "object")
            else:
                data[name] = col.array(shared)
        df = pd.DataFrame(data, columns=list(self.fields))
        df["node"] = node
        return df

    def nbytes(self) -> int:
        """Bytes of the kept chunks' buffers (the waiting rows not counted)."""
        total = 0
        for col in self._cols:
            if col is None or col.kind == "obj":
                continue
            for c in col.chunks:
                if type(c) is tuple:
                    total += (len(c[0]) if type(c[0]) is bytes else 8) + c[1].nbytes
                else:
                    total += c.nbytes
            total += sum(m.nbytes for m in col.masks or ())
        return total
