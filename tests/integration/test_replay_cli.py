"""`kvdiag replay` end to end on the public Mooncake trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.simulation.sharing import simulate
from kvdiag.traces.loaders import load_trace
from kvdiag.cli import main

MOONCAKE = Path(__file__).parent.parent / "data" / "mooncake" / "synthetic_trace.jsonl"
KEYS = ["policy", "capacity_blocks", "block_hit_rate", "token_hit_rate", "request_hit_rate",
        "requests", "block_refs", "distinct_blocks", "bytes_saved"]


def _json(capsys, *argv):
    """The rows of `kvdiag replay --json` (checking the object around them)."""
    assert main(["replay", str(MOONCAKE), "--json", *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["skipped_lines"] == {"count": 0, "first": []}
    assert (out["requests"], out["block_refs"], out["distinct_blocks"]) == _raw_counts()
    assert out["format"] == "mooncake" and out["block_size_tokens"] == 512
    return out["rows"]


def test_json_rows_per_policy_and_capacity(capsys):
    rows = _json(capsys, "--policy", "lru", "--policy", "s3fifo", "--capacity", "3000",
                 "--capacity", "unbounded", "--bytes-per-token", "46080")
    assert [(r["policy"], r["capacity_blocks"]) for r in rows] == [
        ("lru", 3000), ("lru", None), ("s3fifo", 3000), ("s3fifo", None)]
    trace = load_trace(MOONCAKE)
    for row in rows:
        assert list(row) == KEYS
        run = simulate(trace, row["policy"], row["capacity_blocks"])
        assert row["block_hit_rate"] == run.block_hit_rate
        assert row["bytes_saved"] == run.hit_tokens * 46080
        assert (row["requests"], row["block_refs"], row["distinct_blocks"]) == _raw_counts()


def _raw_counts() -> tuple[int, int, int]:
    """Requests, block references and distinct blocks counted straight from the JSONL."""
    lines = [json.loads(line) for line in MOONCAKE.read_text().splitlines() if line.strip()]
    ids = [b for req in lines for b in req["hash_ids"]]
    return len(lines), len(ids), len(set(ids))


def test_capacity_in_bytes_is_whole_blocks(capsys):
    # 512-token blocks of 46,080 B/token: 1 GiB holds 45 blocks
    rows = _json(capsys, "--capacity", "1GiB", "--bytes-per-token", "46080")
    assert rows[0]["capacity_blocks"] == 2**30 // (512 * 46080) == 45


def test_curve_points_equal_per_capacity_runs(capsys):
    rows = _json(capsys, "--curve", "--policy", "lru", "--policy", "opt")
    trace = load_trace(MOONCAKE)
    lru = [r for r in rows if r["policy"] == "lru"]
    assert len(lru) > 10 and lru[-1]["capacity_blocks"] == trace.num_blocks
    for row in lru[::5] + [r for r in rows if r["policy"] == "opt"][-2:]:
        run = simulate(trace, row["policy"], row["capacity_blocks"])
        assert row["token_hit_rate"] == pytest.approx(run.token_hit_rate, abs=1e-12)


def test_streamed_curve_equals_per_capacity_runs(capsys):
    rows = _json(capsys, "--curve", "--capacity", "0", "--capacity", "777", "--capacity", "50000")
    trace = load_trace(MOONCAKE)
    assert [r["capacity_blocks"] for r in rows] == [0, 777, 50000]
    for row in rows:
        run = simulate(trace, "lru", row["capacity_blocks"])
        assert row["block_hit_rate"] == pytest.approx(run.block_hit_rate, abs=1e-12)
        assert row["request_hit_rate"] == pytest.approx(run.request_hit_rate, abs=1e-12)


def test_table_and_help_define_the_rates(capsys):
    assert main(["replay", str(MOONCAKE), "--capacity", "5000"]) == 0
    out = capsys.readouterr().out
    assert "lru" in out and "5000" in out and "memory held by live requests" in out
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "replay", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert "token hit rate   = hit tokens / prompt tokens" in proc.stdout


def test_bad_trace_one_line_error_no_traceback(tmp_path):
    """A bad line is skipped and named; with --strict it is a one-line error (exit 2)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1], "input_length": 10, "timestamp": 0}\n{"hash_ids": [2]}\n')
    out = tmp_path / "out.json"
    proc = subprocess.run(f"{sys.executable} -m kvdiag replay {bad} --json --strict > {out}",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    why = "timestamp: expected a value, found the field missing"  # input_length is missing too
    assert proc.stderr.strip() == f"{bad}:2: {why}"
    assert out.read_text() == ""
    proc = subprocess.run(f"{sys.executable} -m kvdiag replay {bad} --json > {out}", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"kvdiag replay: skipped 1 unreadable line(s); {bad}:2: {why}"
    got = json.loads(out.read_text())
    assert got["requests"] == 1 and got["skipped_lines"] == {"count": 1,
                                                             "first": [f"{bad}:2: {why}"]}
