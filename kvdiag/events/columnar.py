"""Event frames to and from Arrow tables, with the Arrow schema taken from ``kvdiag/events/schema.py``.

Each event field becomes one column of the same name (units stay in the names): ints int64
(nullable when optional), floats float64 (null for None), bools bool, strings and literals
string, lists of ints list<int64>, lists of floats list<float64>; dicts and tuples (header
extras, phase shares, histograms) are JSON text, decoded back with the field's own type.
``from_table(cls, table)`` gives the frame ``read_log`` gives for the same events: the same
columns, dtypes (``log_frames.column_kinds``) and values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa

from kvdiag.events.log_frames import column_kinds
from kvdiag.events.schema import Event

JSON_COLUMNS_KEY = b"kvdiag.json_columns"
"""Schema metadata: the comma-separated columns that hold JSON text."""


@dataclass(frozen=True)
class Column:
    """One event field as a column: its Arrow type, whether it is JSON text, and the pandas
    kind ``read_log`` gives it (float64, int64, bool or object)."""

    name: str
    arrow: pa.DataType
    json_type: object  # the field's type, to decode its JSON text; None for native columns
    kind: str


def _arrow_type(t) -> pa.DataType | None:
    """The native Arrow type of a msgspec type (None: stored as JSON text)."""
    i = msgspec.inspect
    if isinstance(t, i.UnionType):
        real = [x for x in t.types if not isinstance(x, i.NoneType)]
        return _arrow_type(real[0]) if len(real) == 1 else None
    if isinstance(t, i.IntType):
        return pa.int64()
    if isinstance(t, i.FloatType):
        return pa.float64()
    if isinstance(t, i.BoolType):
        return pa.bool_()
    if isinstance(t, (i.StrType, i.LiteralType)):
        return pa.string()
    if isinstance(t, i.ListType) and isinstance(t.item_type, (i.IntType, i.FloatType)):
        return pa.list_(_arrow_type(t.item_type))
    return None


@functools.cache
def columns(cls: type) -> tuple[Column, ...]:
    """The columns of an event class (or LogHeader), in field order."""
    kinds = column_kinds(cls)
    hints = {f.name: f.type for f in msgspec.structs.fields(cls)}
    out = []
    for f in msgspec.inspect.type_info(cls).fields:
        arrow = _arrow_type(f.type)
        out.append(Column(f.name, arrow or pa.string(), None if arrow else hints[f.name], kinds[f.name]))
    return tuple(out)


@functools.cache
def arrow_schema(cls: type) -> pa.Schema:
    """The Arrow schema of an event class; JSON text columns are named in its metadata."""
    cols = columns(cls)
    json_cols = ",".join(c.name for c in cols if c.json_type is not None)
    return pa.schema([pa.field(c.name, c.arrow) for c in cols], metadata={JSON_COLUMNS_KEY: json_cols})


def to_table(cls: type[Event], df: pd.DataFrame) -> pa.Table:
    """A frame of ``cls`` events (``read_log``'s columns; others are dropped) as an Arrow table."""
    arrays = []
    for c in columns(cls):
        values = df[c.name]
        if c.json_type is not None:
            enc = msgspec.json.encode
            arrays.append(pa.array([None if v is None else enc(v).decode() for v in values],
                                   type=pa.string()))
        elif values.dtype != object:
            arrays.append(pa.array(values.to_numpy(), type=c.arrow, from_pandas=True))
        else:
            arrays.append(pa.array(values.tolist(), type=c.arrow, from_pandas=True))
    return pa.Table.from_arrays(arrays, schema=arrow_schema(cls))


def _series(c: Column, col: pa.ChunkedArray) -> "np.ndarray | pd.Series":
    """One column as ``log_frames.column`` makes it from the same values."""
    if c.kind in ("float64", "int64", "bool"):
        return col.to_numpy().astype(c.kind, copy=False)
    if c.json_type is not None:
        dec = msgspec.json.Decoder(c.json_type)
        return pd.Series([None if v is None else dec.decode(v) for v in col.to_pylist()], dtype=object)
    if pa.types.is_integer(col.type) and col.null_count == 0 and len(col):
        return col.to_numpy()  # an optional int column with every value present: int64
    return pd.Series(col.to_pylist(), dtype=object)


def from_table(cls: type[Event], table: pa.Table) -> pd.DataFrame:
    """The frame ``read_log`` would give for the events in ``table`` (extra columns, such as
    hive partition keys, are ignored)."""
    return pd.DataFrame({c.name: _series(c, table.column(c.name)) for c in columns(cls)}, copy=False)
