"""The tiered prefix-cache simulator against independent computations: a brute-force oracle
written here with plain Python lists (hypothesis traces), the single-cache simulator (one tier;
unbounded lower tiers), and block/bytes conservation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.simulation import _tierkernels as K
from kvdiag.simulation.sharing import simulate
from kvdiag.simulation.prefill_rate import prefill_s_per_token_from_steps
from kvdiag.simulation.tier_spec import Tier, parse_tiers
from kvdiag.simulation.tiers import simulate_tiers
from kvdiag.traces.loaders import load_trace
from kvdiag.traces.trace import trace_from_blocks

MOONCAKE = Path(__file__).parent.parent / "data" / "mooncake" / "synthetic_trace.jsonl"
DEMO_LOG = Path(__file__).parent.parent / "data" / "demo_small" / "demo_24req_seed1.kvlog.gz"


# ---------------------------------------------------------------- brute-force oracle


def oracle(requests: list[list[int]], caps: list, write: str, counted=None):
    """Per-request prefix hits (any tier), per-request hits by serving tier and the tier
    counters, by kvdiag.simulation.tiers' rules, as directly as possible: one Python list per
    tier, least recently used first; ``caps[t]`` None = unbounded. ``counted[r]`` False: a row
    of blocks a request adds at finish (nothing is read or counted as a hit)."""
    T = len(caps)
    tiers: list[list[int]] = [[] for _ in range(T)]
    c = [dict(evicted=0, demoted=0, already=0, dropped=0, written=0, promoted=0, removed=0,
              raised=0, inserted=0, peak=0) for _ in range(T)]
    hits, tier_hits = [], []

    def place(t, x):
        while True:
            tiers[t].append(x)
            if caps[t] is None or len(tiers[t]) <= caps[t]:
                c[t]["peak"] = max(c[t]["peak"], len(tiers[t]))
                return
            victim = tiers[t].pop(0)
            c[t]["evicted"] += 1
            if t == T - 1:
                c[t]["dropped"] += 1
                return
            if victim in tiers[t + 1]:
                c[t]["already"] += 1
                return
            c[t]["demoted"] += 1
            x, t = victim, t + 1

    for r, req in enumerate(requests):
        h = 0
        while h < len(req) and any(req[h] in tier for tier in tiers):
            h += 1
        hits.append(h)
        if counted is not None and not counted[r]:
            h = 0
        per = [0] * T
        for i, x in enumerate(req):
            if x in tiers[0]:
                tiers[0].remove(x)
                tiers[0].append(x)
                if i < h:
                    per[0] += 1
                continue
            below = [t for t in range(1, T) if x in tiers[t]]
            if below:
                t = below[0]
                if i < h:
                    per[t] += 1
                    c[t]["promoted"] += 1
                else:
                    c[t]["raised"] += 1
                if write == "through":
                    if i < h:
                        tiers[t].remove(x)
                        tiers[t].append(x)
                else:
                    tiers[t].remove(x)
                    c[t]["removed"] += 1
                place(0, x)
                continue
            c[0]["inserted"] += 1
            place(0, x)
            if write == "through":
                for t in range(1, T):
                    if x not in tiers[t]:
                        c[t]["written"] += 1
                        place(t, x)
        tier_hits.append(per)
    return hits, tier_hits, c, [len(t) for t in tiers]


_NAMES = {"evicted": K.T_EVICTED, "demoted": K.T_DEMOTED, "already": K.T_ALREADY,
          "dropped": K.T_DROPPED, "written": K.T_WRITTEN, "promoted": K.T_PROMOTED,
          "removed": K.T_REMOVED, "raised": K.T_RAISED, "inserted": K.T_INSERTED,
          "peak": K.T_PEAK}


def _tiers(caps):
    return [Tier(f"t{k}", c) for k, c in enumerate(caps)]


requests_st = st.lists(st.lists(st.integers(0, 14), min_size=0, max_size=7), min_size=1,
                       max_size=30)
caps_st = st.lists(st.one_of(st.none(), st.integers(0, 6)), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(requests_st, caps_st, st.sampled_from(["back", "through"]))
def test_matches_brute_force_oracle(requests, caps, write):
    """The one kernel, for 1 to 5 tiers."""
    tr = trace_from_blocks(requests, block_size_tokens=4)
    res = simulate_tiers(tr, _tiers(caps), write, compare_top_alone=False)
    # the oracle sees the trace's dense ids, in the same order
    reqs = [tr.block_ids[tr.offsets[r]:tr.offsets[r + 1]].tolist() for r in range(tr.rows)]
    hits, tier_hits, counters, sizes = oracle(reqs, caps, write)
    assert res.request_hit_blocks.tolist() == hits
    assert res.request_tier_hit_blocks.tolist() == tier_hits
    for t in range(len(caps)):
        for name, k in _NAMES.items():
            assert res.counter(t, k) == counters[t][name], (t, name)
    assert res.final_sizes.tolist() == sizes


@settings(max_examples=150, deadline=None)
@given(requests_st, caps_st, st.sampled_from(["back", "through"]), st.data())
def test_rows_added_at_finish_match_the_oracle(requests, caps, write, data):
    """kvdiag logs' traces carry rows of blocks a request adds when it finishes: they move
    blocks to the top tier but read nothing and count no hit."""
    from kvdiag.traces.trace import TraceBuilder

    counted = data.draw(st.lists(st.booleans(), min_size=len(requests), max_size=len(requests)))
    b = TraceBuilder(4, "blocks", "")
    for keys, c in zip(requests, counted):
        b.add(np.asarray(keys, np.int64), 4 * len(keys), counted=c)
    tr = b.build()
    res = simulate_tiers(tr, _tiers(caps), write, compare_top_alone=False)
    reqs = [tr.block_ids[tr.offsets[r]:tr.offsets[r + 1]].tolist() for r in range(tr.rows)]
    hits, tier_hits, counters, sizes = oracle(reqs, caps, write, counted)
    keep = [r for r in range(len(requests)) if counted[r]]
    assert res.request_hit_blocks.tolist() == [hits[r] for r in keep]
    assert res.request_tier_hit_blocks.tolist() == [tier_hits[r] for r in keep]
    for t in range(len(caps)):
        for name, k in _NAMES.items():
            assert res.counter(t, k) == counters[t][name], (t, name)
    assert res.final_sizes.tolist() == sizes


# ---------------------------------------------------------------- against the single cache


@pytest.fixture(scope="module")
def mooncake():
    return load_trace(MOONCAKE)


@pytest.mark.parametrize("cap", [1, 100, 1000, 5000, None])
def test_one_tier_is_the_single_cache(mooncake, cap):
    single = simulate(mooncake, "lru", cap)
    tiered = simulate_tiers(mooncake, [Tier("gpu", cap)], compare_top_alone=False)
    assert np.array_equal(tiered.request_hit_blocks, single.request_hit_blocks)
    assert np.array_equal(tiered.request_tier_hit_tokens[:, 0], single.request_hit_tokens)
    assert tiered.counter(0, K.T_EVICTED) == single.evictions
    assert tiered.counter(0, K.T_PEAK) == single.peak_cached_blocks


def test_one_tier_is_the_single_cache_on_a_kvdiag_log():
    """A kvdiag log's trace has rows of blocks added at finish (not counted as requests)."""
    tr = load_trace(DEMO_LOG)
    assert tr.counted is not None
    for cap in (8, 64, None):
        single = simulate(tr, "lru", cap)
        tiered = simulate_tiers(tr, [Tier("gpu", cap)], compare_top_alone=False)
        assert np.array_equal(tiered.request_hit_blocks, single.request_hit_blocks)
        assert tiered.hit_tokens == single.hit_tokens


