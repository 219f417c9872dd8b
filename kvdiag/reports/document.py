"""What a report holds, independent of how it is rendered (HTML or markdown).

A report is a list of sections, one per question users ask; a section holds blocks: text,
tables, charts and notes saying which data is absent. A chart carries the DataFrame it plots
and a summary table, which is what the markdown renderer shows in its place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import pandas as pd

ChartKind = Literal["line", "bar", "histogram", "heatmap", "waterfall", "scatter"]


@dataclass
class Text:
    text: str


@dataclass
class Absent:
    """Data this part of the report needs but the logs do not have; ``hint``: how to get it."""

    what: str
    hint: str = ""


@dataclass
class Table:
    title: str
    df: pd.DataFrame
    note: str = ""


@dataclass
class Chart:
    """``kind`` with ``data`` columns ``x``, ``y`` (and ``color`` grouping series).
    heatmap: ``data`` is the matrix (index = y, columns = x). waterfall: x = component,
    y = value, ``measure`` column. histogram: ``data`` holds precomputed bins (x = bin
    centre, y = count). ``table``: the chart's content as a table (markdown)."""

    title: str
    kind: ChartKind
    data: pd.DataFrame
    x: str = ""
    y: str = ""
    color: Optional[str] = None
    x_title: str = ""
    y_title: str = ""
    table: Optional[pd.DataFrame] = None
    options: dict[str, Any] = field(default_factory=dict)


Block = Union[Text, Absent, Table, Chart]


@dataclass
class Section:
    key: str
    title: str
    question: str
    blocks: list[Block] = field(default_factory=list)


@dataclass
class Report:
    title: str
    subtitle: str
    sections: list[Section]
