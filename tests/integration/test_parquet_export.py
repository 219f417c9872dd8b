"""`kvdiag export --parquet`: the recorded logs read back from the Parquet dataset equal the
JSONL path (every frame, every report table); the DuckDB per-node table equals a pandas
computation over the JSONL of several nodes; a folder that is not a dataset is refused."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvdiag.diagnosis.fleet import fleet_table
from kvdiag.diagnosis.frames import load
from kvdiag.events.eventlog import read_log
from kvdiag.reports import sections
from kvdiag.reports.document import Chart, Table, Text

DATA = Path(__file__).parent.parent / "data"
DEMO = DATA / "demo_small" / "demo_24req_seed1.kvlog.gz"
VLLM = DATA / "vllm_demo" / "demo_16req_seed1.kvlog.gz"
RECORDED = pytest.mark.parametrize("log", [DEMO, VLLM], ids=["demo_small", "vllm_demo"])


def kvdiag(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def export(logs, root: Path) -> Path:
    out = kvdiag("export", *logs, "--parquet", root)
    assert out.returncode == 0, out.stderr
    return root


def renamed(log: Path, node: str, folder: Path) -> Path:
    """A copy of ``log`` whose header names another node (events unchanged)."""
    with gzip.open(log, "rb") as f:
        header, rest = f.read().split(b"\n", 1)
    h = json.loads(header)
    h["node"] = node
    out = folder / f"{node}.jsonl"
    out.write_bytes(json.dumps(h).encode() + b"\n" + rest)
    return out


def assert_logs_equal(a, b) -> None:
    assert a.nodes == b.nodes and a.headers == b.headers and a.paths == b.paths
    assert sorted(a.frames) == sorted(b.frames)
    for tag in a.frames:
        key = ["node", "ts_ns"]
        pd.testing.assert_frame_equal(a.frames[tag].sort_values(key, kind="stable"),
                                      b.frames[tag].sort_values(key, kind="stable"), obj=tag)


@RECORDED
def test_every_frame_read_back_from_parquet_equals_the_jsonl_path(log, tmp_path):
    root = export([log], tmp_path / "ds")
    for skip in (frozenset(), frozenset({"block_stored"})):  # all types, and what reports read
        (a, pa_), (b, pb) = load([log], skip=skip), load([root], skip=skip)
        assert pa_ == pb
        assert_logs_equal(a, b)


def _blocks(report):
    for sec in report.sections:
        for block in sec.blocks:
            yield sec.key, block


@RECORDED
def test_every_report_table_from_parquet_equals_the_jsonl_path(log, tmp_path):
    root = export([log, renamed(log, "other", tmp_path)], tmp_path / "ds")
    a, _ = sections.build(load([log, tmp_path / "other.jsonl"])[0])
    b, _ = sections.build(load([root])[0])
    assert a.subtitle == b.subtitle
    pairs = list(zip(_blocks(a), _blocks(b), strict=True))
    tables = 0
    for (key, x), (_, y) in pairs:
        assert type(x) is type(y), key
        if isinstance(x, Table):
            pd.testing.assert_frame_equal(x.df, y.df, obj=f"{key}: {x.title}")
            tables += 1
        elif isinstance(x, Chart):
            pd.testing.assert_frame_equal(x.data, y.data, obj=f"{key}: {x.title}")
            if x.table is not None:
                pd.testing.assert_frame_equal(x.table, y.table, obj=f"{key}: {x.title} (table)")
            tables += 1
        elif isinstance(x, Text):
            assert x.text == y.text
    assert tables >= 10


def pandas_fleet(logs: list[Path], names: list[str]) -> pd.DataFrame:
    """The per-node table computed independently with pandas over the JSONL logs."""
    rows = []
    for path, node in zip(logs, names):
        log = read_log(path)
        kp, fin = log.frame("kv_pool_sample"), log.frame("request_finished")
        fin = fin[fin["status"] == "finished"]
        ttft = fin["ttft_ns"].dropna().to_numpy(dtype="float64")
        info = log.frame("kv_pool_info")
        bs = int(info["block_size_tokens"].iloc[-1]) if len(info) else log.header.block_size_tokens
        slots = kp["blocks_used"] * bs
        held = kp[(kp["blocks_used"] > 0) & (kp["tokens_held"] <= slots)]
        held_slots = held["blocks_used"] * bs
        kp = kp[kp["num_blocks"] > 0]
        rows.append({
            "node": node, "events": len(log),
            "kv_pressure_pct": 100 * (kp["blocks_used"] / kp["num_blocks"]).max() if len(kp) else np.nan,
            "kv_fragmentation_pct": 100 * (held_slots - held["tokens_held"]).sum() / held_slots.sum()
            if len(held) else np.nan,
            "engine_hit_rate_pct": 100 * fin["cached_prompt_tokens"].sum() / fin["prompt_tokens"].sum()
            if fin["prompt_tokens"].sum() else np.nan,
            "ttft_p50_ms": np.quantile(ttft, 0.5) / 1e6 if len(ttft) else np.nan,
            "ttft_p99_ms": np.quantile(ttft, 0.99) / 1e6 if len(ttft) else np.nan,
        })
    df = pd.DataFrame(rows)
    return df.sort_values(["kv_pressure_pct", "ttft_p99_ms", "node"], ascending=[False, False, True],
                          na_position="last", ignore_index=True)


def test_fleet_table_of_several_nodes_equals_pandas_over_the_jsonl(tmp_path):
    names = ["gpu-a", "gpu b/2", "007", "gpu-c"]  # odd names: a space, a slash, digits only
    logs = [renamed(DEMO, names[0], tmp_path), renamed(VLLM, "x", tmp_path),
            renamed(DEMO, "y", tmp_path), renamed(VLLM, "z", tmp_path)]
    for log, name in zip(logs[1:], names[1:]):  # file names without the slash
        h, rest = log.read_bytes().split(b"\n", 1)
        log.write_bytes(json.dumps({**json.loads(h), "node": name}).encode() + b"\n" + rest)
    root = export(logs, tmp_path / "ds")
    got = fleet_table([root])
    want = pandas_fleet(logs, names)
    pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-9)
    assert got["node"].iloc[-1] in ("gpu b/2", "gpu-c")  # vLLM nodes: lower KV pressure, last

    out = kvdiag("doctor", root, "--json")
    assert out.returncode in (0, 1), out.stderr
    doc = json.loads(out.stdout)
    assert [r["node"] for r in doc["fleet"]] == list(want["node"])
    assert sorted(doc["logs"]) == sorted(map(str, logs))

    out = kvdiag("report", root, "-o", tmp_path / "r.md")
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "r.md").read_text()
    assert "Fleet: nodes of the Parquet datasets" in md and "| gpu b/2 |" in md


def test_fleet_report_from_parquet_equals_the_one_from_the_logs_and_pandas(tmp_path):
    """`report --fleet`: DuckDB over the dataset's files and DuckDB over the logs as read give
    the same report; its totals equal pandas over all the logs together, and each node's
    fragmentation is the doctor's fragmentation.kv_pool."""
    from kvdiag.diagnosis.leak_rules import fragmentation
    from kvdiag.diagnosis.fleet import from_datasets, totals
    from kvdiag.diagnosis.frames import load

    names = ["a", "b", "c"]
    logs = [renamed(DEMO, "a", tmp_path), renamed(VLLM, "b", tmp_path), renamed(DEMO, "c", tmp_path)]
    root = export(logs, tmp_path / "ds")
    reports = []
    for name, inputs in (("parquet", [root]), ("logs", logs)):
        out = kvdiag("report", *inputs, "--fleet", "-o", tmp_path / f"{name}.md")
        assert out.returncode == 0, out.stderr
        assert "fleet of 3 node(s)" in out.stdout
        reports.append((tmp_path / f"{name}.md").read_text().split("## Fleet", 1)[1])
    assert reports[0] == reports[1]
    assert "| (fleet) |" in reports[0] and "| a |" in reports[0]

    got = totals(from_datasets([root])).iloc[0]
    frames = [read_log(p) for p in logs]
    fin = pd.concat([f.frame("request_finished") for f in frames])
    fin = fin[fin["status"] == "finished"]
    ttft = fin["ttft_ns"].dropna().to_numpy(dtype="float64")
    per_node = pandas_fleet(logs, names)
    assert got["node"] == "(fleet)" and got["events"] == sum(len(f) for f in frames)
    assert got["kv_pressure_pct"] == pytest.approx(per_node["kv_pressure_pct"].max(), rel=1e-12)
    assert got["engine_hit_rate_pct"] == pytest.approx(
        100 * fin["cached_prompt_tokens"].sum() / fin["prompt_tokens"].sum(), rel=1e-12)
    assert got["ttft_p99_ms"] == pytest.approx(np.quantile(ttft, 0.99) / 1e6, rel=1e-12)
    empty = slots = 0
    for f in frames:
        kp = f.frame("kv_pool_sample")
        s = kp["blocks_used"] * int(f.frame("kv_pool_info")["block_size_tokens"].iloc[-1])
        ok = (kp["blocks_used"] > 0) & (kp["tokens_held"] <= s)
        empty, slots = empty + (s - kp["tokens_held"])[ok].sum(), slots + s[ok].sum()
    assert got["kv_fragmentation_pct"] == pytest.approx(100 * empty / slots, rel=1e-12)

    doctor = {f.evidence.get("node", n): f for n, f in zip(
        names, [fragmentation(load([p])[0])[0] for p in logs])}
    for _, row in per_node.iterrows():
        assert row["kv_fragmentation_pct"] == pytest.approx(100 * doctor[row["node"]].evidence["value"], rel=1e-12)


