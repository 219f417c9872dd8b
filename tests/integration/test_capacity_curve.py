"""The live capacity curve (kvdiag.simulation.capacity_curve, top's CurveFold) against
``kvdiag replay --curve`` on recorded streams, against a brute-force LRU prefix cache, and its
memory bound."""

from __future__ import annotations

import gzip
import json
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from kvdiag.events import eventlog
from kvdiag.simulation.lru_curve import lru_curve
from kvdiag.simulation.capacity_curve import ReuseCurve, max_keys_for_pool
from kvdiag.simulation.curve_rows import StoreRows
from kvdiag.traces.kv_event_traces import vllm_line as _vllm_line
from kvdiag.traces.loaders import load_trace
from kvdiag.cli import main
from kvdiag.live.state import LiveState

DATA = Path(__file__).parent.parent / "data"


def _has_content(path: Path) -> bool:
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        return any('"request_arrived"' in line and ('"token_ids"' in line or '"chunk_hashes"' in line)
                   for line in f)


LOGS = sorted(p for p in DATA.glob("*/*.kvlog*") if _has_content(p))


def _live(path: Path) -> LiveState:
    state = LiveState()
    state.set_header(eventlog.read_header(path))
    state.feed_all(eventlog.iter_events(path))
    assert state.bad_events == 0
    return state


def _same(live, offline) -> None:
    assert live.distinct_blocks == offline.distinct_blocks
    assert (live.requests, live.block_refs, live.prompt_tokens) == \
        (offline.requests, offline.block_refs, offline.prompt_tokens)
    np.testing.assert_array_equal(live.block_hits, offline.block_hits)
    np.testing.assert_array_equal(live.token_hits, offline.token_hits)
    np.testing.assert_array_equal(live.request_rate, offline.request_rate)
    np.testing.assert_array_equal(live.reuse_hist, offline.reuse_hist)


def test_fixture_logs_with_content_are_found():
    assert len(LOGS) >= 8


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name)
def test_live_curve_equals_replay_curve_on_recorded_logs(path, capsys):
    state = _live(path)
    live = state.curves.requests.curve.curve()
    _same(live, lru_curve(load_trace(path)))
    # and the command's own rows, at every capacity 0..distinct+1
    caps = [str(c) for c in range(live.distinct_blocks + 2)]
    assert main(["replay", str(path), "--curve", "--json", *sum((["--capacity", c] for c in caps), [])]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["token_hit_rate"] for r in rows] == [live.at(int(c))["token_hit_rate"] for c in caps]
    assert [r["block_hit_rate"] for r in rows] == [live.at(int(c))["block_hit_rate"] for c in caps]
    # top's points are the curve's at 0.5x..4x the pool
    row = state.snapshot(state.bins and max(state.bins) * state.bin_ns or 0).curves.rows[0]
    assert row.tier == "pool" and row.basis_blocks == state.pool.info.num_blocks
    for p in row.points:
        assert p.token_hit_rate == live.at(p.capacity_blocks)["token_hit_rate"]


def _kv_batches(path: Path) -> list:
    return [ev for line in path.read_bytes().splitlines() if line.strip()
            for ev in _vllm_line(line).events]


def test_live_kv_event_curve_equals_replay_curve_on_recorded_vllm_stream():
    path = DATA / "vllm_demo" / "demo_16req_seed1.kvevents.jsonl"
    state = LiveState()
    state.feed_all(_kv_batches(path))
    (tier, rows), = state.curves.tiers.items()
    assert tier == "GPU"
    _same(rows.curve.curve(), lru_curve(load_trace(path, format="vllm")))


