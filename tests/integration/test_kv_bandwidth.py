"""KV bandwidth demanded vs measured (kvdiag/diagnosis/bandwidth.py, kvdiag/collectors/bandwidth_probe.py)
and the P99 cause it feeds, checked against computations made here from the raw events."""

from __future__ import annotations

import gzip
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

import constructed_serving as cs
from waiting import wait_for
from kvdiag.diagnosis import bandwidth
from kvdiag.diagnosis.p99_rules import P99_CHECKLIST, p99_checklist
from kvdiag.diagnosis.doctor import run_rules
from kvdiag.diagnosis.frames import load

DEMO = Path(__file__).parent.parent / "data" / "demo_small" / "demo_24req_seed1.kvlog.gz"


def _raw_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f][1:]


def test_demanded_bandwidth_of_the_recorded_demo_equals_brute_force():
    """Per step: blocks each request holds at the step's start (its allocations, prefix hits
    and adoptions at or before it, minus its releases), summed, x the pool's block bytes /
    the step's duration; over the run: all bytes / all step time."""
    evs = _raw_events(DEMO)
    block_bytes = next(e["block_bytes"] for e in evs if e["type"] == "kv_pool_info")
    sign = {"block_allocated": 1, "prefix_hit": 1, "block_deduplicated": 1, "block_released": -1}
    ledger = [(e["ts_ns"], sign[e["type"]]) for e in evs if e["type"] in sign]
    steps = [e for e in evs if e["type"] == "engine_step"]
    expected = []
    for st in steps:
        held = sum(d for ts, d in ledger if ts <= st["ts_ns"])
        expected.append((held, held * block_bytes / (st["duration_ns"] / 1e9)))

    logs, _ = load([DEMO])
    fr = bandwidth.kv_read_frame(logs).sort_values("ts_ns", kind="stable")
    by_step = {int(r.step_id): (r.blocks_held, r.kv_read_bytes_per_s) for r in fr.itertuples()}
    assert len(by_step) == len(steps) == 113
    for st, (held, rate) in zip(steps, expected):
        got_held, got_rate = by_step[st["step_id"]]
        assert got_held == held
        assert got_rate == pytest.approx(rate, rel=1e-12)
    assert max(h for h, _ in expected) > 100  # the run held real KV, not a trivial zero
    total = sum(h for h, _ in expected) * block_bytes / (sum(s["duration_ns"] for s in steps) / 1e9)
    sm = bandwidth.summarize(logs)
    assert sm.kv_read_bytes_per_s == pytest.approx(total, rel=1e-12)
    assert math.isnan(sm.utilisation)  # recorded before the probe existed: no peak, N/A
    assert "utilisation N/A" in bandwidth.describe(sm)


def test_a_window_counts_blocks_taken_before_it():
    logs, _ = load([DEMO])
    full = bandwidth.kv_read_frame(logs).set_index("step_id")
    t0, t1 = logs.time_range_ns()
    mid = (t0 + t1) // 2
    part = bandwidth.kv_read_frame(logs.window(mid, t1 + 1)).set_index("step_id")
    assert len(part) and len(part) < len(full)
    assert (part["blocks_held"] == full.loc[part.index, "blocks_held"]).all()


def test_utilisation_is_demand_over_the_probe_and_long_shared_prompts_at_high_batch_use_more(tmp_path):
    short = cs.write(tmp_path / "short.kvlog", cs.serving(120, lambda i: 64, rate_per_s=5.0))
    long = cs.write(tmp_path / "long.kvlog", cs.serving(120, lambda i: 2048, rate_per_s=40.0,
                                                          shared_share=0.9))
    sums = {}
    for name, path in (("short", short), ("long", long)):
        logs, _ = load([path])
        fr = bandwidth.kv_read_frame(logs)
        assert np.allclose(fr["utilisation"], fr["kv_read_bytes_per_s"] / 20e9)
        sums[name] = (bandwidth.summarize(logs), fr["batch_size"].mean())
    (s_short, b_short), (s_long, b_long) = sums["short"], sums["long"]
    assert b_long > 4 * b_short  # high batch
    assert s_long.utilisation > 3 * s_short.utilisation
    assert s_long.utilisation == pytest.approx(s_long.kv_read_bytes / s_long.busy_s / 20e9)


