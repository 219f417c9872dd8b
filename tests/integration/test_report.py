"""`kvdiag report` end to end: HTML rendered by headless Chromium, Markdown, merge of several
logs, bad input, atomic output."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import browser
from logs_for_tests import clean_log, read_bytes, second_log

CLI = [sys.executable, "-m", "kvdiag"]


def kvdiag(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


class _Attrs(HTMLParser):
    """Every URL-bearing attribute of every element (script bodies are not elements)."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.scripts_with_src = 0

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("src", "href", "action", "data", "poster", "srcset", "formaction") and v:
                self.urls.append(v)
        if tag == "script" and dict(attrs).get("src"):
            self.scripts_with_src += 1


@pytest.fixture(scope="module")
def html_report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("r") / "report.html"
    r = kvdiag("report", clean_log(), "-o", out)
    assert r.returncode == 0, r.stderr
    return out


def test_html_is_self_contained(html_report):
    text = html_report.read_text()
    p = _Attrs()
    p.feed(text)
    remote = [u for u in p.urls if re.match(r"^\s*(https?:)?//", u)]
    assert remote == [] and p.scripts_with_src == 0
    assert text.count("<script type=\"text/javascript\">") == 1  # plotly.js embedded once
    assert len(re.findall(r"Plotly\.newPlot", text)) == text.count('class="chart plotly-graph-div"')


@pytest.mark.skipif(not browser.available(), reason="Debian's chromium is not installed")
def test_html_renders_in_chromium(html_report, tmp_path):
    dom, console = browser.dump_dom(html_report)
    assert console == [], console
    divs = re.split(r'(?=<div id="fig\d+" class="chart plotly-graph-div)', dom)[1:]
    expected = html_report.read_text().count('class="chart plotly-graph-div"')
    assert expected >= 8 and len(divs) == expected
    for d in divs:
        fig = d[:d.find("</svg>", d.find('class="main-svg"')) + 6]
        assert 'class="main-svg"' in fig, fig[:200]
        # a non-empty plot: at least one trace or heatmap image was drawn
        assert re.search(r'class="(trace|hm|waterfall|bars|scatterlayer)', fig), fig[:300]
    shot = browser.screenshot(html_report, Path(os.environ.get("KVDIAG_SCREENSHOT_DIR", tmp_path)) / "report.png")
    assert shot.exists() and shot.stat().st_size > 20_000


def test_markdown_has_the_same_sections(html_report, tmp_path):
    md = tmp_path / "r.md"
    r = kvdiag("report", clean_log(), "--format", "md", "-o", md)
    assert r.returncode == 0, r.stderr
    text, html = md.read_text(), html_report.read_text()
    titles = re.findall(r"<h2>(.*?)</h2>", html)
    assert titles == re.findall(r"^## (.*)$", text, re.M)
    for table_title in re.findall(r"<h3>(.*?)</h3>", html):
        assert f"**{table_title.replace('&#x27;', chr(39)).replace('&lt;', '<').replace('&gt;', '>').replace('&amp;', '&')}**" in text


def test_several_logs_merge_with_node_column(tmp_path):
    md = tmp_path / "two.md"
    logs = (clean_log(), second_log(tmp_path))
    r = kvdiag("report", *logs, "-o", md)
    assert r.returncode == 0, r.stderr
    text = md.read_text()
    assert "2 node(s)" in text
    nodes = re.search(r"2 node\(s\): ([^;]+);", text).group(1).split(", ")
    per_node = text[text.index("**Per node**"):]
    for node, log in zip(nodes, logs):
        finished = read_bytes(log).decode().count('"type":"request_finished"')
        assert re.search(rf"^\| {re.escape(node)} \| {finished} \|", per_node, re.M), (node, finished)


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    good = read_bytes(clean_log())
    lines = good.split(b"\n")
    bad = {
        "empty": b"",
        "other format": b"ts,value\n1,2\n3,4\n",
        "json array": b'[{"type": "request_arrived"}]\n',
        "header only": lines[0] + b"\n",
        "truncated": b"\n".join(lines[:40]) + b"\n" + lines[40][: len(lines[40]) // 2],
    }
    out = {k: tmp_path / f"{k.replace(' ', '_')}.jsonl" for k in bad}
    for k, data in bad.items():
        out[k].write_bytes(data)
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(good)[:-2000])
    out["truncated gzip"] = gz
    out["missing"] = tmp_path / "nope.jsonl"
    return out


@pytest.mark.parametrize("kind", ["empty", "other format", "json array", "header only", "truncated",
                                  "truncated gzip", "missing"])
@pytest.mark.parametrize("command", ["report", "doctor"])
def test_bad_input_clear_error_no_output(tmp_path, kind, command, capsys):
    from kvdiag.cli import main
    path = _bad_inputs(tmp_path)[kind]
    out = tmp_path / "out" / "report.html"
    out.parent.mkdir()
    out.write_text("previous report")
    args = ["report", path, "-o", out] if command == "report" else ["doctor", path]
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    msg = err.strip().splitlines()
    assert len(msg) == 1
    assert str(path) in msg[0]  # the message names the file, whatever is wrong with it
    assert ("no such file" if kind == "missing" else "expected") in msg[0], msg[0]
    assert out.read_text() == "previous report"
    assert os.listdir(out.parent) == ["report.html"]


def test_partial_accepts_a_cut_log(tmp_path):
    path = _bad_inputs(tmp_path)["truncated"]
    r = kvdiag("report", path, "--partial", "-o", tmp_path / "p.md")
    assert r.returncode == 0, r.stderr


def test_write_atomic_keeps_old_file_on_failure(tmp_path, monkeypatch):
    from kvdiag.commands import _logs
    target = tmp_path / "r.html"
    target.write_text("old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(_logs.os, "fsync", boom)
    with pytest.raises(OSError):
        _logs.write_atomic(target, "new" * 1000)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["r.html"]


def test_sparse_log_says_what_is_absent(tmp_path, capsys):
    """A log holding only a collector status: every analysis section says its data is absent."""
    from kvdiag.events import schema as s
    from kvdiag.cli import main
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    log = tmp_path / "sparse.jsonl"
    with LogWriter(log, make_header()) as w:
        w.record(s.CollectorStatus(ts_ns=1, collector="nvml", available=False, hint="no GPU"))
    assert main(["report", str(log), "-o", str(tmp_path / "r.md")]) == 0
    text = (tmp_path / "r.md").read_text()
    for section in ("Memory over time", "Prefix sharing", "KV compression", "Differential KV writes",
                    "Attention locality",
                    "Latency and P99 regressions", "Requests"):
        body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
        assert "Not in these logs" in body, section
    assert main(["doctor", str(log)]) == 0


def test_thinning_keeps_peaks_and_order():
    import numpy as np
    import pandas as pd

    from kvdiag.reports.shaping import thin as _thin
    rng = np.random.default_rng(0)
    y = rng.normal(size=200_000)
    y[123_457] = 50.0  # a one-sample spike (an OOM-like peak)
    df = pd.DataFrame({"t": np.arange(len(y)), "y": y, "s": "a"})
    thin = _thin(df, "s", "y", n=1000)
    assert len(thin) <= 1000 and thin["y"].max() == 50.0 and thin["y"].min() == y.min()
    assert thin["t"].is_monotonic_increasing