def _stream_two_tiers(rng: random.Random, n: int, bs: int = 4) -> list[dict]:
    """KV event batches (vLLM JSONL lines) of two tiers: prompts from 6 shared prefixes."""
    lines, seq, h = [], 0, 1
    stems = [[rng.randrange(1000) for _ in range(bs * rng.randint(1, 3))] for _ in range(6)]
    for _ in range(n):
        medium = rng.choice(["GPU", "CPU_TIER1"])
        tokens = rng.choice(stems) + [rng.randrange(1000) for _ in range(bs * rng.randint(0, 2))]
        hashes = list(range(h, h + len(tokens) // bs))
        h += len(hashes)
        ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
              "token_ids": tokens, "block_size": bs, "lora_id": None, "medium": medium}
        lines.append({"seq": seq, "ts": 1.0 + seq, "events": [ev]})
        seq += 1
        if rng.random() < 0.3:
            gone = {"type": "BlockRemoved", "block_hashes": hashes[:1], "medium": medium}
            lines.append({"seq": seq, "ts": 1.0 + seq, "events": [gone]})
            seq += 1
    return lines


def test_live_curve_per_tier_equals_replay_curve_of_that_tier(tmp_path):
    lines = _stream_two_tiers(random.Random(3), 300)
    state = LiveState()
    for line in lines:
        state.feed_all(_vllm_line(json.dumps(line).encode()).events)
    assert set(state.curves.tiers) == {"GPU", "CPU_TIER1"}
    for medium, rows in state.curves.tiers.items():
        mine = [ln for ln in lines if ln["events"][0].get("medium") == medium
                and ln["events"][0]["type"] == "BlockStored"]
        path = tmp_path / f"{medium}.jsonl"
        path.write_text("".join(json.dumps(ln) + "\n" for ln in mine))
        live = rows.curve.curve()
        _same(live, lru_curve(load_trace(path, format="vllm")))
        assert live.token_hits[-1] > 0  # the prefixes were shared


# ------------------------------------------------------------------ brute force and the bound


def _random_rows(rng: random.Random, n: int) -> list[tuple[list[int], int, bool]]:
    """(chained keys, prompt tokens, counted): prompts from shared stems, some finish rows."""
    stems = [[rng.randrange(1 << 40) for _ in range(rng.randint(1, 6))] for _ in range(12)]
    rows = []
    for _ in range(n):
        keys = list(rng.choice(stems)[:rng.randint(1, 6)]) + [rng.randrange(1 << 40)
                                                              for _ in range(rng.randint(0, 4))]
        rows.append((keys, len(keys) * 4 - rng.randint(0, 3), True))
        if rng.random() < 0.3:
            rows.append((keys + [rng.randrange(1 << 40)], 0, False))
    return rows


def _brute_lru(rows, capacity: int, bs: int = 4) -> tuple[int, int]:
    """(prefix-hit blocks, hit tokens) of an LRU prefix cache of ``capacity`` blocks, simulated
    directly: leading cached blocks hit, then every block is touched or inserted."""
    cache: OrderedDict = OrderedDict()
    hit_blocks = hit_tokens = 0
    for keys, prompt, counted in rows:
        if counted:
            for i, k in enumerate(keys):
                if k not in cache:
                    break
                hit_blocks += 1
                hit_tokens += min(bs, max(0, prompt - i * bs))
        for k in keys:
            cache[k] = None
            cache.move_to_end(k)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hit_blocks, hit_tokens


@pytest.mark.parametrize("max_keys", [1 << 12, 16])
def test_curve_points_equal_brute_force_lru(max_keys):
    rows = _random_rows(random.Random(7), 400)
    curve = ReuseCurve(4, max_keys=max_keys, flush_refs=64)
    for keys, prompt, counted in rows:
        curve.add(np.array(keys, np.int64), prompt, counted)
    c = curve.curve()
    for cap in (0, 1, 3, 8, 16, 40, 200):
        if cap > max_keys:
            continue
        blocks, tokens = _brute_lru(rows, cap)
        assert (int(c.block_hits[min(cap, c.distinct_blocks)]),
                int(c.token_hits[min(cap, c.distinct_blocks)])) == (blocks, tokens), cap
    if max_keys == 16:
        assert curve.forgotten_keys > 0  # the bound was reached and the points above still hold


def test_memory_bound_is_respected():
    rng = random.Random(1)
    curve = ReuseCurve(16, max_keys=100, flush_refs=256)
    arrays = (curve.last_time.nbytes, curve.owner.nbytes, curve.tree.nbytes, curve.hist_tokens.nbytes)
    for _ in range(2000):
        curve.add(np.array([rng.randrange(1 << 50) for _ in range(rng.randint(1, 40))], np.int64), 300)
        assert curve.tracked_keys <= 100 + 256  # between flushes: the bound + one batch
    curve.flush()
    assert curve.tracked_keys == 100
    assert curve.distinct_keys > 10_000
    assert arrays == (curve.last_time.nbytes, curve.owner.nbytes, curve.tree.nbytes, curve.hist_tokens.nbytes)
    # a row longer than the batch grows the id space once, not the bound
    curve.add(np.arange(5000, dtype=np.int64), 5000 * 16)
    curve.flush()
    assert curve.tracked_keys == 100 and len(curve.hist_tokens) == 102


def test_kv_chain_table_is_bounded():
    rows = StoreRows(ReuseCurve(4, max_keys=10))
    from kvdiag.events.schema import PrefixCacheStored

    for i in range(100):
        rows.stored(PrefixCacheStored(ts_ns=i, seq=i, block_hashes=[2 * i, 2 * i + 1], parent_hash=2 * i - 1,
                                      token_ids=list(range(8)), block_size_tokens=4))
    assert len(rows._chains) == 10


def test_bound_follows_the_pool():
    assert max_keys_for_pool(None) == 1 << 18
    assert max_keys_for_pool(50_000) == 200_000
    assert max_keys_for_pool(10 ** 7) == 1 << 21


def test_exporter_serves_the_curve_at_pool_multiples():
    from kvdiag.prometheus.exporter import PrometheusSink

    path = DATA / "demo_preempt" / "demo_16req_pool40.kvlog.gz"
    sink = PrometheusSink(eventlog.read_header(path))
    for ev in eventlog.iter_events(path):
        sink.record(ev)
    fams = {f.name: f for f in sink.collect()}
    got = {(x.labels["tier"], x.labels["multiple"]): x.value
           for x in fams["kvdiag_prefix_hit_ratio_at_capacity"].samples}
    curve = lru_curve(load_trace(path))
    want = {("pool", m): curve.at(c)["token_hit_rate"]
            for m, c in (("0.5", 20), ("1", 40), ("2", 80), ("4", 160))}
    assert got == pytest.approx(want) and got[("pool", "0.5")] < got[("pool", "1")]


def test_top_detail_shows_the_curve_per_tier():
    from kvdiag.tui.panels_sharing import curve_lines

    path = DATA / "vllm_demo" / "demo_16req_seed1.kvlog.gz"
    state = _live(path)
    snap = state.snapshot(max(state.bins) * state.bin_ns)
    text = "\n".join(t.plain for t in curve_lines(snap))
    curve = lru_curve(load_trace(path))
    pool = state.pool.info.num_blocks
    assert f"1x {100 * curve.at(pool)['token_hit_rate']:5.1f}%" in text
    assert text.count("\n") == 2 and "GPU" in text and f"x {pool} blocks (pool)" in text


def test_report_charts_the_curve_equal_to_replay(tmp_path):
    from kvdiag.diagnosis import frames as L
    from kvdiag.reports.sections import build

    path = DATA / "demo_small" / "demo_24req_seed1.kvlog.gz"
    report, _ = build(L.load([path])[0])
    sec = next(x for x in report.sections if x.key == "sharing")
    chart = next(b for b in sec.blocks if getattr(b, "title", "").startswith("LRU hit rate vs capacity"))
    curve = lru_curve(load_trace(path))
    for cap, pct in zip(chart.data["capacity_blocks"], chart.data["token_hit_rate_pct"]):
        assert pct == round(100 * curve.at(int(cap))["token_hit_rate"], 2)
    assert len(chart.data) > 10 and chart.data["token_hit_rate_pct"].is_monotonic_increasing
    assert main(["report", str(path), "-o", str(tmp_path / "r.html")]) == 0
    assert "LRU hit rate vs capacity" in (tmp_path / "r.html").read_text()


def test_requests_in_flight_are_bounded(monkeypatch):
    from kvdiag.simulation import curve_rows as cc
    from kvdiag.events.schema import RequestArrived

    monkeypatch.setattr(cc, "MAX_LIVE", 50)
    rows = cc.RequestRows(ReuseCurve(4, max_keys=64))
    for i in range(500):
        rows.arrived(RequestArrived(ts_ns=i, request_id=f"r{i}", prompt_tokens=8, token_ids=[i, 1, 2, 3, 4, 5, 6, 7]))
    assert len(rows._live) == 50 and rows.curve.requests == 500
