"""The prefix-cache simulator and the one-pass LRU curve against independent computations:
a brute-force oracle written here (hypothesis traces), libCacheSim (plain cache semantics)
and a straightforward OrderedDict replay of the public Mooncake trace."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.simulation.footprint import memory_footprint
from kvdiag.simulation.lru_curve import lru_curve
from kvdiag.simulation.sharing import POLICIES, simulate
from kvdiag.traces.loaders import load_trace
from kvdiag.traces.trace import trace_from_blocks, trace_from_tokens

MOONCAKE = Path(__file__).parent.parent / "data" / "mooncake" / "synthetic_trace.jsonl"


# ---------------------------------------------------------------- brute-force oracle


def oracle(requests: list[list[int]], policy: str, capacity: int | None):
    """Per-request prefix-hit blocks and the eviction count, by the module docstring's rules,
    written as directly as possible (lists and dicts, linear scans)."""
    flat = [b for req in requests for b in req]
    cache: list[int] = []  # lru: least recent first; fifo: oldest first
    freq: dict[int, int] = {}
    last_use: dict[int, int] = {}
    next_use: dict[int, float] = {}
    small: list[int] = []
    main: list[int] = []
    ghost: list[int] = []
    s_freq: dict[int, int] = {}
    small_cap = max(1, int((capacity or 1) * 0.1))
    ghost_cap = max((capacity or 1) - small_cap, 1)
    hits, evictions, pos = [], 0, 0
    last_req: dict[int, int] = {}
    ages: list[int] = []
    victims: list[int] = []

    def cached(b):
        return (b in small or b in main) if policy == "s3fifo" else b in cache

    def held():
        return len(small) + len(main) if policy == "s3fifo" else len(cache)

    def evict():
        if policy in ("lru", "fifo"):
            victims.append(cache.pop(0))
        elif policy == "lfu":
            victims.append(min(cache, key=lambda b: (freq[b], last_use[b])))
            cache.remove(victims[-1])
        elif policy == "opt":
            victims.append(max(cache, key=lambda b: (next_use[b], b)))
            cache.remove(victims[-1])
        else:
            while True:
                if small and (len(small) >= small_cap or not main):
                    t = small.pop(0)
                    if s_freq[t] >= 2:
                        main.append(t)
                    else:
                        ghost.append(t)
                        if len(ghost) > ghost_cap:
                            ghost.pop(0)
                        victims.append(t)
                        return
                else:
                    t = main.pop(0)
                    if s_freq[t] > 0:
                        s_freq[t] -= 1
                        main.append(t)
                    else:
                        victims.append(t)
                        return

    for r, req in enumerate(requests):
        h = 0
        while h < len(req) and cached(req[h]):
            h += 1
        hits.append(h)
        for b in req:
            later = [j for j in range(pos + 1, len(flat)) if flat[j] == b]
            if cached(b):
                if policy == "lru":
                    cache.remove(b)
                    cache.append(b)
                freq[b] = freq.get(b, 0) + 1
                if policy == "s3fifo":
                    s_freq[b] = min(s_freq[b] + 1, 3)
            elif capacity != 0:
                while capacity is not None and held() >= capacity:
                    evict()
                    evictions += 1
                    ages.append(r - last_req[victims[-1]])
                if policy == "s3fifo":
                    s_freq[b] = 0
                    if b in ghost:
                        ghost.remove(b)
                        main.append(b)
                    else:
                        small.append(b)
                else:
                    cache.append(b)
                    freq[b] = 1
            last_use[b] = pos
            last_req[b] = r
            next_use[b] = later[0] if later else math.inf
            pos += 1
    return hits, evictions, ages


# ---------------------------------------------------------------- hypothesis traces

random_keys = st.lists(st.lists(st.integers(0, 9), max_size=6), min_size=1, max_size=14)
token_prompts = st.lists(st.lists(st.integers(0, 2), max_size=8), min_size=1, max_size=14)
capacities = st.one_of(st.none(), st.integers(0, 12))


def _dense(trace):
    return [trace.block_ids[trace.offsets[r]:trace.offsets[r + 1]].tolist()
            for r in range(trace.requests)]


def _check_against_oracle(trace, policy, capacity):
    res = simulate(trace, policy, capacity)
    want_hits, want_evictions, want_ages = oracle(_dense(trace), policy, capacity)
    assert res.request_hit_blocks.tolist() == want_hits
    assert res.evictions == want_evictions
    # eviction idle ages (requests since the victim's last reference), power-of-two bins
    want_hist = np.bincount([a.bit_length() for a in want_ages], minlength=64)
    assert res.eviction_age_hist.tolist() == want_hist.tolist()
    csum = np.concatenate([[0], np.cumsum(trace.block_tokens)])
    want_tokens = sum(int(csum[trace.offsets[r] + h] - csum[trace.offsets[r]])
                      for r, h in enumerate(want_hits))
    assert res.hit_tokens == want_tokens
    return res


@settings(max_examples=60, deadline=None)
@given(random_keys, st.sampled_from(POLICIES), capacities)
def test_simulator_equals_oracle_on_random_keys(requests, policy, capacity):
    _check_against_oracle(trace_from_blocks(requests), policy, capacity)


@settings(max_examples=60, deadline=None)
@given(token_prompts, st.integers(1, 2), st.sampled_from(POLICIES), capacities)
def test_simulator_equals_oracle_on_chained_prompts(prompts, block, policy, capacity):
    trace = trace_from_tokens(prompts, block)
    res = _check_against_oracle(trace, policy, capacity)
    # with chained keys Belady is the upper bound of every policy
    if policy != "opt":
        assert simulate(trace, "opt", capacity).hit_blocks >= res.hit_blocks


@settings(max_examples=60, deadline=None)
@given(st.one_of(random_keys, token_prompts), st.integers(1, 3))
def test_one_pass_curve_equals_per_capacity_runs(requests, block):
    trace = trace_from_blocks(requests, block_size_tokens=block,
                              prompt_tokens=[len(r) * block - (1 if r else 0) for r in requests])
    curve = lru_curve(trace)
    # reuse distances: rank in the recency order when the request arrives, by brute force
    order, want_reuse = [], np.zeros(64, dtype=np.int64)
    for req in _dense(trace):
        for b in req:
            if b in order:
                want_reuse[(len(order) - order.index(b)).bit_length()] += 1
        for b in req:
            if b in order:
                order.remove(b)
            order.append(b)
    assert curve.reuse_hist.tolist() == want_reuse.tolist()
    for cap in list(range(trace.num_blocks + 2)) + [None]:
        run = simulate(trace, "lru", cap)
        at = curve.at(cap)
        assert curve.block_hits[curve._index(cap)] == run.hit_blocks
        assert curve.token_hits[curve._index(cap)] == run.hit_tokens
        assert at["request_hit_rate"] == pytest.approx(run.request_hit_rate, abs=1e-12)


# ---------------------------------------------------------------- libCacheSim, plain semantics


def _libcachesim_hits(seq, policy, capacity):
    import libcachesim as lcs

    cache = {"lru": lcs.LRU, "lfu": lcs.LFU, "fifo": lcs.FIFO}[policy](capacity)
    hits = 0
    for b in seq:
        req = lcs.Request()
        req.obj_id = int(b) + 1
        req.obj_size = 1
        hits += bool(cache.get(req))
    return hits


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
def test_plain_semantics_match_libcachesim_on_mooncake(policy):
    trace = load_trace(MOONCAKE).plain()
    seq = trace.block_ids[:30000]
    sub = trace_from_blocks([[int(b)] for b in seq])
    for cap in (1, 64, 1000, 8000):
        assert simulate(sub, policy, cap).hit_blocks == _libcachesim_hits(seq, policy, cap)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=120), st.integers(1, 10),
       st.sampled_from(["lru", "lfu", "fifo"]))
def test_plain_semantics_match_libcachesim_random(seq, capacity, policy):
    trace = trace_from_blocks([[b] for b in seq])
    assert simulate(trace, policy, capacity).hit_blocks == _libcachesim_hits(seq, policy, capacity)


# ---------------------------------------------------------------- the public Mooncake trace


def _straightforward_mooncake(capacity):
    """LRU prefix cache over the raw JSONL with an OrderedDict; nothing shared with kvdiag."""
    cache: OrderedDict = OrderedDict()
    hit_blocks = hit_tokens = refs = prompt = 0
    per_request = []
    with open(MOONCAKE) as f:
        for line in f:
            req = json.loads(line)
            ids, n = req["hash_ids"], req["input_length"]
            h = 0
            while h < len(ids) and ids[h] in cache:
                h += 1
            tokens = sum(min(512, n - 512 * j) for j in range(h))
            hit_blocks += h
            hit_tokens += tokens
            refs += len(ids)
            prompt += n
            per_request.append(tokens / n if n else None)
            for b in ids:
                if b in cache:
                    cache.move_to_end(b)
                else:
                    if capacity is not None:
                        while len(cache) >= capacity:
                            cache.popitem(last=False)
                    if capacity != 0:
                        cache[b] = True
    rates = [x for x in per_request if x is not None]
    return hit_blocks / refs, hit_tokens / prompt, sum(rates) / len(rates), refs


@pytest.mark.parametrize("capacity", [None, 2000, 10000])
def test_mooncake_numbers_equal_straightforward_replay(capacity):
    trace = load_trace(MOONCAKE)
    assert trace.format == "mooncake"
    assert trace.requests == sum(1 for line in MOONCAKE.read_text().splitlines() if line.strip())
    block_rate, token_rate, request_rate, refs = _straightforward_mooncake(capacity)
    res = simulate(trace, "lru", capacity)
    assert res.block_refs == refs
    assert res.block_hit_rate == pytest.approx(block_rate, abs=1e-12)
    assert res.token_hit_rate == pytest.approx(token_rate, abs=1e-12)
    assert res.request_hit_rate == pytest.approx(request_rate, abs=1e-12)
    at = lru_curve(trace).at(capacity)
    assert at["block_hit_rate"] == pytest.approx(block_rate, abs=1e-12)
    assert at["token_hit_rate"] == pytest.approx(token_rate, abs=1e-12)


def test_opt_bounds_all_policies_on_mooncake():
    trace = load_trace(MOONCAKE)
    opt = simulate(trace, "opt", 4000).hit_blocks
    for policy in ("lru", "fifo", "lfu", "s3fifo"):
        assert simulate(trace, policy, 4000).hit_blocks <= opt


def test_memory_footprint_against_sets():
    trace = load_trace(MOONCAKE)
    fp = memory_footprint(trace, concurrency=16)
    reqs = _dense(trace)
    pages = [math.ceil(int(n) / 512) for n in trace.prompt_tokens]
    peak_u = max(sum(pages[max(0, i - 15):i + 1]) for i in range(len(reqs)))
    peak_s = max(len(set().union(*reqs[max(0, i - 15):i + 1])) for i in range(len(reqs)))
    assert (fp.peak_unshared_blocks, fp.peak_shared_blocks) == (peak_u, peak_s)


# ---------------------------------------------------------------- compiled vs pure Python


def test_pure_python_fallback_equals_compiled():
    script = (
        "import json,sys\n"
        "from kvdiag.traces.loaders import load_trace\n"
        "from kvdiag.simulation.sharing import simulate, POLICIES\n"
        "from kvdiag.simulation.lru_curve import lru_curve\n"
        "t = load_trace(sys.argv[1])\n"
        "t = type(t)(t.block_ids[:t.offsets[300]], t.offsets[:301], t.block_tokens[:t.offsets[300]],"
        " t.prompt_tokens[:300], t.num_blocks, t.block_size_tokens, t.format)\n"
        "out = [simulate(t, p, 700).request_hit_blocks.tolist() for p in POLICIES]\n"
        "out.append(lru_curve(t).block_hits.tolist())\n"
        "print(json.dumps(out))\n"
    )
    runs = []
    for disable in ("0", "1"):
        env = dict(os.environ, NUMBA_DISABLE_JIT=disable)
        proc = subprocess.run([sys.executable, "-c", script, str(MOONCAKE)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout))
    assert runs[0] == runs[1]


@settings(max_examples=40, deadline=None)
@given(token_prompts, st.integers(1, 2), st.integers(1, 9), capacities)
def test_streamed_replay_equals_whole_trace(prompts, block, batch_refs, capacity):
    """Batches of any size, block ids and stack state grown between them: same results."""
    from kvdiag.simulation.streamed_replay import replay_stream
    from kvdiag.traces.request_traces import RequestRecord
    from kvdiag.pool.hashing import chunk_hashes

    trace = trace_from_tokens(prompts, block)
    records = [RequestRecord(chunk_hashes(p, block), len(p)) for p in prompts]
    policies = ["lru", "fifo", "lfu", "s3fifo"]
    rep = replay_stream(records, block, policies, [capacity], curve=True, concurrency=3,
                        batch_refs=batch_refs)
    for got in rep.results():
        want = simulate(trace, got.policy, capacity)
        assert got.to_json() == want.to_json()
        assert got.request_hit_tokens.tolist() == want.request_hit_tokens.tolist()
        assert got.eviction_age_hist.tolist() == want.eviction_age_hist.tolist()
    curve, whole = rep.curve(), lru_curve(trace)
    assert curve.token_hits.tolist() == whole.token_hits.tolist()
    assert curve.reuse_hist.tolist() == whole.reuse_hist.tolist()
    fp, want_fp = rep.footprint(), memory_footprint(trace, concurrency=3)
    assert (fp.peak_unshared_blocks, fp.peak_shared_blocks) == (
        want_fp.peak_unshared_blocks, want_fp.peak_shared_blocks)
