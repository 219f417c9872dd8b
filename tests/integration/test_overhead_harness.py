"""The overhead harness of benchmarks/ (benchmarks/overhead.py): rounds are interleaved in
alternating order, paired ratios see through noise shared by a round, and the verdicts follow
the interval. The work measured here is a real CPU loop, so the ratio is known by construction."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def _run_steps(overhead, seed: int, steps: int = 400, cost_on: float = 1.05):
    """Blocks of 4 steps; "on" costs ``cost_on`` times the CPU per token; the machine slows 2x
    over the run (drift shared by adjacent blocks); a step's tokens vary (1-3)."""
    arms = overhead.StepArms(("off", "on"), block_steps=4, seed=seed)
    booked = []
    for step in range(steps):
        arm = arms.arm()
        tokens, speed = 1 + step % 3, 1.0 + step / steps
        cpu_ns = int(1e6 * tokens * speed * (cost_on if arm == "on" else 1.0))
        arms.record(tokens, cpu_ns)
        booked.append((arm, tokens, cpu_ns))
    return arms, booked


def test_step_arms_run_balanced_seeded_blocks(overhead):
    arms, booked = _run_steps(overhead, seed=3, steps=4 * 2 * 50 + 5)  # and 5 steps of a pair never completed
    seen = [arm for arm, _, _ in booked]
    assert all(len(set(seen[i:i + 4])) == 1 for i in range(0, 400, 4))  # a block is one arm
    firsts = [seen[i] for i in range(0, 400, 8)]
    assert all({seen[i], seen[i + 4]} == {"off", "on"} for i in range(0, 400, 8))
    assert 10 < firsts.count("on") < 40  # both orders occur
    again, booked_again = _run_steps(overhead, seed=3, steps=len(seen))
    assert booked_again == booked  # the seed fixes the order
    # the estimate is the ratio of the totals over the 50 complete pairs (brute force)
    total = {arm: [sum(t for a, t, _ in booked[:400] if a == arm), sum(c for a, _, c in booked[:400] if a == arm)]
             for arm in ("off", "on")}
    est = arms.ratio("on", "off")
    assert est.n == 50
    assert est.value == pytest.approx((total["on"][0] / total["on"][1]) / (total["off"][0] / total["off"][1]))


def test_step_arms_compare_only_pairs_that_did_the_same_work(overhead):
    """Every 13th step is a prefill: 20x a decode step's CPU for one token. A pair whose blocks
    hold different numbers of prefills measures them, not the condition; such pairs are left
    out, and the remaining ones find the 5% cost (brute force over the matched pairs)."""
    arms = overhead.StepArms(("off", "on"), block_steps=2, seed=5)
    booked = []
    for step in range(2000):
        arm = arms.arm()
        prefill = step % 13 == 0
        tokens, work = (1, ("prefill", 256)) if prefill else (4, ("decode", 4))
        cpu_ns = int(1e6 * (20 if prefill else 1) * (1.05 if arm == "on" else 1.0))
        arms.record(tokens, cpu_ns, work)
        booked.append((step // 4, arm, tokens, cpu_ns, work))
    pairs = arms.matched_pairs()
    assert 0 < len(pairs) < 500
    for j in range(500):
        works = {arm: [w for p, a, _, _, w in booked if p == j and a == arm] for arm in ("off", "on")}
        assert (j in pairs) == (works["off"] == works["on"])
    total = {arm: [sum(t for p, a, t, _, _ in booked if a == arm and p in pairs),
                   sum(c for p, a, _, c, _ in booked if a == arm and p in pairs)] for arm in ("off", "on")}
    est = arms.ratio("on", "off")
    assert est.n == len(pairs)
    assert est.value == pytest.approx((total["on"][0] / total["on"][1]) / (total["off"][0] / total["off"][1]))
    assert est.value == pytest.approx(1 / 1.05, rel=1e-3)  # no noise here: only the prefills could blur it


def test_step_arms_interval_covers_a_known_cost_under_drift(overhead):
    """"on" costs 5% more per token: the 95% interval of 100 seeded runs covers 1/1.05 in at
    least 88 of them (4 sigma below 95 for 100 draws), and is narrow (under 3%)."""
    covered, widths = 0, []
    for seed in range(100):
        est = _run_steps(overhead, seed)[0].ratio("on", "off")
        covered += est.lo <= 1 / 1.05 <= est.hi
        widths.append(est.hi - est.lo)
    assert covered >= 88, covered
    assert max(widths) < 0.03
