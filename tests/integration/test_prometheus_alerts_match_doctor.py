"""The alert rules fire exactly where the doctor reports, on the same recorded log.

Each log is replayed into kvdiag's exporter (``PrometheusSink``), scraped after every KV pool
sample and once at the end; the scraped series become promtool's input series (one second per
scrape), and ``promtool test rules`` runs the generated rules file with the alerts the doctor
reports on that log as the expected ones: a ``warning`` alert where the doctor warns or fails,
a ``critical`` one where it fails, none where it passes. Evaluated where the doctor judges:
fragmentation (summed over the samples) at the last scrape with a window covering the log,
memory pressure (the worst moment) at the scrape where the served ratio peaks, the finished
requests holding blocks and the hit-rate gap (the log's end) with the last value held for
their ``for``. The values the alerts compare are also checked against the doctor's numbers.

Logs: the recorded demo (all pass), and that log changed the way a fault would change it:
releases of every 2nd finished request dropped (a leak), free blocks cut (pressure), tokens
held halved (fragmentation); the constructed all-types log (hit-rate gap, fragmentation).
The windowed P99 and memory-growth alerts and the allocator's (no allocator on these CPU
logs) are left to tests/integration/test_prometheus_rules.py.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from kvdiag.events import schema as s
from kvdiag.diagnosis import rules
from kvdiag.diagnosis.doctor import run_rules
from kvdiag.diagnosis.frames import load
from kvdiag.events.eventlog import iter_events, read_header
from kvdiag.prometheus.exporter import PrometheusSink
from kvdiag.prometheus.alert_rules import SEVERITY_OF_STATUS, alerts, rules_yaml
from tests.prometheus_server import binary
from tests.constructed import rewrite

DATA = Path(__file__).parent.parent / "data"
DEMO = DATA / "demo_small" / "demo_24req_seed1.kvlog.gz"
ALL_TYPES = DATA / "schema_v1_0" / "all_types_required_fields.kvlog"
PRESSED = DATA / "demo_preempt" / "demo_16req_pool72.kvlog.gz"  # requests in flight take the pool's blocks
COMPARED = ("KVDiagKVPoolFragmented", "KVDiagKVMemoryPressure", "KVDiagKVMemoryExhausted",
            "KVDiagFinishedRequestsHoldBlocks", "KVDiagPrefixHitRateGap")
SERIES = ("kvdiag_kv_empty_slots_tokens", "kvdiag_kv_token_slots_tokens", "kvdiag_kv_pressure_ratio",
          "kvdiag_finished_requests_holding_blocks", "kvdiag_prefix_hit_ratio_gap",
          "kvdiag_prefix_hit_ratio_gap_unexplained")
RANK = {"n/a": 0, "pass": 0, "warn": 1, "fail": 2}
HOLD_S = 420  # the last scrape held this long: beyond every compared alert's `for`


# ---------------------------------------------------------------- logs


def _leaky(tmp: Path) -> Path:
    finished = [e.request_id for e in iter_events(DEMO) if isinstance(e, s.RequestFinished)]
    leaked = set(finished[1::2])
    return rewrite(DEMO, tmp / "leak.kvlog", lambda e: None if e["type"] == "block_released"
                    and e["request_id"] in leaked else e)


def _scaled_pool(tmp: Path, name: str, **factors: float) -> Path:
    def change(e: dict) -> dict:
        if e["type"] == "kv_pool_sample":
            e.update({k: int(e[k] * f) for k, f in factors.items()})
        return e
    return rewrite(DEMO, tmp / f"{name}.kvlog", change)


# ---------------------------------------------------------------- exporter series


def _scrapes(path: Path) -> list[dict[tuple, float]]:
    """The compared metrics as served after each pool sample (and its same-time events) and
    after the last event: one dict (name, labels) -> value per scrape."""
    events = sorted(iter_events(path), key=lambda e: e.ts_ns)
    sink = PrometheusSink(read_header(path))
    out = []
    try:
        for i, ev in enumerate(events):
            sink.record(ev)
            last = i + 1 == len(events)
            if last or (isinstance(ev, s.KVPoolSample) and events[i + 1].ts_ns != ev.ts_ns):
                out.append({(m.name, tuple(sorted(smp.labels.items()))): smp.value
                            for m in sink.collect() if m.name in SERIES for smp in m.samples})
    finally:
        sink.close()
    return out


def _values(scrapes: list[dict], name: str) -> list[float]:
    return [v for sc in scrapes for (n, _), v in sc.items() if n == name]


def _promtool_value(v: float) -> str:
    return "Inf" if v == math.inf else repr(float(v))


def _input_series(scrapes: list[dict]) -> list[dict]:
    keys = sorted({k for sc in scrapes for k in sc})
    series = []
    for name, labels in keys:
        values, seen = [], False
        for sc in scrapes:
            v = sc.get((name, labels))
            values.append("_" if v is None and not seen else "stale" if v is None else _promtool_value(v))
            seen = seen or v is not None
        values.append(f"{values[-1]}x{HOLD_S}" if values[-1] not in ("_", "stale") else "_")
        lab = ", ".join(f'{k}="{v}"' for k, v in (*labels, ("instance", "i"), ("job", "kvdiag")))
        series.append({"series": f"{name}{{{lab}}}", "values": " ".join(values)})
    return series


# ---------------------------------------------------------------- expectations


def _doctor(path: Path) -> dict[str, object]:
    findings = run_rules(load([path], strict=True)[0])[0]
    by_rule: dict[str, object] = {}
    for f in findings:
        if f.rule not in by_rule or RANK[f.status] > RANK[by_rule[f.rule].status]:
            by_rule[f.rule] = f
    return by_rule


def _eval_times(scrapes: list[dict]) -> dict[str, int]:
    """Seconds into the promtool series where each compared alert is judged."""
    last = len(scrapes) - 1
    ratios = [max((v for (n, _), v in sc.items() if n == "kvdiag_kv_pressure_ratio"), default=-1.0)
              for sc in scrapes]
    peak = max(range(len(ratios)), key=ratios.__getitem__)
    return {"KVDiagKVPoolFragmented": last, "KVDiagKVMemoryPressure": peak,
            "KVDiagKVMemoryExhausted": peak, "KVDiagFinishedRequestsHoldBlocks": last + HOLD_S - 5,
            "KVDiagPrefixHitRateGap": last + HOLD_S - 5}


def _expected(alert: dict, doctor: dict, labels: dict) -> list[dict]:
    finding = doctor.get(alert["rule"])
    needed = "warn" if alert["severity"] == SEVERITY_OF_STATUS["warn"] else "fail"
    if finding is None or RANK[finding.status] < RANK[needed]:
        return []
    return [{"exp_labels": {**labels, "severity": alert["severity"], "kvdiag_rule": alert["rule"]},
             "exp_annotations": {"summary": f"{alert['summary']} on {labels['node']}"}}]


CASES = {
    "recorded demo": lambda tmp: DEMO,
    "leak": _leaky,
    "pressure": lambda tmp: _scaled_pool(tmp, "pressure", blocks_free=0.1, blocks_cached=0.1),
    "fragmentation": lambda tmp: _scaled_pool(tmp, "fragmentation", tokens_held=0.5),
    "constructed, all types": lambda tmp: ALL_TYPES,
    "pool under pressure": lambda tmp: PRESSED,
}


@pytest.mark.parametrize("case", list(CASES))
def test_alerts_fire_exactly_where_the_doctor_reports(case, tmp_path):
    path = CASES[case](tmp_path)
    doctor, scrapes = _doctor(path), _scrapes(path)
    # the doctor judges these three on every log here, so their values are always compared
    # (sharing.consistency is n/a on all but the pool under pressure: no engine hit rate over
    # the shadow's requests)
    judged = {"fragmentation.kv_pool", "forecast.memory_pressure", "leak.release_paths"}
    if case == "pool under pressure":
        judged.add("sharing.consistency")
        # a gap beyond the limit that the engine's evictions explain: the doctor passes it, and
        # the alert (on the unexplained gap) stays silent where one on the gap would fire
        gap = doctor["sharing.consistency"]
        assert gap.status == "pass" and gap.evidence["gap"] > rules.SHARING_GAP_LIMIT
        assert _values(scrapes[-1:], "kvdiag_prefix_hit_ratio_gap")[0] > rules.SHARING_GAP_LIMIT
    assert _values_match_the_doctor(doctor, scrapes) == judged
    header = read_header(path)
    labels = {"node": header.node or header.host, "engine": header.engine,
              "model": Path(header.model).name if header.model.startswith("/") else header.model,
              "instance": "i", "job": "kvdiag"}
    times = _eval_times(scrapes)
    by_name = {a["alert"]: a for a in alerts()}
    tests = [{"eval_time": f"{times[name]}s", "alertname": name,
              "exp_alerts": _expected(by_name[name], doctor, labels)} for name in COMPARED]
    (tmp_path / "rules.yml").write_text(rules_yaml())
    (tmp_path / "test.yml").write_text(json.dumps({  # JSON is YAML
        "rule_files": ["rules.yml"], "evaluation_interval": "1s",
        "tests": [{"interval": "1s", "input_series": _input_series(scrapes), "alert_rule_test": tests}]}))
    out = subprocess.run([binary("promtool"), "test", "rules", "test.yml"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    verdicts = {r: f.status for r, f in doctor.items()}
    assert out.returncode == 0, f"doctor: {verdicts}\n{out.stdout[-4000:]}{out.stderr[-2000:]}"
    fired = [t["alertname"] for t in tests if t["exp_alerts"]]
    expected_fired = {"recorded demo": [], "leak": ["KVDiagFinishedRequestsHoldBlocks"],
                      "pressure": ["KVDiagKVMemoryPressure", "KVDiagKVMemoryExhausted"],
                      "fragmentation": ["KVDiagKVPoolFragmented"],
                      "pool under pressure": ["KVDiagKVMemoryPressure"]}  # its pressure, not its gap
    if case in expected_fired:  # the faults were made to trip these rules, and only these
        assert fired == expected_fired[case], verdicts


def _values_match_the_doctor(doctor: dict, scrapes: list[dict]) -> set[str]:
    """Each value an alert compares equals the doctor's, wherever the doctor judged; returns
    the rules compared (a judged rule whose series is missing fails)."""
    compared = set()
    frag = doctor.get("fragmentation.kv_pool")
    if frag is not None and frag.status != "n/a":
        empty, slots = _values(scrapes, "kvdiag_kv_empty_slots_tokens"), _values(scrapes, "kvdiag_kv_token_slots_tokens")
        assert sum(empty) / sum(slots) == pytest.approx(frag.evidence["value"], rel=1e-12)
        compared.add(frag.rule)
    pressure = doctor.get("forecast.memory_pressure")
    if pressure is not None and pressure.status != "n/a":
        assert max(_values(scrapes, "kvdiag_kv_pressure_ratio")) == pytest.approx(
            pressure.evidence["peak_need_ratio"], rel=1e-12)
        compared.add(pressure.rule)
    release = doctor.get("leak.release_paths")
    if release is not None and release.status != "n/a":
        holding = _values(scrapes[-1:], "kvdiag_finished_requests_holding_blocks")
        assert len(holding) == 1, "the doctor judged the release paths: the exporter must publish the series"
        assert holding[0] == (release.evidence.get("num_requests", 0) if release.status == "fail" else 0)
        compared.add(release.rule)
    gap = doctor.get("sharing.consistency")
    if gap is not None and gap.status != "n/a":
        assert _values(scrapes[-1:], "kvdiag_prefix_hit_ratio_gap")[0] == pytest.approx(gap.evidence["gap"], abs=1e-12)
        assert _values(scrapes[-1:], "kvdiag_prefix_hit_ratio_gap_unexplained")[0] == pytest.approx(
            gap.evidence["unexplained_gap"], abs=1e-12)
        compared.add(gap.rule)
    return compared
