"""The event log: round trips, drops as gaps, bad lines, versions, and kill -9."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest

from kvdiag.events.eventlog import LogFormatError, iter_events, make_header, read_header, read_log
from kvdiag.events.log_writer import LogWriter
from kvdiag.events.schema import (
    SCHEMA_MAJOR,
    BlockStored,
    EngineStep,
    RequestArrived,
    RequestFinished,
    ShadowLocality,
)


def _steps(n, start=0):
    return [EngineStep(ts_ns=start + i, step_id=start + i, phase="decode", batch_size=4,
                       num_tokens=4, duration_ns=1000 + i) for i in range(n)]


@pytest.mark.parametrize("name", ["a.kvlog", "a.kvlog.gz"])
def test_round_trip_keeps_every_field(tmp_path, name):
    path = tmp_path / name
    events = _steps(100) + [
        RequestArrived(ts_ns=5, request_id="r1", prompt_tokens=3, token_ids=[1, 2, 3]),
        RequestFinished(ts_ns=9, request_id="r1", prompt_tokens=3, output_tokens=7,
                        cached_prompt_tokens=2, e2e_ns=4),
        BlockStored(ts_ns=7, block_id=3, block_hash=2**62 + 5, parent_hash=None, num_tokens=32),
        ShadowLocality(ts_ns=8, layer=1, head=2, seq_len_tokens=10, recent_mass=0.5,
                       sink_mass=0.25, other_mass=0.25, entropy_nats=1.0,
                       distance_hist=[0.5, 0.5]),
    ]
    with LogWriter(path, make_header(engine="test", block_size_tokens=32)) as writer:
        for event in events:
            writer.record(event)
    assert list(iter_events(path)) == events
    log = read_log(path)
    assert log.header.engine == "test" and log.header.block_size_tokens == 32
    steps = log.frame(EngineStep)
    assert steps["duration_ns"].tolist() == [1000 + i for i in range(100)]
    assert log.frame("request_arrived")["token_ids"].iloc[0] == [1, 2, 3]
    assert log.frame("block_stored")["block_hash"].iloc[0] == 2**62 + 5
    assert "cached_prompt_tokens" in log.frame("request_finished").columns
    assert log.frame("kv_pool_sample").empty and "blocks_used" in log.frame("kv_pool_sample")
    assert log.problems == []


def test_full_queue_drops_are_counted_as_a_gap(tmp_path):
    path = tmp_path / "drops.kvlog"
    writer = LogWriter(path, make_header(), interval_s=3600, max_queue=10)
    for event in _steps(25):
        writer.record(event)
    writer.close()
    log = read_log(path)
    assert len(log.frame("engine_step")) == 10
    gap = log.frame("collector_gap")
    assert gap["dropped_events"].tolist() == [15]
    assert gap["collector"].tolist() == ["eventlog"]


def test_bad_lines_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "bad.kvlog"
    with LogWriter(path, make_header()) as writer:
        for event in _steps(3):
            writer.record(event)
    with open(path, "ab") as f:
        f.write(b'{"type":"engine_step","step_id":"x"}\n')  # line 5: wrong field type
        f.write(b"not json\n")  # line 6
        f.write(msgspec.json.encode(_steps(1, 50)[0]) + b"\n")
    log = read_log(path)
    assert len(log.frame(EngineStep)) == 4
    assert [p.split(": ")[0] for p in log.problems] == [f"{path}:5", f"{path}:6"]
    assert log.problems[0].endswith(": engine_step.step_id: expected int, got str")
    assert log.problems[1].endswith(": expected a kvdiag event line (JSON is malformed: invalid character (byte 4))")
    with pytest.raises(LogFormatError, match=r"bad\.kvlog:5: engine_step.step_id: expected"):
        read_log(path, strict=True)


def test_unknown_event_types_and_fields_from_newer_minor_versions_load(tmp_path):
    path = tmp_path / "newer.kvlog"
    header = json.loads(msgspec.json.encode(make_header()))
    header["schema_version"] = f"{SCHEMA_MAJOR}.99"
    step = json.loads(msgspec.json.encode(_steps(1)[0]))
    step["new_field_ns"] = 5
    path.write_text("\n".join(json.dumps(x) for x in [
        header, step, {"type": "something_new", "ts_ns": 1}]) + "\n")
    log = read_log(path, strict=True)
    assert len(log.frame(EngineStep)) == 1
    assert log.unknown_types == {"something_new": 1}


def test_newer_major_version_and_foreign_files_are_refused(tmp_path):
    newer = tmp_path / "newer.kvlog"
    newer.write_text(json.dumps({"schema_version": f"{SCHEMA_MAJOR + 1}.0"}) + "\n")
    with pytest.raises(LogFormatError, match="newer than this kvdiag reads"):
        read_log(newer)
    foreign = tmp_path / "trace.jsonl"
    foreign.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n')
    with pytest.raises(LogFormatError, match=r"trace\.jsonl:1: expected a kvdiag log header"):
        read_header(foreign)
    empty = tmp_path / "empty.kvlog"
    empty.write_text("")
    with pytest.raises(LogFormatError, match="empty file"):
        read_log(empty)
    with pytest.raises(LogFormatError, match="no such file"):
        read_log(tmp_path / "missing.kvlog")


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "cut.kvlog"
    with LogWriter(path, make_header()) as writer:
        for event in _steps(5):
            writer.record(event)
    data = path.read_bytes()
    path.write_bytes(data[:-20])  # cut inside the last event
    with pytest.warns(UserWarning, match="truncated last line"):
        log = read_log(path, strict=True)
    assert log.frame(EngineStep)["step_id"].tolist() == [0, 1, 2, 3]


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.events.schema import EngineStep
    path, interval = sys.argv[1], float(sys.argv[2])
    writer = LogWriter(path, make_header(), interval_s=interval)
    i = 0
    while True:
        writer.record(EngineStep(ts_ns=time.time_ns(), step_id=i, phase="decode",
                                 batch_size=1, num_tokens=1, duration_ns=0))
        i += 1
        if i % 100 == 0:
            print(i, time.time_ns(), flush=True)
            time.sleep(0.01)
""")


@pytest.mark.parametrize("name", ["killed.kvlog", "killed.kvlog.gz"])
def test_kill_9_loses_at_most_the_last_interval(tmp_path, name):
    path = tmp_path / name
    interval_s = 0.2
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path), str(interval_s)],
                            stdout=subprocess.PIPE, text=True)
    progress = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        count, now_ns = map(int, line.split())
        progress.append((count, now_ns))
        if now_ns - progress[0][1] > 3e9:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kill_ns = progress[-1][1]  # the child's clock at the last line read (the kill came later)
    # with what the child printed that this loop had not read yet (a loaded machine can leave
    # this loop lines behind): it records at most 100 events after its last printed count
    unread = [int(line.split()[0]) for line in proc.stdout.read().splitlines() if line.strip()]
    last_count = (unread or [progress[-1][0]])[-1]
    log = read_log(path)  # must not raise
    steps = log.frame(EngineStep)
    assert steps["step_id"].tolist() == list(range(len(steps)))  # a clean prefix
    # everything recorded more than two intervals (plus 1 s for the writer thread's scheduling on a
    # loaded machine) before the kill is there: with 3 s of recording, ~1.6 s of it
    settled = [c for c, t in progress if t < kill_ns - 2 * interval_s * 1e9 - 1e9]
    assert settled, progress
    assert len(steps) >= max(settled)
    assert len(steps) <= last_count + 100