def _causes(path):
    logs, _ = load([path])
    findings, comps = run_rules(logs)
    flagged = [c for c in comps if c.flagged]
    assert flagged, "the constructed regression must be detected"
    return {f.rule: f for f in findings}, flagged


def test_context_growth_alone_is_attributed_to_bandwidth_and_long_sequences(tmp_path):
    """Same request rate and shared share; from request 150 on prompts are 4x longer."""
    path = cs.write(tmp_path / "ctx.kvlog", cs.serving(300, lambda i: 256 if i < 150 else 1024))
    findings, flagged = _causes(path)
    for c in flagged:
        supported = {k.cause for k in c.causes if k.supported}
        assert {"kv_bandwidth", "long_sequences"} <= supported, c.metric
        assert not supported & {"compression", "prefix_hit_rate"}, c.metric
    assert findings["p99.kv_bandwidth"].status == "warn"
    assert findings["p99.long_sequences"].status == "warn"
    assert findings["p99.compression"].status == "pass"
    assert findings["p99.prefix_hit_rate"].status == "pass"


def test_a_hit_rate_drop_at_the_same_lengths_is_not_blamed_on_bandwidth(tmp_path):
    path = cs.write(tmp_path / "hits.kvlog", cs.serving(300, lambda i: 512, prefill_ns_per_token=60_000,
                                                        shared_share=0.75, shared_share_from=(150, 0.0)))
    findings, flagged = _causes(path)
    for c in flagged:
        supported = {k.cause for k in c.causes if k.supported}
        assert "prefix_hit_rate" in supported and "kv_bandwidth" not in supported, c.metric
    assert findings["p99.kv_bandwidth"].status == "pass"


def test_the_p99_checklist_lists_the_articles_four_items_with_a_status(tmp_path):
    path = cs.write(tmp_path / "ctx.kvlog", cs.serving(300, lambda i: 256 if i < 150 else 1024))
    for p in (path, DEMO):
        logs, _ = load([p])
        items = p99_checklist(run_rules(logs)[0])
        assert [f.rule for _, f in items] == [f"p99.{k}" for k, _ in P99_CHECKLIST]
        assert [k for k, _ in P99_CHECKLIST] == ["compression", "kv_bandwidth", "prefix_hit_rate", "long_sequences"]
        assert all(f.status in ("pass", "warn", "fail", "n/a") and f.message for _, f in items)
    bw = dict((f.rule, f) for _, f in items)["p99.kv_bandwidth"]
    assert "GB/s of KV read demanded" in bw.message  # the demo has no P99 comparison: measured anyway


def test_doctor_prints_and_writes_the_checklist(tmp_path, capsys):
    from kvdiag.cli import main
    path = cs.write(tmp_path / "ctx.kvlog", cs.serving(300, lambda i: 256 if i < 150 else 1024))
    assert main(["doctor", str(path), "--json"]) == 1  # p99.regression fails
    out = json.loads(capsys.readouterr().out)
    rows = out["p99_checklist"]
    assert [r["rule"] for r in rows] == ["p99.compression", "p99.kv_bandwidth", "p99.prefix_hit_rate",
                                         "p99.long_sequences"]
    assert [r["status"] for r in rows] == ["pass", "warn", "pass", "warn"]
    main(["doctor", str(path)])
    text = capsys.readouterr().out
    assert "P99 checklist" in text and "How busy is the memory bandwidth?" in text


# ---------------------------------------------------------------- the probe


