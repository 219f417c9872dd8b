"""Analyses behind the report and the doctor, on CONSTRUCTED logs (tests/constructed.py), each
checked against a value computed directly from the constructed events."""

from __future__ import annotations

import msgspec
import pytest

import constructed as C
from kvdiag.events import schema as s
from kvdiag.diagnosis import doctor, latency_regression, leak_rules, memory, pressure_rules
from kvdiag.diagnosis.latency import samples
from kvdiag.diagnosis.frames import load
from kvdiag.diagnosis.requests import request_table


@pytest.fixture(scope="module")
def leak_log(tmp_path_factory):
    evs = C.events(n_requests=80, leak_ids=(5, 17))
    path = C.write(tmp_path_factory.mktemp("c") / "leak.jsonl", evs)
    return evs, load([path])[0]


def test_request_table_against_events(leak_log):
    evs, logs = leak_log
    fin = {e.request_id: e for e in evs if isinstance(e, s.RequestFinished)}
    alloc = {}
    for e in evs:
        if isinstance(e, s.BlockAllocated):
            alloc[e.request_id] = alloc.get(e.request_id, 0) + 1
    t = request_table(logs).set_index("request_id")
    assert len(t) == len(fin)
    for rid, e in fin.items():
        row = t.loc[rid]
        assert row["kv_bytes"] == (e.prompt_tokens + e.output_tokens) * (C.BLOCK_BYTES // C.BLOCK)
        assert row["blocks_allocated"] == alloc[rid]
        assert row["block_bytes_held"] == alloc[rid] * C.BLOCK_BYTES
        assert row["hit_rate"] == pytest.approx(e.cached_prompt_tokens / e.prompt_tokens)
        assert row["per_token_ns"] == pytest.approx((e.e2e_ns - e.ttft_ns) / (e.output_tokens - 1))


def test_samples_are_time_ordered_and_complete(leak_log):
    evs, logs = leak_log
    steps = [e.duration_ns for e in evs if isinstance(e, s.EngineStep)]
    st = samples(logs, "step")
    assert sorted(st["value_ns"]) == sorted(steps)
    # TTFT samples: one per finished request, at its first token, in time order (from the events)
    first = sorted((e.ts_ns, e.ttft_ns) for e in evs if isinstance(e, s.RequestFirstToken)
                   if any(f.request_id == e.request_id and f.status == "finished"
                          for f in evs if isinstance(f, s.RequestFinished)))
    tt = samples(logs, "ttft")
    assert len(first) == 80
    # (the frame's timestamps are float64, NaN where unknown: exact up to float64 rounding)
    assert tt["ts_ns"].tolist() == [float(t) for t, _ in first]
    assert tt["value_ns"].tolist() == [v for _, v in first]


def test_release_paths_names_leaking_requests(leak_log):
    _, logs = leak_log
    f = next(g for g in leak_rules.release_paths(logs) if g.rule == "leak.release_paths")
    assert f.status == "fail"
    assert sorted(f.evidence["requests"]) == ["req-17", "req-5"]


def test_clean_constructed_log_passes(tmp_path):
    logs = load([C.write(tmp_path / "clean.jsonl", C.events(n_requests=80))])[0]
    findings, _ = doctor.run_rules(logs)
    assert {f.status for f in findings} <= {"pass", "n/a"}, [f for f in findings if f.status not in ("pass", "n/a")]


def test_breakdown_sums_to_measured_totals(leak_log):
    _, logs = leak_log
    bd = memory.breakdown(logs, logs.nodes[0])
    totals = bd[bd["measure"] == "total"].set_index("component")["bytes"]
    assert totals["kv pool"] == C.NUM_BLOCKS * C.BLOCK_BYTES
    rel = bd["bytes"].where(bd["measure"] == "relative", 0).cumsum()
    # each total equals the running sum of the parts before it
    for i, r in bd.iterrows():
        if r["measure"] == "total":
            assert rel[i] == pytest.approx(r["bytes"])
    last_rss = [e.rss_bytes for e in C.events(n_requests=80, leak_ids=(5, 17)) if isinstance(e, s.ProcessSample)][-1]
    assert totals["host rss"] == last_rss


def test_forecast_fails_when_demand_exceeds_free_blocks(tmp_path):
    """Requests whose max_new_tokens need more blocks than the pool has free."""
    t0 = 1_700_000_000_000_000_000
    evs = [s.KVPoolInfo(ts_ns=t0, num_blocks=10, block_size_tokens=16, block_bytes=1024, num_layers=1,
                        num_kv_heads=1, head_dim=8, dtype="float32")]
    for i in range(3):  # each will need ceil((40 + 100) / 16) = 9 blocks
        evs.append(s.RequestArrived(ts_ns=t0 + i, request_id=f"r{i}", prompt_tokens=40, max_new_tokens=100))
        evs += [s.BlockAllocated(ts_ns=t0 + 10 + i, request_id=f"r{i}", block_id=3 * i + k) for k in range(3)]
    evs.append(s.KVPoolSample(ts_ns=t0 + 100, num_blocks=10, blocks_used=9, blocks_free=1))
    logs = load([C.write(tmp_path / "p.jsonl", evs)])[0]
    fc = pressure_rules.forecast_frame(logs)
    assert fc["needed_blocks"].iloc[-1] == 3 * 9 - 9
    assert fc["free_blocks"].iloc[-1] == 1
    assert pressure_rules.memory_pressure(logs).status == "fail"


def test_attribution_finds_long_sequences_injected_halfway(tmp_path):
    """From request 150 of 300 on, prompts are 8x longer (and TTFT grows with them): the TTFT
    regression is flagged after a change point near request 150, and long sequences is a
    supported cause while compression (no runs after the change) is not."""
    evs = C.events(n_requests=300, long_from=150)
    logs = load([C.write(tmp_path / "long.jsonl", evs)])[0]
    comps = {c.metric: c for c in latency_regression.detect(logs)}
    ttft = comps["ttft"]
    assert ttft.flagged
    arrivals = sorted(e.ts_ns for e in evs if isinstance(e, s.RequestArrived))
    split = ttft.current_window_ns[0]
    assert arrivals[145] <= split <= arrivals[160]
    causes = {c.cause: c for c in ttft.causes}
    assert causes["long_sequences"].supported
    assert not causes["compression"].supported and not causes["memory_pressure"].supported
    long_ids = {e.request_id for e in evs if isinstance(e, s.RequestArrived) and e.prompt_tokens > 200}
    assert set(causes["long_sequences"].evidence["long_request_ids"]) <= long_ids


@pytest.mark.parametrize("factor", [1.0, 2.5])
def test_warm_up_steps_do_not_mask_a_step_regression_in_a_small_log(tmp_path, factor):
    """339 engine steps; the first two 10x the slowest other step (the first shapes compiled),
    every step from the middle on ``factor`` x slower. With P99 one of a few hundred samples'
    largest values, the two warm-up steps made the before-window's P99 and a 2.5x slowdown
    read as a drop; the steps up to the first finished request are the warm-up and left out:
    the verdict is the one the log without its warm-up gets."""
    def verdict(warm_steps: int):
        evs = C.events(n_requests=20)
        steps = [e for e in evs if isinstance(e, s.EngineStep)]
        mid, top = steps[len(steps) // 2].ts_ns, max(e.duration_ns for e in steps)
        first_finish = min(e.ts_ns for e in evs if isinstance(e, s.RequestFinished) and e.status == "finished")
        assert sum(e.ts_ns <= first_finish for e in steps) > warm_steps  # the slow ones are in the warm-up
        out, k = [], 0
        for e in evs:
            if isinstance(e, s.EngineStep):
                d = top * 10 if k < warm_steps else int(e.duration_ns * (factor if e.ts_ns >= mid else 1.0))
                e, k = msgspec.structs.replace(e, duration_ns=d), k + 1
            out.append(e)
        logs = load([C.write(tmp_path / f"w{warm_steps}.jsonl", out)])[0]
        step = {c.metric: c for c in latency_regression.detect(logs)}["step"]
        return step.flagged, step.quantile, step.n_baseline, step.n_current

    with_warm_up, without = verdict(2), verdict(0)
    assert with_warm_up == without
    assert with_warm_up[:2] == (factor > 1, 0.99)
