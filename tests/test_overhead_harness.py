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


def test_rounds_alternate_their_order(overhead):
    seen = []
    overhead.run_interleaved(("a", "b", "c"), "a", 4,
                             lambda cond, r: seen.append((r, cond)) or overhead.RoundCost(1, 1.0), progress=False)
    assert seen == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                    (2, "a"), (2, "b"), (2, "c"), (3, "c"), (3, "b"), (3, "a")]


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
