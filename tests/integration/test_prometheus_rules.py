"""`kvdiag doctor --prometheus-rules`: promtool accepts the file, its thresholds are the
doctor's (kvdiag/diagnosis/rules.py), and promtool's rule tests fire at those thresholds."""

import json
import subprocess
import sys

from kvdiag.diagnosis import rules
from kvdiag.prometheus.alert_rules import alerts, rules_yaml
from tests.prometheus_server import binary


def _write_rules(tmp_path):
    path = tmp_path / "kvdiag-rules.yml"
    subprocess.run([sys.executable, "-m", "kvdiag", "doctor", "--prometheus-rules", str(path)],
                   check=True, timeout=120)
    return path


def test_promtool_accepts_the_rules(tmp_path):
    path = _write_rules(tmp_path)
    out = subprocess.run([binary("promtool"), "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in out.stdout


def test_thresholds_are_the_doctors(monkeypatch):
    text = rules_yaml()
    assert f"[10m]) >= {rules.FRAGMENTATION_LIMIT!r}" in text
    assert f"abs(kvdiag_prefix_hit_ratio_gap_unexplained) > {rules.SHARING_GAP_LIMIT!r}" in text
    monkeypatch.setattr(rules, "FRAGMENTATION_LIMIT", 0.4242)
    monkeypatch.setattr(rules, "SHARING_GAP_LIMIT", 0.0707)
    moved = rules_yaml()
    assert "[10m]) >= 0.4242" in moved
    assert "abs(kvdiag_prefix_hit_ratio_gap_unexplained) > 0.0707" in moved


def test_promtool_rule_tests_fire_at_the_doctors_thresholds(tmp_path):
    path = _write_rules(tmp_path)
    labels = 'node="n1", engine="e", model="m", instance="i", job="kvdiag"'
    above, below = rules.FRAGMENTATION_LIMIT + 0.01, rules.FRAGMENTATION_LIMIT - 0.01
    gap = rules.SHARING_GAP_LIMIT + 0.01
    summary = {a["alert"]: json.dumps(a["summary"] + " on n1") for a in alerts()}
    tests = tmp_path / "tests.yml"
    tests.write_text(f"""rule_files: [{path.name}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'kvdiag_kv_empty_slots_tokens{{{labels}}}'
        values: '{above * 1000}x10'
      - series: 'kvdiag_kv_token_slots_tokens{{{labels}}}'
        values: '1000x10'
      - series: 'kvdiag_allocator_fragmentation_ratio{{{labels}}}'
        values: '{below}x10'
      - series: 'kvdiag_prefix_hit_ratio_gap_unexplained{{{labels}}}'
        values: '{-gap}x10'
      - series: 'kvdiag_finished_requests_holding_blocks{{{labels}}}'
        values: '0x10'
    alert_rule_test:
      - eval_time: 6m
        alertname: KVDiagKVPoolFragmented
        exp_alerts:
          - exp_labels: {{severity: warning, kvdiag_rule: fragmentation.kv_pool, node: n1, engine: e, model: m, instance: i, job: kvdiag}}
            exp_annotations: {{summary: {summary["KVDiagKVPoolFragmented"]}}}
      - eval_time: 6m
        alertname: KVDiagAllocatorFragmented
        exp_alerts: []
      - eval_time: 6m
        alertname: KVDiagPrefixHitRateGap
        exp_alerts:
          - exp_labels: {{severity: warning, kvdiag_rule: sharing.consistency, node: n1, engine: e, model: m, instance: i, job: kvdiag}}
            exp_annotations: {{summary: {summary["KVDiagPrefixHitRateGap"]}}}
      - eval_time: 6m
        alertname: KVDiagFinishedRequestsHoldBlocks
        exp_alerts: []
""")
    out = subprocess.run([binary("promtool"), "test", "rules", str(tests)], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