def test_a_quoted_glob_of_datasets_reads_as_all_their_logs(tmp_path):
    a = export([renamed(DEMO, "n1", tmp_path)], tmp_path / "day1")
    export([renamed(VLLM, "n2", tmp_path), renamed(DEMO, "n1", tmp_path / "day1")], tmp_path / "day2")
    out = kvdiag("doctor", tmp_path / "day*", "--json")
    assert out.returncode in (0, 1), out.stderr
    fleet = json.loads(out.stdout)["fleet"]
    # the merged view renames the second n1 as for logs; the fleet table follows it
    assert sorted(r["node"] for r in fleet) == ["n1", "n1#2", "n2"]
    assert load([a])[0].nodes == ["n1"]


def test_export_keeps_headers_and_skipped_lines(tmp_path):
    log = tmp_path / "bad.jsonl"
    with gzip.open(DEMO, "rb") as f:
        lines = f.read().split(b"\n")
    lines.insert(5, b'{"type": "engine_step", "ts_ns": -1}')
    log.write_bytes(b"\n".join(lines))
    out = kvdiag("export", log, "--parquet", tmp_path / "ds")
    assert out.returncode == 0 and "skipped 1 unreadable line" in out.stderr
    (a, pa_), (b, pb) = load([log]), load([tmp_path / "ds"])
    assert pa_ == pb and len(pb) == 1
    assert b.headers == a.headers and b.bytes_per_token(b.nodes[0]) == 46080
    assert kvdiag("export", log, "--parquet", tmp_path / "ds2", "--strict").returncode == 2


