"""The shadow's CPU budget alone (kvdiag.kernels.shadow_budget.Budget), driven by an injected
process-CPU clock: no threads, no tensors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.kernels.shadow_budget import GUARD_RUNS, Budget


def test_the_guard_skips_a_step_that_would_overrun_the_budget():
    budget = Budget(sample_rate=1.0, budget_frac=0.1)
    assert budget.offer(0)  # first step: nothing spent, no cost known yet
    budget.spent_ns, budget.run_ns = 50, 50.0
    assert not budget.offer(50 + 900)  # 50 spent + 50 for a run > 0.1 x 900 of engine CPU
    assert budget.offer(50 + 1000)  # 50 + 50 <= 0.1 x 1000
    assert (budget.offered, budget.skipped_budget) == (3, 1)


def test_the_rate_is_the_budget_over_the_cost_of_a_run_capped_by_the_ceiling():
    """1,000 ns of engine CPU per step, runs of 20,000 ns, a 2% budget: one run per 1,000
    steps (rate 0.001), whatever the ceiling above it."""
    budget = Budget(sample_rate=0.05, budget_frac=0.02, seed=1)
    now = 0
    for _ in range(3):  # three runs, so that the warm cost is known (the first is not used)
        now += 1_000
        budget.offer(now)
        budget.account(20_000, run_done=True)
        now += 20_000
    assert budget.run_ns == 20_000
    now += 1_000
    budget.offer(now)
    assert budget.engine_step_ns == pytest.approx(1_000)
    assert budget.rate == pytest.approx(0.02 * 1_000 / 20_000)
    assert Budget(sample_rate=0.0005, budget_frac=0.02).target_rate() == 0.0005


def test_a_run_in_two_parts_and_the_first_runs_one_time_cost():
    budget = Budget()
    budget.account(1_000_000, run_done=True)  # the first run: imports, compiled kernels
    assert (budget.spent_ns, budget.run_ns) == (1_000_000, None)
    budget.account(4_000, run_done=False)  # the copy, in the engine's thread
    budget.account(6_000, run_done=True)  # the measurement, in the worker
    assert (budget.spent_ns, budget.run_ns) == (1_010_000, 10_000)


def test_without_a_budget_the_ceiling_alone_decides():
    budget = Budget(sample_rate=0.25, budget_frac=None, seed=7)
    budget.spent_ns, budget.run_ns = 10**12, 10**9  # far over any budget
    drawn = sum(budget.offer(t * 1_000) for t in range(20_000))
    assert budget.rate == 0.25 and budget.skipped_budget == 0
    assert 4_600 < drawn < 5_400  # Binomial(20000, 0.25): 5000 +- 61


def test_engine_cpu_excludes_the_shadows_and_starts_at_the_first_offer():
    budget = Budget()
    assert budget.engine_ns(10**9) == 0  # nothing offered yet
    budget.offer(5_000)
    budget.account(2_000, run_done=True)
    assert budget.engine_ns(15_000) == 15_000 - 5_000 - 2_000


def _overruns(budget: Budget, now_ns: int) -> bool:
    return budget.spent_ns > budget.budget_frac * budget.engine_ns(now_ns)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.integers(100, 20_000), min_size=2, max_size=40),
       steps=st.lists(st.integers(1_000, 5_000), min_size=1, max_size=20), seed=st.integers(0, 1000))
def test_only_a_run_dearer_than_every_recent_one_overruns_the_budget(costs, steps, seed):
    """Runs measured inline, their costs cycling through ``costs``; after a run, the shadow CPU
    is over ``budget_frac`` of the engine's only if that run cost more than each of the
    GUARD_RUNS costed runs before it (the first run's one-time cost aside): a run dearer than
    the average alone (what the guard expected before) no longer overruns it."""
    budget = Budget(sample_rate=1.0, budget_frac=0.1, seed=seed)
    now = runs = 0
    costed: list[int] = []
    for k in range(3_000):
        now += steps[k % len(steps)]
        if not budget.offer(now):
            continue
        cost = costs[runs % len(costs)]
        budget.account(cost, run_done=True)
        now += cost
        if runs and _overruns(budget, now):
            assert cost > max(costed[-GUARD_RUNS:], default=0), (k, cost, costed[-GUARD_RUNS:])
        costed += [cost] if runs else []
        runs += 1
    assert runs > 5


def test_runs_in_flight_count_against_the_budget():
    """Background runs of 5,000 ns that the worker finishes 200 steps after their draw, 1,000
    ns of engine CPU per step, a 10% budget: runs are drawn while others are in flight, yet
    once the first run is repaid the shadow CPU never exceeds 10% of the engine's."""
    budget = Budget(sample_rate=1.0, budget_frac=0.1, seed=3)
    now, done_at, overlapped, checked = 0, [], 0, 0
    for k in range(20_000):
        now += 1_000
        while done_at and done_at[0] == k:
            done_at.pop(0)
            budget.account(5_000, run_done=True)
            now += 5_000
            if budget.run_ns is not None:
                checked += 1
                assert not _overruns(budget, now), k
        if budget.offer(now, in_flight=len(done_at)):
            overlapped += bool(done_at)
            done_at.append(k + 200)
    assert checked > 300 and overlapped > 100  # the case of the test did occur, often



def test_after_a_warm_up_the_first_run_is_costed_and_guards_the_second():
    """Without a warm-up the first run's cost (one-time costs in it) is spent but sets no
    estimate, so the second run is drawn blind; after one, the first run is a typical run: it
    sets the estimates, and the guard refuses a second run the budget cannot pay yet."""
    def second_offer(budget: Budget) -> bool:
        assert budget.offer(0)
        budget.account(80, run_done=True)  # the first run: 80 ns at CPU 0
        return budget.offer(80 + 1_000)  # engine CPU 1,000: a 10% budget is 100, 80 spent

    cold, warm = Budget(sample_rate=1.0, budget_frac=0.1), Budget(sample_rate=1.0, budget_frac=0.1)
    warm.one_time_costs_paid()
    assert second_offer(cold) and cold.run_ns is None  # 80 + 0 <= 100: drawn blind (a run of 80 overruns)
    assert not second_offer(warm) and warm.run_ns == 80  # 80 + 80 > 100
    assert warm.skipped_budget == 1
