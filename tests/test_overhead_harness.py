"""The overhead harness of benchmarks/ (benchmarks/overhead.py): rounds are interleaved in
alternating order, paired ratios see through noise shared by a round, and the verdicts follow
the interval. The work measured here is a real CPU loop, so the ratio is known by construction."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def overhead():
    spec = importlib.util.spec_from_file_location("overhead", ROOT / "benchmarks" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["overhead"] = module  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("overhead", None)


def test_rounds_follow_a_balanced_design(overhead):
    """Over 2n rounds each condition runs in each position, and after each other condition,
    equally often (a middle condition must not always be in the middle)."""
    seen = []
    overhead.run_interleaved(("a", "b", "c"), "a", 6,
                             lambda cond, r: seen.append((r, cond)) or overhead.RoundCost(1, 1.0), progress=False)
    orders = ["".join(c for r2, c in seen if r2 == r) for r in range(6)]
    assert orders == ["abc", "bca", "cab", "cba", "acb", "bac"]
    for cond in "abc":
        assert sorted(o.index(cond) for o in orders) == [0, 0, 1, 1, 2, 2]
    pairs = [o[i:i + 2] for o in orders for i in range(2)]
    assert all(pairs.count(x + y) == 2 for x in "abc" for y in "abc" if x != y)
    two = [overhead.order_of_round(("a", "b"), r) for r in range(4)]
    assert two == [["a", "b"], ["b", "a"], ["b", "a"], ["a", "b"]]


def test_paired_rounds_see_a_known_cost_through_shared_noise(overhead):
    """Condition "heavy" does 10% more work per token than "base"; each round's machine speed
    swings by up to 3x (shared by both). Unpaired means would blur it; the paired ratio finds
    1/1.1 and the verdict on a 0.98 goal is "missed", on 0.85 "met"."""
    speeds = [1.0, 3.0, 1.5, 2.0, 1.0, 2.5, 1.2, 3.0]

    def run_round(cond, r):
        work = 1.1 if cond == "heavy" else 1.0
        return overhead.RoundCost(tokens=1000, cpu_s=work * speeds[r])

    res = overhead.run_interleaved(("base", "heavy"), "base", len(speeds), run_round, progress=False)
    est = res.ratio("heavy")
    assert est.value == pytest.approx(1 / 1.1)
    assert est.lo == pytest.approx(1 / 1.1, rel=0.03) and est.hi == pytest.approx(1 / 1.1, rel=0.03)
    text = overhead.report(res, [overhead.Goal("heavy", 0.98), overhead.Goal("heavy", 0.85)])
    assert "heavy tokens per CPU-second >= 0.98 x base: MISSED" in text
    assert "heavy tokens per CPU-second >= 0.85 x base: MET" in text


def test_tree_cpu_counts_real_cpu_of_the_process(overhead):
    before = overhead.tree_cpu_s(os.getpid())
    t0 = time.process_time()
    x = 0
    while time.process_time() - t0 < 0.3:
        x += 1
    spent = overhead.tree_cpu_s(os.getpid()) - before
    assert 0.25 <= spent <= 2.0


def test_instruction_counter_reports_none_where_perf_cannot_count(overhead):
    note = overhead.perf_instructions_available()
    with overhead.InstructionCounter([os.getpid()], note is None) as counter:
        sum(range(10**6))
    if note is None:
        assert counter.count and counter.count > 10**6
    else:
        assert counter.count is None and note
