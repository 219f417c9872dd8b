"""Render a :class:`Report` as Markdown: the same sections, charts replaced by their tables."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvdiag.reports.document import Absent, Block, Chart, Report, Table, Text

MAX_ROWS = 60  # a chart's table is cut to this many rows (the HTML has the full chart)


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return ""
    s = f"{v:,.4g}" if isinstance(v, float) and abs(v) < 1e6 else str(v)
    return s.replace("|", "\\|").replace("\n", " ")


def table(df: pd.DataFrame, max_rows: int | None = None) -> str:
    """A GitHub-flavoured Markdown table."""
    if df.empty:
        return "_(empty)_\n"
    shown = df if max_rows is None or len(df) <= max_rows else df.head(max_rows)
    lines = ["| " + " | ".join(_cell(c) for c in df.columns) + " |",
             "|" + "|".join("---" for _ in df.columns) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in rec) + " |" for rec in shown.itertuples(index=False)]
    if len(shown) < len(df):
        lines.append(f"\n_{len(df) - len(shown)} more rows in the HTML report_")
    return "\n".join(lines) + "\n"


def _chart_table(c: Chart) -> pd.DataFrame:
    if c.table is not None:
        return c.table
    if c.kind == "heatmap":
        return c.data.reset_index()
    cols = [k for k in (c.color, c.x, c.y) if k and k in c.data]
    return c.data[cols]


def _block(b: Block) -> str:
    if isinstance(b, Text):
        return b.text + "\n"
    if isinstance(b, Absent):
        return f"> Not in these logs: {b.what}" + (f" — {b.hint}" if b.hint else "") + ".\n"
    if isinstance(b, Table):
        note = f"_{b.note}_\n\n" if b.note else ""
        return f"**{b.title}**\n\n{note}{table(b.df)}"
    return f"**{b.title}** (chart; its data:)\n\n{table(_chart_table(b), MAX_ROWS)}"


def render(report: Report) -> str:
    """The report as one Markdown document."""
    out = [f"# {report.title}\n", f"{report.subtitle}\n"]
    for s in report.sections:
        out.append(f"## {s.title}\n\n_{s.question}_\n")
        out += [_block(b) for b in s.blocks]
    return "\n".join(out)