@pytest.mark.parametrize("write", ["back", "through"])
@pytest.mark.parametrize("top", [0, 50, 2000])
def test_unbounded_lower_tier_gives_the_unbounded_hit_rate(mooncake, write, top):
    unbounded = simulate(mooncake, "lru", None)
    for stack in ([Tier("gpu", top), Tier("cpu", None)],
                  [Tier("gpu", top), Tier("cpu", 300), Tier("disk", None)]):
        tiered = simulate_tiers(mooncake, stack, write, compare_top_alone=False)
        assert np.array_equal(tiered.request_hit_blocks, unbounded.request_hit_blocks)
        assert tiered.hit_tokens == unbounded.hit_tokens


@pytest.mark.parametrize("write", ["back", "through"])
def test_bytes_balance(mooncake, write):
    stack = [Tier("gpu", 400), Tier("cpu", 3000), Tier("disk", 9000)]
    res = simulate_tiers(mooncake, stack, write, bytes_per_token=100, compare_top_alone=False)
    c = res.counters
    df = res.per_tier()
    for t in range(3):
        # every block evicted from a tier is stored below, already there, or dropped
        assert c[t, K.T_EVICTED] == c[t, K.T_DEMOTED] + c[t, K.T_ALREADY] + c[t, K.T_DROPPED]
        if t < 2:
            assert c[t, K.T_DROPPED] == 0
            assert df.demoted_in_blocks[t + 1] == c[t, K.T_DEMOTED]
        inflow = (c[0, K.T_INSERTED] + c[1:, K.T_PROMOTED].sum() + c[1:, K.T_RAISED].sum()
                  if t == 0 else (c[t - 1, K.T_DEMOTED] + c[t, K.T_WRITTEN]))
        outflow = c[t, K.T_EVICTED] - (0 if t else 0) + (c[t, K.T_REMOVED] if t else 0)
        assert res.final_sizes[t] == inflow - outflow
    if write == "back":
        assert (c[:, K.T_ALREADY] == 0).all() and (c[:, K.T_WRITTEN] == 0).all()
        assert (c[1:, K.T_REMOVED] == c[1:, K.T_PROMOTED] + c[1:, K.T_RAISED]).all()
        assert res.final_sizes.sum() <= mooncake.num_blocks  # exclusive tiers
    else:
        assert (c[:, K.T_REMOVED] == 0).all()
        assert c[1, K.T_WRITTEN] + c[0, K.T_DEMOTED] >= c[0, K.T_INSERTED] - 3000 * 0
    # bytes: the promoted bytes are the promoted blocks at the block's bytes
    assert df.promoted_bytes[1] == c[1, K.T_PROMOTED] * 100 * mooncake.block_size_tokens


