"""Plug-in replacement policies: the classics written as plug-ins equal the numba fast paths
exactly; the learned policies make the decisions hand-worked traces call for; a policy that
fails is named with its request and line; `kvdiag replay --policy-file` end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.simulation.learned_policies import LeCaRPolicy, PrefixLRUPolicy
from kvdiag.simulation.policies import FIFOPolicy, LFUPolicy, LRUPolicy
from kvdiag.simulation.policy_replay import (PolicyError, load_policy_file, simulate_policy)
from kvdiag.simulation.sharing import simulate
from kvdiag.traces.loaders import load_trace
from kvdiag.traces.trace import trace_from_blocks, trace_from_tokens
from kvdiag.cli import main

DATA = Path(__file__).parent.parent / "data"
MOONCAKE = DATA / "mooncake" / "synthetic_trace.jsonl"
DEMO_LOG = next((DATA / "demo_small").glob("*.kvlog.gz"))
DOCS = Path(__file__).parents[2] / "docs" / "policies.md"
PLUGINS_OF = {"lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy}


def _same_run(fast, plugin):
    assert plugin.request_hit_blocks.tolist() == fast.request_hit_blocks.tolist()
    assert (plugin.hit_tokens, plugin.evictions, plugin.peak_cached_blocks) == \
        (fast.hit_tokens, fast.evictions, fast.peak_cached_blocks)
    assert plugin.eviction_age_hist.tolist() == fast.eviction_age_hist.tolist()


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu"])
def test_classic_plugins_equal_fast_paths_on_mooncake(policy):
    trace = load_trace(MOONCAKE)
    for capacity in (0, 1, 700, 5000, None):
        _same_run(simulate(trace, policy, capacity),
                  simulate_policy(trace, PLUGINS_OF[policy], capacity))


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu"])
def test_classic_plugins_equal_fast_paths_on_a_recorded_log(policy):
    trace = load_trace(DEMO_LOG)  # rows of blocks added at finish: inserted, never looked up
    assert trace.counted is not None
    for capacity in (1, 8, 40, None):
        _same_run(simulate(trace, policy, capacity),
                  simulate_policy(trace, PLUGINS_OF[policy], capacity))


random_requests = st.lists(st.lists(st.integers(0, 9), max_size=6), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(random_requests, st.one_of(st.none(), st.integers(0, 12)))
def test_classic_plugins_equal_fast_paths_on_random_traces(requests, capacity):
    trace = trace_from_blocks(requests)
    for policy, plugin in PLUGINS_OF.items():
        _same_run(simulate(trace, policy, capacity), simulate_policy(trace, plugin, capacity))


# ---------------------------------------------------------------- prefix-aware LRU


def prefix_lru_oracle(requests: list[list[int]], capacity: int) -> list[int]:
    """Per-request prefix hits of "evict the least recently used cached block that no cached
    block names as its parent", by linear scans (parent = the block before it in the first
    prompt that referenced it)."""
    cache: set[int] = set()
    parent: dict[int, int] = {}
    last_use: dict[int, int] = {}
    hits, clock = [], 0
    for req in requests:
        h = 0
        while h < len(req) and req[h] in cache:
            h += 1
        hits.append(h)
        for pos, b in enumerate(req):
            clock += 1
            if b not in parent:
                parent[b] = req[pos - 1] if pos > 0 and req[pos - 1] != b else -1
            if b not in cache and capacity > 0:
                while len(cache) >= capacity:
                    leaves = [c for c in cache if not any(parent[d] == c for d in cache)]
                    cache.remove(min(leaves, key=lambda c: last_use[c]))
                cache.add(b)
            last_use[b] = clock
    return hits


@settings(max_examples=150, deadline=None)
@given(random_requests, st.integers(0, 12))
def test_prefix_lru_equals_its_oracle(requests, capacity):
    trace = trace_from_blocks(requests)
    dense = [trace.block_ids[trace.offsets[r]:trace.offsets[r + 1]].tolist()
             for r in range(trace.rows)]
    got = simulate_policy(trace, PrefixLRUPolicy, capacity)
    assert got.request_hit_blocks.tolist() == prefix_lru_oracle(dense, capacity)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), max_size=8), min_size=1, max_size=14),
       st.integers(0, 12))
def test_learned_policies_stay_under_an_unbounded_cache(prompts, capacity):
    # every prefix hit of a bounded cache is a hit of an unbounded one (it holds every block
    # seen). OPT (Belady, always inserting) is no such bound for prefix hits: on
    # [[0, 2, 0], [0, 2, 0], [0]] at capacity 2 it evicts the chain's middle block and hits 1,
    # where prefix-lru keeps the head and hits 2
    trace = trace_from_tokens(prompts, 1)
    best = simulate(trace, "lru", len(trace.block_ids) + 1).hit_blocks
    for plugin in (LeCaRPolicy, PrefixLRUPolicy):
        assert 0 <= simulate_policy(trace, plugin, capacity).hit_blocks <= best


def test_prefix_lru_evicts_the_tail_not_the_head():
    # capacity 3: [A B C] fills the cache; [D] needs room. LRU drops A (oldest) and the
    # chain is dead; the right choice (OPT's too) is C, so [A B C] again hits A and B.
    requests = [[1, 2, 3], [4], [1, 2, 3]]
    trace = trace_from_blocks(requests)
    assert simulate_policy(trace, PrefixLRUPolicy, 3).request_hit_blocks.tolist() == [0, 0, 2]
    assert simulate(trace, "lru", 3).request_hit_blocks.tolist() == [0, 0, 0]
    assert simulate(trace, "opt", 3).request_hit_blocks.tolist() == [0, 0, 2]


def test_prefix_lru_keeps_a_shared_head():
    # S heads two chains. At [Q] the cache holds S, Y, Z; LRU evicts S (touched before Y);
    # S still has a cached successor (Y), so prefix-LRU evicts Y and [S W] hits S.
    requests = [[10, 11], [10, 12], [13], [14], [10, 15]]
    trace = trace_from_blocks(requests)
    assert simulate_policy(trace, PrefixLRUPolicy, 3).request_hit_blocks.tolist() == \
        [0, 1, 0, 0, 1]
    assert simulate(trace, "lru", 3).request_hit_blocks.tolist() == [0, 1, 0, 0, 0]


def test_prefix_lru_at_capacity_one_evicts_a_head_to_insert_its_tail():
    trace = trace_from_blocks([[1, 2], [1, 2]])
    assert simulate_policy(trace, PrefixLRUPolicy, 1).request_hit_blocks.tolist() == [0, 0]


# ---------------------------------------------------------------- LeCaR


class _Recorder(LeCaRPolicy):
    """LeCaR that keeps its last weights where the test can read them."""

    last: list = []

    def on_insert(self, block, ref):
        super().on_insert(block, ref)
        _Recorder.last = list(self.weights)


def _singles(blocks: list[int]):
    return trace_from_blocks([[b] for b in blocks])


def test_lecar_learns_frequency_when_recency_is_wrong():
    # capacity 4: A, then rounds of A + 4 fresh blocks. When the 4th fresh block arrives LRU
    # would evict A (oldest) and LFU a fresh block (one reference): A is the right keep.
    hot, fresh, blocks = 0, iter(range(1, 10_000)), [0, 0, 0]
    for _ in range(150):
        blocks += [hot] + [next(fresh) for _ in range(4)]
    trace = _singles(blocks)
    run = simulate_policy(trace, _Recorder, 4)
    lru_weight, lfu_weight = _Recorder.last
    assert lfu_weight > 0.9 > lru_weight
    hot_hits = [run.request_hit_blocks[i] for i, b in enumerate(blocks) if b == hot]
    assert sum(hot_hits[-50:]) >= 45  # LFU hits A every round; LRU never
    assert simulate(trace, "lfu", 4).hit_blocks > simulate(trace, "lru", 4).hit_blocks == 3  # A A A A


def test_lecar_learns_recency_when_frequency_is_wrong():
    # capacity 2: A 20 times (LFU will never let it go), then B C B C ...: only LRU keeps both.
    blocks = [0] * 20 + [1, 2] * 100
    trace = _singles(blocks)
    run = simulate_policy(trace, _Recorder, 2)
    assert run.request_hit_blocks[-50:].tolist() == [1] * 50
    assert simulate(trace, "lfu", 2).request_hit_blocks[-50:].tolist() == [0] * 50
    lru_weight, lfu_weight = _Recorder.last
    assert lru_weight >= lfu_weight


def test_lecar_replays_repeat():
    trace = load_trace(MOONCAKE)
    a = simulate_policy(trace, LeCaRPolicy, 700)
    b = simulate_policy(trace, LeCaRPolicy, 700)
    assert a.request_hit_blocks.tolist() == b.request_hit_blocks.tolist()


# ---------------------------------------------------------------- failing policies


def _policy_file(tmp_path, body: str) -> Path:
    path = tmp_path / "my_policy.py"
    path.write_text("from kvdiag.simulation.policies import Policy\n\n\n" + body)
    return path


RAISES = """\
class Crashes(Policy):
    def on_insert(self, block, ref):
        if ref.request == 2:
            raise RuntimeError("boom")

    def victim(self, ref):
        return 0
