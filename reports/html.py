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
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from kvdiag.reports.model import Absent, Block, Chart, Report, Table, Text

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


def figure(c: Chart) -> go.Figure:
    """The plotly figure of one chart."""
    fig = go.Figure()
    if c.kind == "heatmap":
        fig.add_trace(go.Heatmap(z=c.data.to_numpy(dtype="float64"), x=[str(x) for x in c.data.columns],
                                 y=[str(y) for y in c.data.index], colorscale="Viridis"))
    elif c.kind == "waterfall":
        fig.add_trace(go.Waterfall(x=c.data[c.x].tolist(), y=c.data[c.y].tolist(),
                                   measure=c.data[c.options.get("measure", "measure")].tolist(),
                                   text=[f"{v:,.1f}" for v in c.data[c.y]], textposition="outside"))
    else:
        for name, g in _series(c):
            x, y = g[c.x].tolist(), g[c.y].tolist()
            if c.kind == "line":
                fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers" if len(g) < 60 else "lines", name=name))
            elif c.kind == "scatter":
                fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name=name, marker={"size": 6, "opacity": 0.7}))
            else:  # bar, and histogram from precomputed bins
                fig.add_trace(go.Bar(x=x, y=y, name=name, opacity=0.75 if c.color else 1.0))
        if c.kind == "histogram":
            fig.update_layout(barmode="overlay", bargap=0.02)
    fig.update_layout(template="plotly_white", margin={"l": 60, "r": 20, "t": 40, "b": 50},
                      title={"text": c.title, "font": {"size": 14}}, showlegend=bool(c.color),
                      xaxis_title=c.x_title, yaxis_title=c.y_title, height=420)
    return fig


def _chart(c: Chart, div_id: str) -> str:
    fig = figure(c)
    spec = pio.to_json(fig, validate=False).replace("</", "<\\/")  # no "</script>" inside
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
