"""`kvdiag top`'s data layer: snapshots checked against independent pandas/numpy computations
over the same log, replay clock semantics, and the no-UI-import rule.

The log is CONSTRUCTED TEST DATA (tests/tui_data.py) until a recorded demo log exists.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.events.eventlog import read_log
from kvdiag.live.latency_fold import percentile
from kvdiag.live.state import LiveState
from kvdiag.live.replay_source import ReplaySource
from tui_data import BLOCK_BYTES, BLOCK_TOKENS, T0_NS, write_constructed_log

S = 1_000_000_000


@pytest.fixture(scope="module")
def full_log(tmp_path_factory):
    return write_constructed_log(tmp_path_factory.mktemp("top") / "full.jsonl")


@pytest.fixture(scope="module")
def bare_log(tmp_path_factory):
    return write_constructed_log(tmp_path_factory.mktemp("top") / "bare.jsonl", gpu=False, shadow=False)


def _replayed(path, seconds):
    """(state, replay position, events) after replaying ``seconds`` of the log."""
    src = ReplaySource(path, clock=lambda: 0.0)
    src.seek(seconds)
    state = LiveState(source=src.description)
    state.set_header(src.header)
    events = src.poll()
    state.feed_all(events)
    return state, src.now_ns(), events


def _state_at(path, seconds):
    state, now, _ = _replayed(path, seconds)
    return state, now


def test_snapshot_numbers_match_independent_computation(full_log):
    state, now = _state_at(full_log, 40)
    snap = state.snapshot(now)
    log = read_log(full_log)
    upto = lambda df: df[df["ts_ns"] <= now]  # noqa: E731

    fin = upto(log.frame("request_finished"))
    fin = fin[fin["status"] == "finished"]
    assert snap.sharing.engine_hit_rate == pytest.approx(fin["cached_prompt_tokens"].sum() / fin["prompt_tokens"].sum())

    pool = upto(log.frame("kv_pool_sample")).iloc[-1]
    assert snap.pool.blocks_used == pool["blocks_used"]
    assert snap.pool.token_occupancy == pytest.approx(pool["tokens_held"] / (pool["blocks_used"] * BLOCK_TOKENS))
    assert snap.memory.kv_pool_used_bytes == (pool["blocks_used"] + pool["blocks_cached"]) * BLOCK_BYTES

    window_start = (now // S - 9) * S  # the 10 one-second bins ending with the current one
    latency_start = (now // S - 59) * S  # TTFT/TPOT: the last 60 bins
    ev = log.frame("block_evicted")
    assert snap.pool.evictions_per_s == pytest.approx(((ev["ts_ns"] >= window_start) & (ev["ts_ns"] <= now)).sum() / 10)
    recent = fin[fin["ts_ns"] >= latency_start]
    ttft_ms = recent["ttft_ns"].to_numpy() / 1e6
    assert snap.latency.ttft_p99_ms == pytest.approx(np.percentile(ttft_ms, 99, method="inverted_cdf"))
    assert snap.latency.ttft_p50_ms == pytest.approx(np.percentile(ttft_ms, 50, method="inverted_cdf"))

    nvml = upto(log.frame("nvml_sample")).iloc[-1]
    assert snap.memory.nvml_used_bytes == nvml["memory_used_bytes"]

    comp = upto(log.frame("shadow_compression"))
    latest = comp.sort_values("ts_ns").groupby(["layer", "head", "method"]).tail(1)
    g = latest[(latest["layer"] < 10) & (latest["method"] == "int8")]
    row = next(r for r in snap.compression.rows if r.layers == "0-9" and r.method == "int8")
    assert row.ratio == pytest.approx(g["ratio"].mean())
    assert row.error == pytest.approx(max(g["k_rel_error"].max(), g["v_rel_error"].max()))
    assert row.attn_out_error == pytest.approx(g["attn_out_rel_error"].mean())

    loc = upto(log.frame("shadow_locality"))
    means = loc.groupby(["layer", "head"])["recent_mass"].mean()
    assert snap.locality.cells["recent"][12][4] == pytest.approx(means[(12, 4)])
    assert snap.locality.samples == len(loc)


def test_request_kv_bytes_follow_block_events(full_log):
    state, now = _state_at(full_log, 30)
    snap = state.snapshot(now)
    log = read_log(full_log)
    held: dict[str, set] = {}
    for tag, sign in (("block_allocated", 1), ("prefix_hit", 1), ("block_released", -1)):
        df = log.frame(tag)
        for ts, rid, block in df[df["ts_ns"] <= now][["ts_ns", "request_id", "block_id"]].itertuples(index=False):
            held.setdefault(rid, []).append((ts, sign, block))
    live = [r for r in snap.requests.rows if r.state in ("running", "waiting")]
    assert live, "the constructed log has requests in flight at 30 s"
    for r in live:
        blocks = set()
        for _, sign, block in sorted(held[r.request_id], key=lambda x: (x[0], -x[1])):
            (blocks.add if sign > 0 else blocks.discard)(block)
        assert set(r.block_ids) == blocks
        assert r.kv_bytes == len(blocks) * BLOCK_BYTES
    assert [r.kv_bytes for r in live] == sorted((r.kv_bytes for r in live), reverse=True)


def test_shadow_headline_matches_engine_block_size_and_gap(full_log):
    state, now = _state_at(full_log, 60)
    sh = state.snapshot(now).sharing
    df = read_log(full_log).frame("shadow_sharing")
    df = df[df["ts_ns"] <= now].sort_values("ts_ns").groupby(["block_size_tokens", "capacity_blocks"], dropna=False).tail(1)
    assert sh.shadow_config.block_size_tokens == BLOCK_TOKENS
    # the engine pool has 256 blocks; no shadow config has exactly that, so the unbounded one is used
    assert sh.shadow_config.capacity_blocks is None
    unbounded = df[(df["block_size_tokens"] == BLOCK_TOKENS) & df["capacity_blocks"].isna()].iloc[-1]
    assert sh.shadow_hit_rate == pytest.approx(unbounded["token_hit_rate"])
    assert len(sh.what_if) == len(df)
    # these shadow results have no same-requests counters and requests were always in flight
    # by 60 s: no moment when shadow (at arrival) and engine (at finish) counted the same
    # requests, so no gap is judged
    assert sh.gap is None
    # once every request finished, the latest result taken then is compared with the engine
    # rate it carries (the same requests on both sides)
    state, now = _state_at(full_log, 200)
    sh = state.snapshot(now).sharing
    fin = read_log(full_log).frame("request_finished")
    df = read_log(full_log).frame("shadow_sharing")
    last = df[(df["block_size_tokens"] == BLOCK_TOKENS) & df["capacity_blocks"].isna()
              & (df["requests"] == len(fin))].sort_values("ts_ns").iloc[-1]
    assert sh.gap == pytest.approx(last["token_hit_rate"] - last["engine_hit_rate"])


def test_absent_sources_are_reasons_not_zeros(bare_log):
    state, now = _state_at(bare_log, 30)
    snap = state.snapshot(now)
    assert snap.memory.nvml_used_bytes is None and snap.memory.allocator_reserved_bytes is None
    assert "no GPU" in snap.memory.gpu_hint
    assert snap.sharing.shadow_hit_rate is None and "--shadow" in snap.sharing.reason
    assert snap.compression.rows == () and "--shadow" in snap.compression.reason
    assert "--shadow" in snap.locality.reason
    assert snap.sharing.engine_hit_rate is not None  # the engine's own number is still there
    assert {f.rule for f in snap.alerts} >= {"collector.unavailable.nvml", "collector.unavailable.cuda-allocator"}


def test_leak_rule_flags_requests_that_never_release(tmp_path):
    """Live, the leak alert is the rules' ``leak.release_paths``, judged at the latest event:
    exactly the requests that never released and finished more than the grace period ago."""
    from kvdiag.diagnosis.rules import RELEASE_GRACE_NS
    from kvdiag.live.rules import LiveRules

    path = write_constructed_log(tmp_path / "leak.jsonl", n_requests=40, leak_every=5, shadow=False)
    state, now, events = _replayed(path, 40)
    rules = LiveRules(clock=lambda: 0.0)
    rules.record(events)
    state.rule_findings = rules.run(state.header, rules.take(state))
    leak = next(f for f in state.snapshot(now).alerts if f.rule == "leak.release_paths")
    last_ns = max(e.ts_ns for e in events)
    df = read_log(path).frame("request_finished")
    expected = {r for r, ts in zip(df["request_id"], df["ts_ns"])
                if int(r[4:]) % 5 == 0 and ts <= last_ns - RELEASE_GRACE_NS}
    assert leak.status == "fail" and set(leak.evidence["requests"]) == expected and expected


def test_p99_verdict_on_the_ttft_spike_is_the_rules(tmp_path):
    """The latency panel's P99 line is the ``p99.regression`` rule's verdict (top has no
    second definition): a TTFT spike late in a log, replayed live, fails it; the spike lies in
    the window after the change point, above the baseline's P99 and at the current one's."""
    from kvdiag.live.rules import LiveRules

    path = write_constructed_log(tmp_path / "spike.jsonl", n_requests=400, shadow=False, spike_at=0.8)
    fin = read_log(path).frame("request_finished")
    fin = fin.assign(first_token_ns=fin["ts_ns"] - fin["e2e_ns"] + fin["ttft_ns"])
    slow = fin[fin["ttft_ns"] > 2 * fin["ttft_ns"].median()]
    assert 1 <= len(slow) <= 0.1 * len(fin), "the constructed log has a short TTFT spike"
    state, now, events = _replayed(path, 10_000)
    rules = LiveRules(clock=lambda: 0.0)
    rules.record(events)
    state.rule_findings = rules.run(state.header, rules.take(state))
    verdict = next(f for f in state.snapshot(now).alerts if f.rule == "p99.regression")
    assert verdict.status == "fail"
    ttft = next(c for c in verdict.evidence["comparisons"] if c["metric"] == "ttft")
    assert ttft["flagged"] and ttft["current_window_ns"][0] <= slow["first_token_ns"].min()
    assert ttft["p99_baseline_ns"] < slow["ttft_ns"].min() <= ttft["p99_current_ns"]


def test_replay_clock_speed_pause_seek(full_log):
    t = [0.0]
    src = ReplaySource(full_log, speed=4.0, clock=lambda: t[0])
    start = src.now_ns()
    t[0] = 2.0
    assert src.now_ns() - start == 8 * S
    events = src.poll()
    assert events and all(e.ts_ns <= start + 8 * S for e in events)
    src.pause()
    t[0] = 10.0
    assert src.now_ns() - start == 8 * S and src.poll() == []
    src.seek(30)
    assert src.now_ns() - start == 38 * S
    src.resume()
    t[0] = 11.0
    assert src.now_ns() - start == 42 * S
    src.seek(10_000)
    rest = src.poll()
    assert src.finished and len(events) + len(rest) == len(read_log(full_log))


def test_snapshot_is_immutable(full_log):
    state, now = _state_at(full_log, 20)
    snap = state.snapshot(now)
    with pytest.raises(AttributeError):
        snap.events = 0  # type: ignore[misc]
    before = snap.requests.rows
    state.feed_all(ReplaySource(full_log, clock=lambda: 0.0).poll())
    assert snap.requests.rows is before


@settings(deadline=None)  # a per-example time limit is wall-clock: a loaded CI machine misses it
@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=200),
       st.sampled_from([1, 50, 90, 99, 100]))
def test_percentile_is_nearest_rank(values, q):
    assert percentile(values, q) == np.percentile(values, q, method="inverted_cdf")


def test_data_layer_does_not_import_ui_libraries():
    code = textwrap.dedent("""
        import sys
        import kvdiag.live.snapshot, kvdiag.live.state, kvdiag.live.pid_source, kvdiag.live.demo_source, kvdiag.live.replay_source, kvdiag.commands.top
        bad = [m for m in ("textual", "plotly", "rich") if m in sys.modules]
        print(bad)
        sys.exit(1 if bad else 0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_live_doctor_findings_reach_the_alerts(tmp_path):
    from kvdiag.live.rules import LiveRules

    path = write_constructed_log(tmp_path / "leak.jsonl", n_requests=40, leak_every=5, shadow=False)
    state, now, events = _replayed(path, 10_000)
    t = [0.0]
    doctor = LiveRules(period_s=1.0, max_share=0.05, clock=lambda: t[0])
    doctor.record(events)
    assert doctor.due()  # the first verdict right away, then every period
    state.rule_findings = doctor.run(state.header, doctor.take(state))
    snap = state.snapshot(now)
    leak = [f for f in snap.alerts if f.rule == "leak.release_paths"]
    assert len(leak) == 1 and leak[0].status == "fail"  # from top's own block ledger
    # the rules keep no block event: their release-path verdict is left to the ledger, and
    # every other rule's verdict is top's alert
    ruled = {f.rule: f for f in doctor.findings}
    assert ruled["leak.release_paths"].status == "n/a"
    alerts = {f.rule: f for f in snap.alerts}
    assert [r for r in ruled if r != "leak.release_paths" and alerts[r] != ruled[r]] == []
    assert "leak.pool_growth" in ruled and "p99.regression" in ruled
    assert doctor.period_s >= doctor.last_run_s / 0.05
    doctor.record(events[-1:])  # new events: due again only after the period
    assert not doctor.due() and doctor.due(finished=True)
    t[0] += doctor.period_s
    assert doctor.due()


def test_impossible_token_occupancy_is_rejected_not_shown():
    from kvdiag.events import schema as sch

    state = LiveState()
    state.feed(sch.KVPoolInfo(ts_ns=T0_NS, num_blocks=128, block_size_tokens=32, block_bytes=BLOCK_BYTES,
                              num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32"))
    state.feed(sch.KVPoolSample(ts_ns=T0_NS + 1, num_blocks=128, blocks_used=37, tokens_held=3371))
    snap = state.snapshot(T0_NS + 2)
    assert snap.pool.token_occupancy is None and snap.pool.pool_fragmentation is None
    assert "3371 tokens held > 1184 slots" in snap.pool.inconsistency
    assert any(f.rule == "collector.pool_samples" and f.status == "warn" for f in snap.alerts)
    state.feed(sch.KVPoolSample(ts_ns=T0_NS + 3, num_blocks=128, blocks_used=37, tokens_held=1000))
    snap = state.snapshot(T0_NS + 4)
    assert snap.pool.token_occupancy == pytest.approx(1000 / 1184) and not snap.pool.inconsistency


def test_kv_bytes_without_block_events_is_an_estimate_for_running_requests_only():
    from kvdiag.events import schema as sch

    state = LiveState()
    state.set_header(sch.LogHeader(schema_version=sch.SCHEMA_VERSION, bytes_per_token=46_080))
    state.feed(sch.RequestArrived(ts_ns=T0_NS, request_id="a", prompt_tokens=100))
    state.feed(sch.RequestArrived(ts_ns=T0_NS, request_id="b", prompt_tokens=50))
    state.feed(sch.RequestScheduled(ts_ns=T0_NS + 1, request_id="a"))
    rows = {r.request_id: r for r in state.snapshot(T0_NS + 2).requests.rows}
    assert rows["a"].kv_bytes == 100 * 46_080 and rows["b"].kv_bytes == 0  # b waits: holds nothing
    state.feed(sch.BlockAllocated(ts_ns=T0_NS + 3, request_id="b", block_id=7))
    rows = {r.request_id: r for r in state.snapshot(T0_NS + 4).requests.rows}
    assert rows["a"].kv_bytes == 0  # the engine reports blocks, and a holds none


def test_top_and_report_state_the_same_shadow_sampling():
    """The compression panel's sampling line is the report's, word for word (one definition)."""
    import pandas as pd

    from kvdiag.events import schema as sch
    from kvdiag.diagnosis.compression import sampling_summary

    budget = sch.ShadowBudget(ts_ns=T0_NS + 5, steps_offered=5000, steps_sampled=7, steps_skipped_budget=2,
                              steps_dropped=0, spent_ns=8_000_000, elapsed_ns=900_000_000, budget_frac=0.01,
                              clock="cpu", sample_rate=0.0013, sample_rate_max=0.05)
    state = LiveState()
    state.feed(sch.ShadowCompression(ts_ns=T0_NS + 4, layer=0, head=0, method="int8", seq_len_tokens=100,
                                     ratio=3.6, k_rel_error=0.01, v_rel_error=0.01))
    state.feed(budget)
    line = state.snapshot(T0_NS + 6).compression.sampling
    frame = pd.DataFrame([{f: getattr(budget, f) for f in sch.fields_of(sch.ShadowBudget)}])
    assert line == sampling_summary(frame)
    assert line.startswith("7 of 5000 decode steps sampled") and "rate in force 0.0013 of at most 0.05" in line
