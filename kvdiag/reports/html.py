"""Render a :class:`Report` as one self-contained HTML file.

plotly.js is embedded once, in the head, from the installed plotly package; figures are
plain ``Plotly.newPlot`` calls on their divs. Nothing is fetched from the network, so the file
opens offline from disk.
"""

from __future__ import annotations

import html
import json

import numpy as np
import pandas as pd
from plotly.offline import get_plotlyjs

from kvdiag.reports.document import Absent, Block, Chart, Report, Table, Text

_CONFIG = {"displaylogo": False, "responsive": True, "showLink": False, "showEditInChartStudio": False}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1f2933;background:#f7f9fb}
header{background:#1f2933;color:#fff;padding:18px 32px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#cbd2d9;font-size:13px}
nav{padding:8px 32px;background:#e4e7eb;font-size:13px}nav a{margin-right:14px;color:#1f2933}
main{padding:8px 32px 40px;max-width:1400px}
section{background:#fff;border:1px solid #e4e7eb;border-radius:6px;padding:12px 20px;margin:18px 0}
h2{margin:6px 0 2px;font-size:19px}.question{color:#616e7c;margin:0 0 10px;font-style:italic}
h3{font-size:15px;margin:14px 0 6px}
table{border-collapse:collapse;font-size:12px;margin:4px 0 10px;display:block;overflow-x:auto;max-height:520px}
th,td{border:1px solid #e4e7eb;padding:3px 7px;text-align:right;white-space:nowrap}
th{background:#f0f4f8;position:sticky;top:0}td.t{text-align:left;white-space:normal;min-width:120px}
.absent{background:#fffbea;border-left:4px solid #f0b429;padding:6px 10px;margin:8px 0;font-size:13px}
.note{color:#616e7c;font-size:12px}.chart{width:100%;height:420px}
.FAIL{color:#fff;background:#cf1124;font-weight:bold}.WARN{background:#f0b429;font-weight:bold}
.PASS{color:#fff;background:#3e7c17}.N\\/A{color:#616e7c}
"""


def _table(t: Table) -> str:
    df = t.df
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    rows = []
    for rec in df.itertuples(index=False):
        cells = []
        for v in rec:
            s = "" if v is None or (isinstance(v, float) and np.isnan(v)) else (
                f"{v:,.4g}" if isinstance(v, float) and abs(v) < 1e6 else str(v))
            cls = s if s in ("FAIL", "WARN", "PASS", "N/A", "REGRESSION") else (
                "t" if isinstance(v, str) else "")
            if s == "REGRESSION":
                cls = "FAIL"
            cells.append(f'<td class="{cls}">{html.escape(s)}</td>' if cls else f"<td>{html.escape(s)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    note = f'<p class="note">{html.escape(t.note)}</p>' if t.note else ""
    return f"<h3>{html.escape(t.title)}</h3>{note}<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _series(c: Chart) -> list[tuple[str, pd.DataFrame]]:
    if c.color and c.color in c.data:
        return [(str(k), g) for k, g in c.data.groupby(c.color, sort=False)]
    return [("", c.data)]


def _values(s) -> list:
    """A JSON-ready list: numpy scalars as Python numbers, NaN as null."""
    arr = pd.Series(s)
    if arr.dtype.kind in "fiub":
        a = arr.to_numpy(dtype="float64")
        return [None if not np.isfinite(v) else (int(v) if v.is_integer() and arr.dtype.kind in "iub" else float(v))
                for v in a]
    return [None if v is None or (isinstance(v, float) and np.isnan(v)) else str(v) for v in arr]


_AXIS = {"gridcolor": "#e4e7eb", "zerolinecolor": "#cbd2d9", "automargin": True}


def figure(c: Chart) -> dict:
    """The plotly figure of one chart, as the plain dict Plotly.newPlot takes (built directly:
    plotly's validated Figure objects cost seconds per report)."""
    data: list[dict] = []
    if c.kind == "heatmap":
        z = c.data.to_numpy(dtype="float64")
        data.append({"type": "heatmap", "colorscale": "Viridis",
                     "z": [_values(row) for row in z],
                     "x": [str(x) for x in c.data.columns], "y": [str(y) for y in c.data.index]})
    elif c.kind == "waterfall":
        data.append({"type": "waterfall", "x": _values(c.data[c.x]), "y": _values(c.data[c.y]),
                     "measure": _values(c.data[c.options.get("measure", "measure")]),
                     "text": [f"{v:,.1f}" for v in c.data[c.y]], "textposition": "outside"})
    else:
        for name, g in _series(c):
            t: dict = {"x": _values(g[c.x]), "y": _values(g[c.y]), "name": name}
            if c.kind == "line":
                t.update(type="scatter", mode="lines+markers" if len(g) < 60 else "lines")
            elif c.kind == "scatter":
                t.update(type="scatter", mode="markers", marker={"size": 6, "opacity": 0.7})
            else:  # bar, and histogram from precomputed bins
                t.update(type="bar", opacity=0.75 if c.color else 1.0)
            data.append(t)
    layout = {"title": {"text": c.title, "font": {"size": 14}}, "height": 420,
              "margin": {"l": 60, "r": 20, "t": 40, "b": 50}, "showlegend": bool(c.color),
              "paper_bgcolor": "white", "plot_bgcolor": "white", "font": {"color": "#1f2933"},
              "xaxis": {"title": {"text": c.x_title}, **_AXIS},
              "yaxis": {"title": {"text": c.y_title}, **_AXIS}}
    if c.kind == "histogram":
        layout.update(barmode="overlay", bargap=0.02)
    return {"data": data, "layout": layout}


def _chart(c: Chart, div_id: str) -> str:
    spec = json.dumps(figure(c), separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return (f'<div id="{div_id}" class="chart plotly-graph-div"></div>'
            f'<script>(function(f){{Plotly.newPlot("{div_id}",f.data,f.layout,'
            f'{json.dumps(_CONFIG)});}})({spec});</script>')


def _block(b: Block, div_id: str) -> str:
    if isinstance(b, Text):
        return f"<p>{html.escape(b.text)}</p>"
    if isinstance(b, Absent):
        hint = f" — {html.escape(b.hint)}" if b.hint else ""
        return f'<div class="absent">Not in these logs: {html.escape(b.what)}{hint}.</div>'
    if isinstance(b, Table):
        return _table(b)
    return _chart(b, div_id)


def render(report: Report) -> str:
    """The report as one HTML document."""
    nav = "".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in report.sections)
    body, n = [], 0
    for s in report.sections:
        parts = []
        for b in s.blocks:
            n += 1
            parts.append(_block(b, f"fig{n}"))
        body.append(f'<section id="{s.key}"><h2>{html.escape(s.title)}</h2>'
                    f'<p class="question">{html.escape(s.question)}</p>{"".join(parts)}</section>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(report.title)}</title><style>{_CSS}</style>"
            f'<script type="text/javascript">{get_plotlyjs()}</script></head><body>'
            f"<header><h1>{html.escape(report.title)}</h1><p>{html.escape(report.subtitle)}</p></header>"
            f"<nav>{nav}</nav><main>{''.join(body)}</main></body></html>")
