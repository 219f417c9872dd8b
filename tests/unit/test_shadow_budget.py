"""The shadow's CPU budget alone (kvdiag.kernels.shadow_budget.Budget), driven by an injected
process-CPU clock: no threads, no tensors."""

from __future__ import annotations

import pytest

from kvdiag.kernels.shadow_budget import Budget


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