def test_ttft_effect_by_hand():
    """Two requests, the second re-reads 2 blocks that were demoted to the CPU tier."""
    tr = trace_from_blocks([[1, 2], [3, 4], [1, 2]], block_size_tokens=10,
                           prompt_tokens=[20, 20, 20])
    stack = [Tier("gpu", 2), Tier("cpu", None, bandwidth_bytes_per_s=1000.0)]
    res = simulate_tiers(tr, stack, bytes_per_token=5, prefill_s_per_token=0.01)
    df = res.per_tier()
    assert df.hit_tokens.tolist() == [0, 20]
    assert df.promoted_blocks.tolist() == [0, 2]
    # saved 20 tokens x 0.01 s; read 2 blocks x 50 B at 1000 B/s; over 3 requests
    assert df["prefill_saved(s/request)"][1] == pytest.approx(0.2 / 3)
    assert df["transfer(s/request)"][1] == pytest.approx(0.1 / 3)
    assert df["net_ttft(s/request)"][1] == pytest.approx(0.1 / 3)
    per_req = res.request_ttft_s()
    assert per_req[:, 1].tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert res.top_alone_hit_tokens == 0  # LRU of 2 blocks alone: 1, 2 evicted by 3, 4
    assert res.versus_top_alone_s_per_request() == pytest.approx(0.1 / 3)
    assert res.request_quantiles((0.5, 1.0)) == pytest.approx({"p50": 0.0, "p100": 0.1})


