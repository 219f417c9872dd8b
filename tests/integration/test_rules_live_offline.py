"""One verdict per rule in every view: a recorded log replayed through the live path (the
source, LiveState and LiveRules, called as ``kvdiag top --log`` calls them) ends with the
same findings as ``kvdiag doctor`` on the file: same rule ids, statuses and measured values.
The leak rules top shows come from its own block ledger (LiveState.ledger), the others from
the doctor's rules run on LiveRules' inputs (no raw block event: the block facts LiveState
folds over its ledger); tests/integration/test_ledger_views.py checks top's, the exporter's and the
doctor's pool numbers against a brute-force count, tests/unit/test_block_facts.py the facts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.diagnosis import doctor
from kvdiag.diagnosis.frames import UNUSED_BY_REPORTS, load
from kvdiag.events import schema as s
from kvdiag.live.rules import LiveRules
from kvdiag.live.state import LiveState
from kvdiag.live.replay_source import ReplaySource

DATA = Path(__file__).parent.parent / "data"
RECORDED = sorted(p for p in DATA.rglob("*") if p.name.endswith((".kvlog", ".kvlog.gz")))


def live_findings(path: Path) -> dict:
    """The alerts at the end of a replay, by rule id (collector health left out: top shows it
    beside the rules, it is not one)."""
    source = ReplaySource(path, speed=1e9, clock=iter(range(10**9)).__next__)
    state = LiveState(source=source.description)
    rules = LiveRules(clock=lambda: 0.0)
    while not source.finished:
        events = source.poll(10_000)
        if source.header is not None and state.header is None:
            state.set_header(source.header)
        rules.fold(state, events)  # as top: the state folds, the rules keep what they judge
    assert rules.due(source.finished)
    # what the doctor does not load (every BlockStored), the live rules do not keep either: one
    # row per block the engine caches would grow top's memory with the stream
    assert not {s.event_tag(cls) for cls in rules.tables} & UNUSED_BY_REPORTS
    state.rule_findings = rules.run(state.header, rules.take(state))
    snap = state.snapshot(source.now_ns(), finished_source=True)
    return {f.rule: f for f in snap.alerts if not f.rule.startswith("collector.")}


def offline_findings(path: Path) -> dict:
    findings, _ = doctor.run_rules(load([path])[0])
    return {f.rule: f for f in findings}


def _same(live: dict, offline: dict) -> None:
    assert sorted(live) == sorted(offline)
    for rule, f in offline.items():
        assert (live[rule].status, live[rule].message) == (f.status, f.message), rule
        assert json.dumps(live[rule].evidence, sort_keys=True, default=str) == \
            json.dumps(f.evidence, sort_keys=True, default=str), rule


def constructed_logs(folder: Path) -> list[Path]:
    """Logs written through the real LogWriter that make the rules fail: leaking requests,
    long prompts from the middle on (a P99 regression with its cause), the TUI fixture's
    shadow sharing with a TTFT spike and a leak, and a recorded pool under pressure without the
    engine's stores and evictions (a hit-rate gap nothing in the log explains)."""
    import constructed as C
    from tui_data import write_constructed_log

    return [C.write(folder / "leak_and_long.jsonl", C.events(n_requests=240, leak_ids=(5, 17), long_from=120)),
            write_constructed_log(folder / "shadow_spike_leak.kvlog", n_requests=200, leak_every=5),
            # a pool under pressure from an engine that publishes no stores or evictions: an
            # unexplained gap
            C.without_engine_evidence(DATA / "demo_preempt" / "demo_16req_pool72.kvlog.gz",
                                      folder / "no_evictions.kvlog")]


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.parent.name + "/" + p.name)
def test_recorded_log_gets_the_same_verdicts_live_and_offline(path):
    _same(live_findings(path), offline_findings(path))


def test_constructed_failing_logs_get_the_same_verdicts_live_and_offline(tmp_path):
    for path in constructed_logs(tmp_path):
        _same(live_findings(path), offline_findings(path))


def test_the_logs_exercise_every_verdict(tmp_path):
    """The equality above is not about empty findings: between them, the logs pass, warn and
    fail the leak, fragmentation, sharing and P99 rules."""
    judged = {(rule, f.status) for path in [*RECORDED, *constructed_logs(tmp_path)]
              for rule, f in offline_findings(path).items()}
    assert {("leak.release_paths", "fail"), ("leak.release_paths", "pass"), ("p99.regression", "fail"),
            ("fragmentation.kv_pool", "pass"), ("fragmentation.kv_pool", "warn"),
            ("sharing.consistency", "warn"), ("sharing.consistency", "pass")} <= judged, sorted(judged)


def test_tops_sharing_panel_judges_the_gap_as_the_doctor(tmp_path):
    """top's prefix panel (its SharingView) gives sharing.consistency's verdict on the gap the
    engine's own events leave unexplained, as the doctor does: a pool under pressure passes
    (its evictions explain the gap), the same traffic without its stores and evictions warns."""
    silent, statuses = constructed_logs(tmp_path)[-1], []
    for path in (DATA / "demo_preempt" / "demo_16req_pool72.kvlog.gz", silent):
        source = ReplaySource(path, speed=1e9, clock=iter(range(10**9)).__next__)
        state = LiveState(source=source.description)
        while not source.finished:
            events = source.poll(10_000)
            if source.header is not None and state.header is None:
                state.set_header(source.header)
            state.feed_all(events)
        sharing = state.snapshot(source.now_ns(), finished_source=True).sharing
        doctor = offline_findings(path)["sharing.consistency"]
        assert sharing.gap_status == doctor.status, path
        assert sharing.gap == pytest.approx(doctor.evidence["gap"], abs=1e-12)
        assert sharing.unexplained_gap == pytest.approx(doctor.evidence["unexplained_gap"], abs=1e-12)
        statuses.append(doctor.status)
    assert statuses == ["pass", "warn"]


def test_doctor_cli_prints_what_the_live_path_shows(tmp_path):
    path = DATA / "demo_small" / "demo_24req_seed1.kvlog.gz"
    out = subprocess.run([sys.executable, "-m", "kvdiag", "doctor", str(path), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 1), out.stderr
    cli = {f["rule"]: f["status"] for f in json.loads(out.stdout)["findings"]}
    live = {rule: f.status for rule, f in live_findings(path).items()}
    assert cli == live
