"""leak.memory_growth on real process memory: a child process that keeps allocating (a leak)
and one that holds steady, their RSS sampled with psutil as a collector would. The child
allocates only after a steady baseline of samples and holds until a steady tail is sampled.
A log of memory samples alone, with no engine step (model load), is not judged."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from kvdiag.events import schema as s
from kvdiag.diagnosis import leak_rules
from kvdiag.diagnosis.frames import load
from kvdiag.events.eventlog import make_header
from kvdiag.events.log_writer import LogWriter

STEPS = 30

CHILD = """
import sys
import numpy as np
step = int(sys.argv[1])
keep = []
print("ready", flush=True)
for _request in sys.stdin:  # one allocation per request: the recorder samples between them
    keep.append(np.ones(step, dtype=np.uint8))  # touched pages: resident
    print("allocated", flush=True)
"""
BASELINE = TAIL = 30  # samples before the first allocation and after the last


def _record(tmp_path, step_bytes: int):
    """RSS samples of the child: BASELINE steady ones, one after each of its STEPS allocations
    and TAIL steady ones holding everything. The child allocates in lockstep with the sampler, so
    the number of samples in each phase is fixed however loaded the machine is."""
    log = tmp_path / f"rss{step_bytes}.jsonl"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(step_bytes)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    proc = psutil.Process(child.pid)
    rss = []
    with LogWriter(log, make_header(engine="test-child")) as w:

        def sample():
            assert child.poll() is None, "the child exited early"
            s_ = s.ProcessSample(ts_ns=time.time_ns(), pid=child.pid, rss_bytes=proc.memory_info().rss)
            w.record(s_)
            rss.append(s_.rss_bytes)
            time.sleep(0.02)  # the sampling period, as a collector's

        # the child serves from here (growth rules judge only a serving window: model load and
        # the first engine step are warm-up); its "first step" ends before the first sample
        w.record(s.EngineStep(ts_ns=time.time_ns(), step_id=1, phase="decode", batch_size=1,
                              num_tokens=1, duration_ns=0))
        for _ in range(BASELINE):
            sample()
        for _ in range(STEPS):
            child.stdin.write("allocate\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "allocated"
            sample()
        for _ in range(TAIL):
            sample()
    child.stdin.close()
    child.wait()
    return load([log])[0], np.array(rss, dtype="float64")


@pytest.mark.parametrize("step_mib,expected", [(16, "fail"), (0, "pass")])
def test_memory_growth_on_real_rss(tmp_path, step_mib, expected):
    logs, rss = _record(tmp_path, step_mib << 20)
    f = leak_rules.memory_growth(logs)
    assert f.status == expected, f.message
    # the rule's number by its documented definition (median of the last 10% of samples minus
    # the median of the first 10%), recomputed here over the samples this test took
    k = max(2, int(len(rss) * 0.1))
    assert len(rss) == BASELINE + STEPS + TAIL and k <= min(BASELINE, TAIL)  # 10%: steady samples
    assert f.evidence["memory_growth_bytes"] == np.median(rss[-k:]) - np.median(rss[:k])
    # ... and what the child did: it allocated and wrote STEPS x step_mib MiB after the baseline
    assert abs(f.evidence["memory_growth_bytes"] - STEPS * (step_mib << 20)) <= 4 << 20


def test_memory_growth_not_judged_before_the_first_engine_step():
    """Model load: memory samples and no engine step yet: n/a, whatever the memory did."""
    from kvdiag.diagnosis.frames import Logs
    import pandas as pd

    rss = [100 << 20, 600 << 20, 1100 << 20, 1200 << 20, 1300 << 20]
    frame = pd.DataFrame({"ts_ns": [i * 10**9 for i in range(len(rss))], "pid": 1, "rss_bytes": rss,
                          "node": "n"})
    logs = Logs(headers={"n": make_header()}, frames={"process_sample": frame})
    f = leak_rules.memory_growth(logs)
    assert f.status == "n/a" and "no engine step" in f.message