"""

INVALID = """\
class Confused(Policy):
    name = "confused"

    def victim(self, ref):
        return -1
"""


def test_a_raising_policy_names_request_block_and_line(tmp_path):
    (policy,) = load_policy_file(_policy_file(tmp_path, RAISES))
    trace = trace_from_blocks([[1, 2], [3], [4, 5]])
    with pytest.raises(PolicyError) as err:
        simulate_policy(trace, policy, None)
    msg = str(err.value)
    assert "my_policy.py:7:" in msg and "RuntimeError: boom" in msg and "on_insert" in msg
    assert "at request 2 " in msg and "block 3 at position 0" in msg


def test_an_invalid_victim_is_named(tmp_path):
    (policy,) = load_policy_file(_policy_file(tmp_path, INVALID))
    trace = trace_from_blocks([[1, 2], [3]])
    with pytest.raises(PolicyError, match=r"my_policy.py:7: policy 'confused' returned an "
                       r"invalid victim -1 .* at request 1 "):
        simulate_policy(trace, policy, 2)


@pytest.mark.parametrize("body, capacity, expected", [
    (INVALID, "100", r"my_policy.py:7: policy 'confused' returned an invalid victim -1"),
    (RAISES, "unbounded", r"my_policy.py:7: policy 'crashes' raised RuntimeError: boom in "
     r"on_insert at request 2 "),
    ("x = (\n", "100", r"my_policy.py:4: syntax error"),
    ("import no_such_module_here\n", "100", r"my_policy.py:4: the policy file raised"),
    ("X = 1\n", "100", r"my_policy.py: expected a subclass of kvdiag.simulation.policies.Policy"),
])
def test_cli_exits_2_with_one_line(tmp_path, capsys, body, capacity, expected):
    path = _policy_file(tmp_path, body)
    assert main(["replay", str(MOONCAKE), "--policy-file", str(path), "--capacity",
                 capacity]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert re.search(expected, err), err


def test_cli_missing_policy_file(tmp_path, capsys):
    assert main(["replay", str(MOONCAKE), "--policy-file", str(tmp_path / "none.py")]) == 2
    assert "cannot read the policy file" in capsys.readouterr().err


# ---------------------------------------------------------------- CLI and the docs' example


def _docs_example() -> str:
    text = DOCS.read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_docs_example_is_short_and_replays_beside_lru_s3fifo_opt(tmp_path, capsys):
    code = _docs_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 25
    path = tmp_path / "my_policy.py"
    path.write_text(code)
    (policy,) = load_policy_file(path)
    assert main(["replay", str(DEMO_LOG), "--policy-file", str(path), "--capacity", "16",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["policy"] for r in rows] == ["lru", "s3fifo", "opt", policy.label()]
    trace = load_trace(DEMO_LOG)
    for row in rows[:3]:
        assert row["block_hit_rate"] == simulate(trace, row["policy"], 16).block_hit_rate
    assert rows[3]["block_hit_rate"] <= rows[2]["block_hit_rate"]


def test_cli_learned_policies_by_name_equal_the_api(capsys):
    assert main(["replay", str(MOONCAKE), "--policy", "prefix-lru", "--policy", "lru-plugin",
                 "--capacity", "2000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    trace = load_trace(MOONCAKE)
    assert rows[0]["block_hit_rate"] == simulate_policy(trace, PrefixLRUPolicy, 2000).block_hit_rate
    assert rows[1]["block_hit_rate"] == simulate(trace, "lru", 2000).block_hit_rate
    assert np.isclose(rows[1]["token_hit_rate"], simulate(trace, "lru", 2000).token_hit_rate)


class _KeepsHeap(LFUPolicy):
    heap_sizes: list = []

    def on_hit(self, block, ref):
        super().on_hit(block, ref)
        _KeepsHeap.heap_sizes.append(len(self.heap.items))


def test_stale_heap_entries_do_not_pile_up():
    # one entry per hit without compaction: memory would follow the trace's references
    blocks = [b % 50 for b in range(20_000)]
    _KeepsHeap.heap_sizes = []
    run = simulate_policy(_singles(blocks), _KeepsHeap, 60)
    assert run.hit_blocks == 20_000 - 50
    assert max(_KeepsHeap.heap_sizes) <= 2 * 60 + 4096 + 1


FAILS_AT_FINISH = """\
class FailsAtFinish(Policy):
    def on_hit(self, block, ref):
        if not ref.lookup:
            raise ValueError("finish row")

    def on_insert(self, block, ref):
        if ref.request == 3:
            raise ValueError("row 3")
