"""One definition per rule: the doctor evaluates a registry whose rule ids are exactly those
kvdiag.diagnosis.rules catalogues, every view names rules by those ids, and each verdict the
doctor gives comes from a verdict function of kvdiag.diagnosis.rules (checked by swapping one
for a stub and watching the finding follow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.diagnosis import doctor, rules
from kvdiag.diagnosis.frames import load as load_logs

DATA = Path(__file__).parent.parent / "data"
LOGS = [DATA / "demo_small" / "demo_24req_seed1.kvlog.gz",
        DATA / "demo_preempt" / "demo_16req_pool40.kvlog.gz",
        DATA / "demo_queueing" / "overload_48req_rate30.kvlog.gz",
        DATA / "vllm_demo" / "demo_16req_seed1.kvlog.gz"]


def test_registry_ids_are_the_catalogue_in_order():
    registered = [r for entry in doctor.REGISTRY for r in entry.rule_ids]
    assert registered == list(rules.RULE_IDS)
    assert len(set(registered)) == len(registered)


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name)
def test_every_finding_is_a_registered_rule_reported_by_its_entry(path):
    logs = load_logs([str(path)])[0]
    ctx = doctor.RuleContext(logs)
    seen = []
    for entry in doctor.REGISTRY:
        found = entry.evaluate(ctx)
        assert found, entry.rule_ids
        assert {f.rule for f in found} <= set(entry.rule_ids), entry.rule_ids
        seen += [f.rule for f in found]
    # each id reported at least once (per node where a rule judges nodes apart), in order
    assert sorted(set(seen), key=rules.RULE_IDS.index) == [r for r in rules.RULE_IDS if r in seen]
    assert set(rules.RULE_IDS) - set(seen) <= {"fragmentation.allocator"}  # no CUDA allocator on CPU logs
    findings, _ = doctor.run_rules(logs)
    assert [f.rule for f in findings] == seen


def test_prometheus_alerts_name_catalogued_rules():
    from kvdiag.prometheus import alert_rules as prom_rules
    assert {a["rule"] for a in prom_rules.alerts()} <= set(rules.RULE_IDS)


@pytest.mark.parametrize("rule_id, verdict_fn, log", [
    ("pool.preemptions", "preemption_status", 1),
    ("leak.release_paths", "finished_holding_status", 1),
    ("leak.double_release", "double_release_status", 1),
    ("p99.regression", "p99_regression_status", 2),
    ("leak.memory_growth", "growth_status", 1),
    ("latency.queueing", "queueing_status", 2),
])
def test_the_verdict_comes_from_rules(monkeypatch, rule_id, verdict_fn, log):
    """Replacing the verdict function in kvdiag.diagnosis.rules changes the doctor's verdict:
    no copy of the decision lives elsewhere."""
    logs = load_logs([str(LOGS[log])])[0]
    before = {f.rule: f.status for f in doctor.run_rules(logs)[0]}
    assert before[rule_id] != "n/a", before
    flipped = "warn" if before[rule_id] != "warn" else "fail"
    monkeypatch.setattr(rules, verdict_fn, lambda *a, **k: flipped)
    after = {f.rule: f.status for f in doctor.run_rules(logs)[0]}
    assert after[rule_id] == flipped


def test_pool_growth_verdict_comes_from_rules(monkeypatch):
    import pandas as pd
    from kvdiag.diagnosis import leaks
    samples = pd.DataFrame({"ts_ns": [1, 2, 3, 4], "running_requests": [1, 1, 1, 2],
                            "blocks_used": [10, 11, 12, 20]})
    assert leaks.pool_growth_finding(samples).status == "fail"  # +2 blocks at a constant 1 running
    monkeypatch.setattr(rules, "pool_growth_status", lambda *a, **k: "warn")
    assert leaks.pool_growth_finding(samples).status == "warn"


@pytest.mark.parametrize("before, after, std_b, std_a, moved", [
    (0.60, 0.54, 0.01, 0.01, True),    # dropped by more than HIT_RATE_DROP
    (0.60, 0.56, 0.01, 0.01, False),
    (0.60, 0.60, 0.02, 0.05, True),    # fluctuates: std >= 5% and >= 2x before
    (0.60, 0.60, 0.03, 0.05, False),   # 5% std but not twice the baseline's
    (float("nan"), 0.2, float("nan"), float("nan"), False),
])
def test_hit_rate_cause_verdict(before, after, std_b, std_a, moved):
    assert rules.hit_rate_moved(before, after, std_b, std_a) is moved


def test_cause_verdicts_at_their_thresholds():
    assert rules.rose(0.0, 0.1) and not rules.rose(0.0, 0.0)
    assert rules.rose(2.0, 3.0) and not rules.rose(2.0, 2.9)
    assert rules.rose(1.0, 2.0, rules.EVICTION_RISE) and not rules.rose(1.0, 1.9, rules.EVICTION_RISE)
    assert rules.long_sequences_rose(0.02, 0.05) and not rules.long_sequences_rose(0.03, 0.05)
    assert rules.occupancy_crossed(0.89, 0.90) and not rules.occupancy_crossed(0.90, 0.95)
    assert rules.fragmentation_rose(0.05) and not rules.fragmentation_rose(0.049)
    assert rules.oom_status(1, 0, 0) == "fail" and rules.oom_status(0, 1, 0) == "warn"
    assert rules.oom_status(0, 0, 2) == "warn" and rules.oom_status(0, 0, 0) == "pass"
