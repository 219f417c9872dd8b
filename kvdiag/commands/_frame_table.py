"""Rich tables of analysis frames for the commands that print them (`shadow`, `demo --shadow`)."""

from __future__ import annotations

import math
import os
from typing import Optional

import pandas as pd

# the compression table's columns as both commands print them: frame column -> header
COMPRESSION_COLUMNS = {
    "group": "group", "method": "method", "ratio": "ratio", "k_rel_error": "K err", "v_rel_error": "V err",
    "attn_score_error": "attn TV", "attn_out_rel_error": "out err", "attn_out_rel_error_lo": "95% lo",
    "attn_out_rel_error_hi": "95% hi", "steps": "steps", "encode_us": "enc us", "decode_us": "dec us",
    "seq_len_tokens": "tokens"}


UNWRAPPED_COLUMNS = 240
"""Width of the tables printed to a file or a pipe: wide enough for the widest (the
compression table, 13 columns), so that no cell is folded."""


def table_console():
    """The console the tables print on: a terminal at its own width (or ``COLUMNS``); a file,
    a pipe or a CI log at :data:`UNWRAPPED_COLUMNS`, not at rich's 80, which folds every cell
    of a 13-column table over three lines ("fp1 / 6")."""
    from rich.console import Console

    console = Console()
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(width=UNWRAPPED_COLUMNS)


def cell(v, digits: int = 4) -> str:
    """A table cell: floats to ``digits`` significant digits, a missing value as "-"."""
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.{digits}g}"
    return str(v)


def frame_table(title: str, frame: pd.DataFrame, columns: Optional[dict] = None, digits: int = 4):
    """A rich Table of ``frame``: ``columns`` (frame column -> header) picks and names them,
    else every column under its own name."""
    from rich.table import Table

    columns = columns or {c: str(c) for c in frame.columns}
    t = Table(title=title)
    for header in columns.values():
        t.add_column(header, overflow="fold")
    for row in frame[list(columns)].itertuples(index=False):
        t.add_row(*[cell(v, digits) for v in row])
    return t
