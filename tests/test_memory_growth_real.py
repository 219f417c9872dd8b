"""leak.memory_growth on real process memory: a child process that keeps allocating (a leak)
and one that holds steady, their RSS sampled with psutil as a collector would."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from kvdiag import schema as s
from kvdiag.analysis import doctor
from kvdiag.analysis.logs import load
from kvdiag.eventlog import LogWriter, make_header

CHILD = """
import sys, time
import numpy as np
keep = []
step = int(sys.argv[1])
for _ in range(30):
    keep.append(np.ones(step, dtype=np.uint8))  # touched pages: resident
    time.sleep(0.05)
time.sleep(1)
"""


def _record(tmp_path, step_bytes: int):
    log = tmp_path / f"rss{step_bytes}.jsonl"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(step_bytes)])
    proc = psutil.Process(child.pid)
    with LogWriter(log, make_header(engine="test-child")) as w:
        while child.poll() is None:
            try:
                w.record(s.ProcessSample(ts_ns=time.time_ns(), pid=child.pid, rss_bytes=proc.memory_info().rss))
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
    return load([log])[0]


@pytest.mark.parametrize("step_mib,expected", [(16, "fail"), (0, "pass")])
def test_memory_growth_on_real_rss(tmp_path, step_mib, expected):
    logs = _record(tmp_path, step_mib << 20)
    f = doctor.memory_growth(logs)
    assert f.status == expected, f.message
    if expected == "fail":  # the child allocated and touched 30 x 16 MiB: what the rule reports
        assert f.evidence["memory_growth_bytes"] == pytest.approx(30 * 16 * 2**20, rel=0.25)
