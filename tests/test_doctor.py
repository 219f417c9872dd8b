"""`kvdiag doctor` end to end on logs: exit status, JSON, named requests."""

from __future__ import annotations

import json

from kvdiag.cli import main
from logs_for_tests import clean_log, leak_log


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


def test_doctor_table_output(capsys):
    assert main(["doctor", leak_log()]) == 1
    text = capsys.readouterr().out
    assert ("leak.release_paths" in text or "leak.finished_holding" in text) and "FAIL" in text


def test_doctor_pid_of_no_process(capsys):
    assert main(["doctor", "--pid", "999999999"]) == 2
    assert "no process" in capsys.readouterr().err


def release_rule(findings: list[dict]) -> dict:
    """The release-path rule: kvdiag's own, or the leaks analysis's when it is installed."""
    return next(f for f in findings if f["rule"] in ("leak.release_paths", "leak.finished_holding"))


def leaked_requests() -> list[str]:
    from logs_for_tests import leaked_request_ids
    return leaked_request_ids()


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

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.sendall(Path(leak_log()).read_bytes())

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
