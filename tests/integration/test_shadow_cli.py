"""`kvdiag shadow` end to end on the real model: JSON tables, a readable event log, and a
one-line error for a bad method name."""

import pytest
import json
import subprocess
import sys

from kvdiag.events.eventlog import read_log

from kv_model import model_and_tokenizer

pytestmark = pytest.mark.model


def _kvdiag(*args):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, timeout=600)


def test_bad_method_is_one_line_error():
    out = _kvdiag("shadow", "--methods", "int5")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "unknown method 'int5'" in out.stderr
    assert "Traceback" not in out.stderr


def test_shadow_command_end_to_end(tmp_path):
    model_and_tokenizer()  # the model is fetched into the kvdiag cache first
    log = tmp_path / "shadow.kvlog"
    out = _kvdiag("shadow", "--prompts", "1", "--max-new-tokens", "4", "--sample-rate", "1",
                  "--methods", "int8,int4,streaming", "--log", str(log), "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["shadow_runs"] == 3 and result["shadow_errors"] == {}
    groups = {(r["group"], r["method"]) for r in result["table"]}
    assert groups == {(g, m) for g in ("1-6", "7-12", "13+") for m in ("int8", "int4", "streaming")}
    assert [r["group"] for r in result["recommendation"]] == ["1-6", "7-12", "13+"]
    assert 0 < result["locality"]["recent_mass"] < 1
    events = read_log(log)
    comp = events.frame("shadow_compression")
    assert len(comp) == 3 * 30 * 3 * 3  # runs x layers x kv heads x methods
    assert len(events.frame("shadow_locality")) == 3 * 30 * 9
    assert not events.problems
