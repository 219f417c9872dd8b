"""engine.number_traps: each trap planted in a constructed log (CONSTRUCTED DATA) is flagged
with the engine's and kvdiag's figures; a faithful engine passes; the verdict is rules'."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.diagnosis import doctor, engine_numbers, rules
from kvdiag.diagnosis.frames import load
from kvdiag.events.eventlog import make_header
from kvdiag.events.log_writer import LogWriter
from kvdiag.events.schema import EngineMetrics, KVPoolInfo, KVPoolSample, RequestFinished

DATA = Path(__file__).parent.parent / "data"
S = 1_000_000_000


def _log(path, *, gauge, blocks_used, tokens_held, queries, hits, cached):
    """A pool of 100 blocks of 16 tokens; one pool sample and one scrape per second."""
    with LogWriter(path, make_header(engine="vllm", block_size_tokens=16)) as w:
        w.record(KVPoolInfo(ts_ns=S, num_blocks=100, block_size_tokens=16, block_bytes=64, num_layers=1,
                            num_kv_heads=1, head_dim=1, dtype="float32", prefix_sharing=True))
        for i, (g, b, t, q, h) in enumerate(zip(gauge, blocks_used, tokens_held, queries, hits)):
            ts = (i + 2) * S
            w.record(KVPoolSample(ts_ns=ts, num_blocks=100, blocks_used=b, tokens_held=t))
            w.record(EngineMetrics(ts_ns=ts + 1, kv_cache_usage=g, prefix_cache_queries_tokens=q,
                                   prefix_cache_hits_tokens=h))
        for i, c in enumerate(cached):
            w.record(RequestFinished(ts_ns=(i + 2) * S + 2, request_id=str(i), prompt_tokens=100,
                                     output_tokens=1, cached_prompt_tokens=c))
    return load([path])[0]


def _checks(logs) -> dict[str, dict]:
    f = engine_numbers.number_traps(logs)
    return f, {c["check"]: c for c in f.evidence["checks"]}


FAITHFUL = dict(gauge=[0.0, 0.2, 0.2, 0.0], blocks_used=[0, 20, 20, 0], tokens_held=[0, 320, 300, 0],
                queries=[0, 100, 200, 300], hits=[0, 0, 50, 100], cached=[0, 50, 50])


def test_a_faithful_engine_passes(tmp_path):
    f, c = _checks(_log(tmp_path / "a.kvlog", **FAITHFUL))
    assert f.status == "pass", f.message
    assert {k: v["status"] for k, v in c.items()} == dict.fromkeys(c, "ok")
    assert c["hits_beyond_requests"]["engine"] == 100 == c["hits_beyond_requests"]["recount"]


@pytest.mark.parametrize("trap, change", [
    # 60 blocks hold 2 tokens each: the gauge reads 60%, 7.5% of token slots are written
    ("usage_counts_blocks", dict(gauge=[0.0, 0.6, 0.6, 0.0], blocks_used=[0, 60, 60, 0],
                                 tokens_held=[0, 120, 120, 0])),
    # the pool peaked at 50 blocks between scrapes that read 20%
    ("gauge_is_a_point_in_time", dict(blocks_used=[0, 20, 50, 0], tokens_held=[0, 320, 800, 0])),
    # 1,000 queries and no hit before the log: lifetime 100/1300, window 100/300
    ("lifetime_hit_rate", dict(queries=[1000, 1100, 1200, 1300], hits=[0, 0, 50, 100])),
    # the counter has 40 hits more than the requests' first admissions
    ("hits_beyond_requests", dict(hits=[0, 0, 50, 140])),
    ("counter_stuck_at_zero", dict(hits=[0, 0, 0, 0])),
])
def test_each_planted_trap_is_flagged(tmp_path, trap, change):
    f, c = _checks(_log(tmp_path / "a.kvlog", **{**FAITHFUL, **change}))
    assert f.status == "warn" and trap in f.message
    assert c[trap]["status"] == "trap", c[trap]
    assert {k for k, v in c.items() if v["status"] == "trap"} == {trap}  # that trap alone


def test_verdict_comes_from_rules(tmp_path, monkeypatch):
    logs = _log(tmp_path / "a.kvlog", **FAITHFUL)
    monkeypatch.setattr(rules, "number_traps_status", lambda *a, **k: "fail")
    assert {f.rule: f.status for f in doctor.run_rules(logs)[0]}["engine.number_traps"] == "fail"


def test_recorded_vllm_log_has_no_trap():
    logs = load([DATA / "vllm_demo/demo_16req_seed1.kvlog.gz"])[0]
    f, c = _checks(logs)
    assert f.status == "pass", f.message
    assert c["hits_beyond_requests"]["engine"] == 3968 == c["hits_beyond_requests"]["recount"]
