"""`kvdiag doctor` end to end on logs: exit status, JSON, named requests."""

from __future__ import annotations

import json

import pytest

from kvdiag.cli import main
from logs_for_tests import clean_log, leak_log


@pytest.mark.model
def test_doctor_fails_on_leak_and_names_requests(capsys):
    rc = main(["doctor", leak_log(), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["status"] == "fail"
    rule = release_rule(out["findings"])
    assert rule["status"] == "fail"
    assert sorted(rule["evidence"]["requests"]) == sorted(leaked_requests())


def test_doctor_passes_clean_log(capsys):
    rc = main(["doctor", clean_log(), "--json"])
    out = json.loads(capsys.readouterr().out)
    bad = [f for f in out["findings"] if f["status"] not in ("pass", "n/a")]
    assert rc == 0 and bad == []


@pytest.mark.model
def test_doctor_table_output(capsys):
    assert main(["doctor", leak_log()]) == 1
    text = capsys.readouterr().out
    assert "leak.release_paths" in text and "FAIL" in text


def test_doctor_pid_of_no_process(capsys):
    assert main(["doctor", "--pid", "999999999"]) == 2
    assert "no process" in capsys.readouterr().err


def release_rule(findings: list[dict]) -> dict:
    """The release-path rule (kvdiag's own check, or the leaks analysis's when installed)."""
    return next(f for f in findings if f["rule"] == "leak.release_paths")


def leaked_requests() -> list[str]:
    from logs_for_tests import leaked_request_ids
    ids = leaked_request_ids()
    assert len(ids) == 3  # 6 requests, every 2nd leaks: the run itself worked
    return ids


@pytest.mark.model
def test_doctor_pid_reads_the_agent_stream(tmp_path, capsys):
    """A stand-in agent serving the documented stream (header line, then event lines) of the
    leak log on a Unix socket: doctor --pid records it and fails the release-path rule."""
    import os
    import socket
    import threading
    from pathlib import Path
    path = tmp_path / "agent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    stream = Path(leak_log()).read_bytes()  # before doctor's 5 s window opens (a real model run)

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.sendall(stream)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    rc = main(["doctor", "--pid", str(os.getpid()), "--socket", str(path), "--seconds", "5", "--json"])
    t.join(5)
    server.close()
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert release_rule(out["findings"])["status"] == "fail"


def test_doctor_pid_without_agent(tmp_path, capsys):
    import os
    assert main(["doctor", "--pid", str(os.getpid()), "--socket", str(tmp_path / "none.sock")]) == 2
    assert "cannot reach a kvdiag agent" in capsys.readouterr().err


def test_forecast_matches_a_per_request_loop():
    """forecast_frame's vectorised sums against a plain loop over requests at every sample
    (active: first scheduled <= t < finished; prefix hits count from the moment they happen)."""
    import math

    import numpy as np

    from kvdiag.diagnosis.pressure_rules import forecast_frame
    from kvdiag.diagnosis.frames import load
    logs, _ = load([clean_log()])
    fc = forecast_frame(logs)
    node = logs.nodes[0]
    bs = logs.block_size_tokens(node)
    arr = logs.frame("request_arrived").drop_duplicates("request_id").set_index("request_id")
    fin = logs.frame("request_finished").drop_duplicates("request_id", keep="last").set_index("request_id")
    hits = logs.frame("prefix_hit")
    alloc = logs.frame("block_allocated")
    scheduled = logs.frame("request_scheduled").groupby("request_id")["ts_ns"].min()
    assert len(scheduled) == len(arr)
    p90 = float(np.quantile(fin["output_tokens"], 0.9))
    for row in fc.sample(min(len(fc), 40), random_state=0).itertuples():
        need = 0.0
        for rid, a in arr.iterrows():
            done = rid in fin.index and fin.loc[rid, "ts_ns"] <= row.ts_ns
            if scheduled[rid] > row.ts_ns or done:
                continue
            out = a["max_new_tokens"] if a["max_new_tokens"] is not None and not pd_isna(a["max_new_tokens"]) else p90
            hits_so_far = int(((hits["request_id"] == rid) & (hits["ts_ns"] <= row.ts_ns)).sum())
            expected = math.ceil((a["prompt_tokens"] + out) / bs) - hits_so_far
            held = int(((alloc["request_id"] == rid) & (alloc["ts_ns"] <= row.ts_ns)).sum())
            need += expected - held
        assert row.needed_blocks == max(need, 0)


def pd_isna(x) -> bool:
    import pandas as pd
    return bool(pd.isna(x))


def test_baseline_comparison_flags_slower_steps(tmp_path, capsys):
    """CONSTRUCTED: the same traffic with every step and token 1.3x slower, against the
    normal traffic as --baseline: the step P99 regression is flagged."""
    import constructed as C
    slow = C.write(tmp_path / "slow.jsonl", C.events(n_requests=120, slow_from=0))
    normal = str(C.write(tmp_path / "normal.jsonl", C.events(n_requests=120)))
    rc = main(["doctor", str(slow), "--baseline", normal, "--json"])
    out = json.loads(capsys.readouterr().out)
    comps = {c["metric"]: c for f in out["findings"] if f["rule"] == "p99.regression"
             for c in f["evidence"]["comparisons"]}
    assert rc == 1 and comps["step"]["flagged"]
    assert 0.2 < comps["step"]["change"] < 0.45
    assert main(["report", str(slow), "--baseline", normal, "-o", str(tmp_path / "r.md")]) == 0
    assert "against the baseline log" in (tmp_path / "r.md").read_text()


def test_memory_pressure_without_a_known_need_is_na_not_an_error(monkeypatch):
    """Pool samples whose need or free blocks are unknown (NaN: seen on a 2-second doctor --pid
    window, where pandas raised ValueError from idxmax and doctor died with a traceback) judge
    nothing: n/a; a known moment among them is still judged."""
    import numpy as np
    import pandas as pd
    from kvdiag.diagnosis import pressure_rules

    def frame(ratios):
        n = len(ratios)
        return pd.DataFrame({"ts_ns": np.arange(n), "node": "n", "active_requests": 1.0,
                             "needed_blocks": 10.0, "free_blocks": 5.0, "growth_blocks_per_s": 0.0,
                             "need_ratio": ratios, "time_to_full_s": np.inf})

    monkeypatch.setattr(pressure_rules, "forecast_frame", lambda logs: frame([np.nan, np.nan]))
    f = pressure_rules.memory_pressure(None)
    assert f.status == "n/a" and "of 2 samples" in f.message
    monkeypatch.setattr(pressure_rules, "forecast_frame", lambda logs: frame([np.nan, 2.0]))
    assert pressure_rules.memory_pressure(None).status == "fail"