@pytest.mark.parametrize("content", ["empty", "other files", "corrupt headers"])
def test_a_folder_that_is_not_a_dataset_is_a_one_line_error(tmp_path, content):
    d = tmp_path / "d"
    d.mkdir()
    if content == "other files":
        (d / "notes.txt").write_text("hello")
        (d / "type=engine_step").mkdir()
    elif content == "corrupt headers":
        (d / "_headers.parquet").write_bytes(b"PAR1 not really")
    for cmd in (["report", d, "-o", tmp_path / "r.html"], ["doctor", d]):
        out = kvdiag(*cmd)
        assert out.returncode == 2, out
        assert out.stderr.count("\n") == 1 and str(d) in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "r.html").exists()


def test_export_refuses_a_folder_in_use_and_a_folder_as_log(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "x").write_text("")
    out = kvdiag("export", DEMO, "--parquet", tmp_path / "ds")
    assert out.returncode == 2 and "not an empty folder" in out.stderr
    out = kvdiag("export", tmp_path, "--parquet", tmp_path / "new")
    assert out.returncode == 2 and out.stderr.count("\n") == 1


def test_arrow_schema_comes_from_the_event_schema():
    import pyarrow as pa

    from kvdiag.events.columnar import arrow_schema
    from kvdiag.events.schema import TAGS, fields_of
    for tag, cls in TAGS.items():
        assert arrow_schema(cls).names == list(fields_of(cls))
    s = arrow_schema(TAGS["engine_step"])
    assert s.field("duration_ns").type == pa.int64() and s.field("phase").type == pa.string()
    assert arrow_schema(TAGS["block_stored"]).field("token_ids").type == pa.list_(pa.int64())
    em = arrow_schema(TAGS["engine_metrics"])
    assert em.field("histograms").type == pa.string()
    assert em.metadata[b"kvdiag.json_columns"] == b"raw,histograms"
