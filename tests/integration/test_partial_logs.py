"""`kvdiag doctor --partial` on recorded demo logs cut mid-run, as a log still being written is.

A healthy run cut anywhere passes (exit 0, no fail): a cut log judges only what it can (the
requests that finished, pool samples outside prefills, a sharing gap over the same requests)
and says n/a where too little is there. The same log with a leak planted as the demo's
``--inject-leak`` makes it (a finished request whose release path never fires: no
``block_released`` for it), cut the same way, still fails, naming exactly the planted requests
that finished more than the grace period before the cut.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.diagnosis.rules import RELEASE_GRACE_NS

DATA = Path(__file__).parent.parent / "data"
SMALL = DATA / "demo_small" / "demo_24req_seed1.kvlog.gz"  # 25 requests over 443 s
POOL72 = DATA / "demo_preempt" / "demo_16req_pool72.kvlog.gz"  # with shadow sharing results
LEAK_EVERY = 3


def _lines(path: Path) -> list[str]:
    return gzip.open(path, "rt").read().splitlines()


def _cut(lines: list[str], seconds: float, out: Path) -> Path:
    """The log as it stood ``seconds`` after its start, its last line cut in half."""
    start = json.loads(lines[0])["start_ns"]
    keep = [lines[0]] + [ln for ln in lines[1:] if json.loads(ln)["ts_ns"] <= start + seconds * 1e9]
    text = "\n".join(keep) + "\n" + lines[len(keep)][: len(lines[len(keep)]) // 2]
    out.write_text(text)
    return out


def _doctor(log: Path) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "doctor", "--partial", "--json", str(log)],
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, {f["rule"]: f for f in json.loads(proc.stdout)["findings"]}


@pytest.mark.parametrize("log,seconds", [(SMALL, 40), (SMALL, 200), (SMALL, 300), (POOL72, 20), (POOL72, 40)])
def test_a_healthy_log_cut_mid_run_passes(tmp_path, log, seconds):
    rc, findings = _doctor(_cut(_lines(log), seconds, tmp_path / "cut.kvlog"))
    failed = {r: f["message"] for r, f in findings.items() if f["status"] == "fail"}
    assert rc == 0 and not failed, failed
    assert findings["leak.pool_growth"]["status"] in ("pass", "n/a")
    assert findings["sharing.consistency"]["status"] in ("pass", "n/a")


def _plant_leak(lines: list[str]) -> tuple[list[str], dict[str, int]]:
    """Every LEAK_EVERY-th finished request (the first, the fourth, ...) keeps its blocks: its
    ``block_released`` events are gone. Returns the lines and the planted requests' finish times."""
    finished = [json.loads(ln) for ln in lines[1:] if '"request_finished"' in ln]
    planted = {e["request_id"]: e["ts_ns"] for k, e in enumerate(finished) if k % LEAK_EVERY == 0}
    kept = [lines[0]] + [ln for ln in lines[1:] if not ('"block_released"' in ln
                                                        and json.loads(ln)["request_id"] in planted)]
    return kept, planted


@pytest.mark.parametrize("seconds", [40, 300])
def test_a_planted_leak_cut_the_same_way_still_fails(tmp_path, seconds):
    lines, planted = _plant_leak(_lines(SMALL))
    log = _cut(lines, seconds, tmp_path / "leak.kvlog")
    end_ns = max(json.loads(ln)["ts_ns"] for ln in log.read_text().splitlines()[1:-1])
    due = {r for r, ts in planted.items() if ts < end_ns - RELEASE_GRACE_NS}
    assert due  # the cut leaves at least one planted request past its grace period
    rc, findings = _doctor(log)
    assert rc == 1
    leak = findings["leak.release_paths"]
    assert leak["status"] == "fail"
    assert set(leak["evidence"]["requests"]) == due