def test_the_probe_is_bounded_cached_per_host_and_kept_out_of_the_package(tmp_path, monkeypatch):
    import kvdiag
    from kvdiag.collectors import bandwidth_probe
    monkeypatch.setenv("KVDIAG_HOME", str(tmp_path / "home"))
    package = Path(kvdiag.__file__).parent
    before = {p for p in package.rglob("*") if p.suffix == ".json"}
    first = bandwidth_probe.probe("cpu")
    llc = bandwidth_probe.last_level_cache_bytes()
    # twice the last-level cache, clamped to [MIN_BUFFER_BYTES, MAX_BUFFER_BYTES]
    want = min(max(2 * (llc or 0), bandwidth_probe.MIN_BUFFER_BYTES), bandwidth_probe.MAX_BUFFER_BYTES)
    assert first.buffer_bytes == want
    assert 1 <= first.repetitions <= bandwidth_probe.DEFAULT_REPETITIONS and not first.cached
    assert 1e8 < first.copy_bandwidth_bytes_per_s < 1e13  # a real machine: 0.1 GB/s .. 10 TB/s
    cached = bandwidth_probe.probe("cpu")
    assert cached.cached and cached.copy_bandwidth_bytes_per_s == first.copy_bandwidth_bytes_per_s
    files = list((tmp_path / "home" / "bandwidth").iterdir())
    assert len(files) == 1 and files[0] == bandwidth_probe.cache_path("cpu")
    assert {p for p in package.rglob("*") if p.suffix == ".json"} == before


def test_no_copy_starts_after_the_budget(monkeypatch):
    """The probe's bound, on an injected clock: each copy takes 0.3 s of it, so with a 0.5 s
    budget the second copy starts at 0.3 s and no third one at 0.6 s."""
    from kvdiag.collectors import bandwidth_probe
    clock = [0.0]

    def copy_maker(buffer_bytes):
        def once():
            clock[0] += 0.3
            return 0.3
        return once
    monkeypatch.setattr(bandwidth_probe, "_copy_seconds_numpy", copy_maker)
    probe = bandwidth_probe.measure("cpu", buffer_bytes=64 << 20, repetitions=5, budget_s=0.5,
                                    clock_s=lambda: clock[0])
    assert probe.repetitions == 2 and clock[0] == 0.6
    assert probe.copy_bandwidth_bytes_per_s == 2 * (64 << 20) / 0.3
    one = bandwidth_probe.measure("cpu", buffer_bytes=64 << 20, repetitions=5, budget_s=0.0,
                                  clock_s=lambda: clock[0])
    assert one.repetitions == 1  # at least one copy, even with no budget left


def test_the_agent_records_the_probe_and_the_energy_status(tmp_path, monkeypatch):
    """The log carries the peak (so offline analyses can compute utilisation) and says why
    host energy is N/A where RAPL cannot be read."""
    from kvdiag.agent import Agent
    from kvdiag.events.eventlog import read_log
    monkeypatch.setenv("KVDIAG_HOME", str(tmp_path / "home"))
    log_path = tmp_path / "agent.kvlog"
    agent = Agent(log_path=str(log_path), live=False, shadow_sharing=False, host_memory=False,
                  sample_interval_s=0.05).start()
    time.sleep(0.2)
    agent.stop()
    frames = read_log(log_path).frames
    probe = frames["memory_bandwidth_probe"]
    assert len(probe) == 1 and probe["device"].iloc[0] in ("cpu", "cuda:0")
    assert probe["copy_bandwidth_bytes_per_s"].iloc[0] > 1e8
    status = frames["collector_status"]
    for collector, readings in (("rapl", "host_energy_sample"), ("nvml", "nvml_sample")):
        st = status[status["collector"] == collector]
        assert len(st) == 1, collector
        if not st["available"].iloc[0]:
            assert st["hint"].iloc[0], collector  # why energy is N/A
        else:
            assert len(frames[readings]) >= 2, collector  # at the start and at the end


