"""`kvdiag doctor` end to end on logs: exit status, JSON, named requests."""

from __future__ import annotations

import json

from kvdiag.cli import main
from logs_for_tests import clean_log, leak_log


def test_doctor_fails_on_leak_and_names_requests(capsys):
    rc = main(["doctor", leak_log(), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["status"] == "fail"
    rule = {f["rule"]: f for f in out["findings"]}["leak.release_paths"]
    assert rule["status"] == "fail"
    assert sorted(rule["evidence"]["requests"]) == sorted(leaked_requests())


def test_doctor_passes_clean_log(capsys):
    rc = main(["doctor", clean_log(), "--json"])
    out = json.loads(capsys.readouterr().out)
    bad = [f for f in out["findings"] if f["status"] not in ("pass", "n/a")]
    assert rc == 0 and bad == []


def test_doctor_table_output(capsys):
    assert main(["doctor", leak_log()]) == 1
    text = capsys.readouterr().out
    assert "leak.release_paths" in text and "FAIL" in text


def test_doctor_pid_of_no_process(capsys):
    assert main(["doctor", "--pid", "999999999"]) == 2
    assert "no process" in capsys.readouterr().err


def leaked_requests() -> list[str]:
    from logs_for_tests import leaked_request_ids
    return leaked_request_ids()