"""

FAILS_IN_RESET = """\
class FailsInReset(Policy):
    def reset(self, capacity_blocks, blocks):
        raise ValueError("no state")
"""


def test_errors_in_a_kvdiag_log_count_requests_not_rows(tmp_path):
    # rows of the demo log: request 0, the blocks it added at its finish, requests 1, 2, ...
    trace = load_trace(DEMO_LOG)
    assert trace.counted[:4].tolist() == [1, 0, 1, 1]
    (policy,) = load_policy_file(_policy_file(tmp_path, FAILS_AT_FINISH))
    with pytest.raises(PolicyError, match=r"my_policy.py:7: .*ValueError: finish row in "
                       r"on_hit at the blocks a request added at its finish, after request 0 "
                       r"arrived, block \d+ at position 0"):
        simulate_policy(trace, policy, None)
    (policy,) = load_policy_file(_policy_file(tmp_path, FAILS_IN_RESET))
    with pytest.raises(PolicyError, match=r"my_policy.py:6: .*ValueError: no state in reset "
                       r"before the replay$"):
        simulate_policy(trace, policy, 10)


def test_a_row_of_a_kvdiag_log_is_named_by_its_request_number(tmp_path):
    trace = load_trace(DEMO_LOG)
    body = FAILS_AT_FINISH.replace("if not ref.lookup", "if False")
    (policy,) = load_policy_file(_policy_file(tmp_path, body))
    with pytest.raises(PolicyError, match=r"ValueError: row 3 in on_insert at request 2 "
                       r"\(0-based, trace order\), block \d+ at position 0"):
        simulate_policy(trace, policy, None)


def test_a_policy_that_cannot_be_created_is_named(tmp_path):
    body = "class NoInit(Policy):\n    def __init__(self):\n        raise KeyError('x')\n"
    (policy,) = load_policy_file(_policy_file(tmp_path, body))
    with pytest.raises(PolicyError, match=r"my_policy.py:6: policy 'NoInit' raised KeyError: "
                       r"'x' when created"):
        simulate_policy(trace_from_blocks([[1]]), policy, 1)


# ---------------------------------------------------------------- numba replays of the learned plug-ins


def test_python_draws_are_the_generators_own():
    import random

    from kvdiag.simulation._policykernels import python_draws

    rng = random.Random(LeCaRPolicy.seed)
    assert python_draws(LeCaRPolicy.seed, 1000).tolist() == [rng.random() for _ in range(1000)]


@pytest.mark.parametrize("plugin", [LeCaRPolicy, PrefixLRUPolicy])
def test_learned_numba_replays_equal_the_python_hooks_on_mooncake(plugin):
    trace = load_trace(MOONCAKE)
    for capacity in (0, 1, 700, 5000, None):
        _same_run(simulate_policy(trace, plugin, capacity, fast=False),
                  simulate_policy(trace, plugin, capacity))


@pytest.mark.parametrize("plugin", [LeCaRPolicy, PrefixLRUPolicy])
def test_learned_numba_replays_equal_the_python_hooks_on_a_recorded_log(plugin):
    trace = load_trace(DEMO_LOG)
    for capacity in (1, 8, 40, None):
        _same_run(simulate_policy(trace, plugin, capacity, fast=False),
                  simulate_policy(trace, plugin, capacity))


@settings(max_examples=150, deadline=None)
@given(random_requests, st.one_of(st.none(), st.integers(0, 12)))
def test_learned_numba_replays_equal_the_python_hooks_on_random_traces(requests, capacity):
    trace = trace_from_blocks(requests)
    for plugin in (LeCaRPolicy, PrefixLRUPolicy):
        _same_run(simulate_policy(trace, plugin, capacity, fast=False),
                  simulate_policy(trace, plugin, capacity))