def test_top_shows_the_same_demanded_bandwidth_as_the_offline_analysis(tmp_path):
    """`kvdiag top`'s state over the events of a constructed run: its KV read rate over the
    rate window equals the offline per-step frame summed over the same bins."""
    from kvdiag.events.eventlog import iter_events, read_log
    from kvdiag.live.state import LiveState
    path = cs.write(tmp_path / "ctx.kvlog", cs.serving(200, lambda i: 256 if i < 100 else 1024))
    state = LiveState(bin_s=1.0, rate_window_s=5.0)
    state.set_header(read_log(path).header)
    events = sorted(iter_events(path), key=lambda e: e.ts_ns)
    state.feed_all(events)
    now = max(e.ts_ns for e in events)
    lat = state.snapshot(now).latency
    fr = bandwidth.kv_read_frame(load([path])[0])
    last = now // 10**9
    win = fr[(fr["ts_ns"] // 10**9 > last - 5) & (fr["ts_ns"] // 10**9 <= last)]
    expected = win["kv_read_bytes"].sum() / (win["duration_ns"].sum() / 1e9)
    assert len(win) > 5
    assert lat.kv_read_bytes_per_s == pytest.approx(expected, rel=1e-9)
    assert lat.kv_bandwidth_utilisation == pytest.approx(expected / 20e9, rel=1e-9)
    assert lat.kv_bandwidth_history and lat.kv_bandwidth_history_unit == "%"


def test_the_hardware_recorder_samples_nvml_energy_until_stopped(tmp_path, monkeypatch):
    """On a GPU machine whose engine has not initialised CUDA the probe waits (a CUDA driver
    initialised before an engine forks breaks its workers); never initialised: the CPU's."""
    from kvdiag.collectors import nvml
    from kvdiag.collectors.hardware import HardwareRecorder
    from test_collectors import FakeNvml

    class Sink:
        def __init__(self):
            self.events = []

        def record(self, ev):
            self.events.append(ev)

        def flush(self):
            pass

    monkeypatch.setenv("KVDIAG_HOME", str(tmp_path))
    sink = Sink()
    rec = HardwareRecorder(sink, probe=True, nvml=True, interval_s=0.02)
    rec.nvml = nvml.NvmlCollector(nvml=FakeNvml())
    def nvml_samples():
        return sum(type(e).__name__ == "NvmlSample" for e in list(sink.events))

    rec.start()
    # start's, then two of the thread's intervals (each looks for CUDA first)
    wait_for(lambda: nvml_samples() >= 3, timeout_s=30, what="3 NVML samples")
    assert not [e for e in sink.events if type(e).__name__ == "MemoryBandwidthProbe"]  # CPU torch here
    rec.stop()
    [probe] = [e for e in sink.events if type(e).__name__ == "MemoryBandwidthProbe"]
    assert probe.device == "cpu"
    n = nvml_samples()
    assert n >= 4  # start, several intervals, stop
    after = len(sink.events)
    time.sleep(0.05)
    assert len(sink.events) == after  # the thread ended
    assert all(e.energy_mj == 1234 and e.memory_util_pct == 25 for e in sink.events
               if type(e).__name__ == "NvmlSample")


def test_the_exporter_serves_the_demanded_kv_read_as_counters(tmp_path):
    """kvdiag_kv_read_bytes_total / kvdiag_kv_read_step_seconds_total over a whole constructed
    run equals the offline per-step frame summed over all steps; the probe is served as is."""
    from kvdiag.events.eventlog import iter_events, read_log
    from kvdiag.prometheus.exporter import PrometheusSink
    path = cs.write(tmp_path / "ctx.kvlog", cs.serving(120, lambda i: 256 if i < 60 else 1024))
    sink = PrometheusSink(read_log(path).header)
    for ev in sorted(iter_events(path), key=lambda e: e.ts_ns):
        sink.record(ev)
    served = {s.name: s.value for m in sink.collect() for s in m.samples}
    sink.close()
    fr = bandwidth.kv_read_frame(load([path])[0])
    assert served["kvdiag_kv_read_bytes_total"] == pytest.approx(fr["kv_read_bytes"].sum(), rel=1e-12)
    assert served["kvdiag_kv_read_step_seconds_total"] == pytest.approx(fr["duration_ns"].sum() / 1e9, rel=1e-12)
    assert served["kvdiag_memory_copy_bandwidth_bytes_per_second"] == pytest.approx(20e9)