# ---------------------------------------------------------------- parsing, prefill cost


def test_parse_tiers():
    tiers = parse_tiers("gpu=1000,cpu=40GiB,25GB/s,disk=unbounded,3e9")
    assert [t.name for t in tiers] == ["gpu", "cpu", "disk"]
    assert tiers[0].capacity_blocks == 1000 and tiers[0].bandwidth_bytes_per_s is None
    assert tiers[1].capacity_bytes == 40 * 2**30 and tiers[1].bandwidth_bytes_per_s == 25e9
    assert tiers[2].capacity_blocks is None and tiers[2].bandwidth_bytes_per_s == 3e9
    assert tiers[1].resolved(2**20).capacity_blocks == 40 * 2**10
    for bad in ("", "25GB/s", "gpu=10,gpu=20", "gpu=lots", "gpu=10,1GB/s,2GB/s", "gpu=1,0GB/s"):
        with pytest.raises(ValueError):
            parse_tiers(bad)
    with pytest.raises(ValueError, match="bytes per block"):
        tiers[1].resolved(None)


def test_prefill_cost_from_engine_steps():
    rng = np.random.default_rng(0)
    p = rng.integers(0, 300, 50)
    d = rng.integers(0, 8, 50)
    steps = pd.DataFrame({"prefill_tokens": p, "decode_tokens": d,
                          "duration_ns": (2e6 + 1e5 * p + 3e6 * d).astype(np.int64)})
    assert prefill_s_per_token_from_steps(steps) == pytest.approx(1e-4)
    assert prefill_s_per_token_from_steps(steps.iloc[:0]) is None


# ---------------------------------------------------------------- the CLI


def _replay(*args):
    return subprocess.run([sys.executable, "-m", "kvdiag", "replay", *args],
                          capture_output=True, text=True, timeout=120)


def test_replay_tiers_json_on_mooncake():
    out = _replay(str(MOONCAKE), "--tiers", "gpu=500,cpu=4000,25GB/s,disk=unbounded,2GB/s",
                  "--bytes-per-token", "131072", "--prefill-s-per-token", "1e-4", "--json")
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    tiers = obj["tiers"]
    assert [t["tier"] for t in tiers] == ["gpu", "cpu", "disk"]
    unbounded = simulate(load_trace(MOONCAKE), "lru", None)
    assert sum(t["hit_blocks"] for t in tiers) == unbounded.hit_blocks
    assert obj["prefill_source"] == "--prefill-s-per-token"
    assert tiers[1]["transfer(s/request)"] > 0 and obj["net_ttft_vs_top_alone(s/request)"] is not None
    q = obj["net_ttft_saved_quantiles(s)"]
    assert q["p50"] <= q["p90"] <= q["p99"]


def test_replay_tiers_on_a_kvdiag_log_measures_prefill_cost():
    out = _replay(str(DEMO_LOG), "--tiers", "gpu=16,cpu=unbounded,10GB/s", "--json")
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["prefill_source"].startswith("engine steps")
    assert obj["prefill_s_per_token"] > 0
    assert obj["block_bytes"] == 1474560  # the demo pool's block: page 32, fp32 SmolLM2
    table = _replay(str(DEMO_LOG), "--tiers", "gpu=16,cpu=unbounded,10GB/s")
    assert table.returncode == 0 and "cpu" in table.stdout and "net TTFT" in table.stdout


def test_replay_tiers_bad_spec_is_one_line():
    out = _replay(str(MOONCAKE), "--tiers", "gpu=40GiB")
    assert out.returncode == 2
    assert "bytes per block" in out.stderr and "Traceback" not in out.stderr
    out = _replay(str(MOONCAKE), "--tiers", "gpu=10", "--capacity", "100")
    assert out.returncode == 2 and "--tiers replaces --capacity" in out.stderr
