"""Events folded into one pandas DataFrame per event type, whose columns are the event's fields
(units in their names) with dtypes taken from the schema; what :func:`kvdiag.events.eventlog.read_log`
returns, and the same for events held in memory."""

from __future__ import annotations

import functools
from typing import Iterable

import msgspec
import numpy as np
import pandas as pd

from kvdiag.events.schema import Event, event_tag, fields_of


def to_frame(cls: type[Event], rows: list[tuple]) -> pd.DataFrame:
    columns = zip(*rows) if rows else [[] for _ in fields_of(cls)]
    return pd.DataFrame({name: column(values, kind)
                         for (name, kind), values in zip(column_kinds(cls).items(), columns)},
                        copy=False)


@functools.cache
def column_kinds(cls: type[Event]) -> dict[str, str]:
    """Each field's column dtype, from the schema: float64 for (optional) floats (null is
    NaN), int64 and bool for required ints and bools, object for the rest (strings, lists,
    optional ints: a 63-bit hash does not survive float64)."""
    kinds = {}
    for f in msgspec.inspect.type_info(cls).fields:
        t = f.type
        types = t.types if isinstance(t, msgspec.inspect.UnionType) else (t,)
        real = [x for x in types if not isinstance(x, msgspec.inspect.NoneType)]
        kind = "object"
        if len(real) == 1 and isinstance(real[0], msgspec.inspect.FloatType):
            kind = "float64"
        elif len(types) == 1 and isinstance(t, msgspec.inspect.IntType):
            kind = "int64"
        elif len(types) == 1 and isinstance(t, msgspec.inspect.BoolType):
            kind = "bool"
        kinds[f.name] = kind
    return kinds


def column(values: tuple, kind: str) -> "np.ndarray | pd.Series":
    """A typed numpy column of ``kind``; an optional int column whose values are all present
    is int64 too. Values come from the reader, which checked their ranges."""
    if kind == "float64":
        return np.fromiter((np.nan if v is None else v for v in values), dtype=np.float64,
                           count=len(values))
    if kind == "object" and values and all(type(v) is int for v in values):
        kind = "int64"
    if kind in ("int64", "bool"):
        return np.fromiter(values, dtype=kind, count=len(values))
    return pd.Series(values, dtype=object)


def events_to_frames(events: Iterable[Event]) -> dict[str, pd.DataFrame]:
    """The DataFrames ``read_log`` would return for these events (for in-memory sinks)."""
    rows: dict[type, list[tuple]] = {}
    for event in events:
        rows.setdefault(type(event), []).append(msgspec.structs.astuple(event))
    return {event_tag(cls): to_frame(cls, r) for cls, r in rows.items()}
