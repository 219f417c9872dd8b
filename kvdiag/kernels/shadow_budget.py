"""The shadow's CPU budget: which offered engine steps get measured. Pure: no threads, no
tensors, no clock of its own; the caller passes CPU times in, so tests drive it exactly.

Rules (``kvdiag.shadow.runner`` runs the measurements they allow):

- every offered step updates the engine's CPU per step, an EWMA of (process CPU since the
  last offer - shadow CPU spent in between);
- the rate in force is ``min(sample_rate, budget_frac x engine CPU per step / shadow CPU per
  run)`` once both are known (``sample_rate`` before, and always without a budget);
- a step is drawn with that rate, then skipped (``skipped_budget``) when the shadow CPU spent,
  plus the runs still in flight and one more, each at the guard's cost, would exceed
  ``budget_frac`` x the engine's CPU since the first offer, or when a run is in flight before
  any run's cost is known. The guard's cost is the dearest of the last :data:`GUARD_RUNS`
  runs (or the average, if larger): the budget is overrun only by a run dearer than all of
  those, not by any run dearer than the average;
- a run's cost (the copy and the measurement, in one or two parts) enters the per-run EWMA
  and the guard's window when it is done; the first run's does not (one-time costs: imports,
  compiled kernels), though it counts as spent, unless a warm-up paid those costs before
  (:meth:`Budget.one_time_costs_paid`).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Optional

EWMA_WEIGHT = 0.1
"""Weight of the newest value in the per-step and per-run cost averages."""
GUARD_RUNS = 8
"""Runs whose dearest cost the guard expects of the next one."""


def ewma(avg: Optional[float], x: float) -> float:
    """The moving average after ``x`` (``x`` itself first)."""
    return x if avg is None else avg + EWMA_WEIGHT * (x - avg)


class Budget:
    """The sampling decision and the CPU accounting (module docstring). CPU times in ns of
    process CPU; not thread-safe: the runner calls it under its lock."""

    def __init__(self, sample_rate: float = 0.05, budget_frac: Optional[float] = 0.02,
                 seed: int = 0) -> None:
        self.sample_rate = sample_rate  # the ceiling
        self.budget_frac = budget_frac  # None: no budget, the ceiling alone
        self._rng = random.Random(seed)
        self._t0_ns: Optional[int] = None  # process CPU at the first offered step
        self._last_offer_ns = 0
        self._spent_at_last_offer_ns = 0
        self.engine_step_ns: Optional[float] = None  # moving average: engine CPU per offered step
        self.run_ns: Optional[float] = None  # moving average: shadow CPU per sampled step
        self.recent_runs_ns: deque[int] = deque(maxlen=GUARD_RUNS)  # the latest costed runs
        self.rate = sample_rate  # the rate in force
        self.spent_ns = 0  # shadow CPU so far
        self._pending_ns = 0  # shadow CPU of the run in progress (the copy, before the worker's part)
        self._runs_done = 0
        self._first_run_is_typical = False  # a warm-up paid the one-time costs
        self.offered = 0  # steps offered for sampling
        self.skipped_budget = 0  # drawn, but skipped by the budget guard

    def engine_ns(self, now_ns: int) -> int:
        """Process CPU outside shadow work from the first offered step to ``now_ns``."""
        if self._t0_ns is None:
            return 0
        return max(now_ns - self._t0_ns - self.spent_ns, 0)

    def target_rate(self) -> float:
        """The sampling rate the budget allows now, at most ``sample_rate``."""
        if self.budget_frac is None or not self.run_ns or self.engine_step_ns is None:
            return self.sample_rate
        return min(self.sample_rate, self.budget_frac * self.engine_step_ns / self.run_ns)

    def guard_ns(self) -> float:
        """The cost the guard expects of a run: the dearest of the recent ones, or the
        average if larger (0 before any run is costed)."""
        return max(self.run_ns or 0, max(self.recent_runs_ns, default=0))

    def offer(self, now_ns: int, in_flight: int = 0) -> bool:
        """A step offered at process CPU ``now_ns``, ``in_flight`` runs drawn but not yet
        accounted as done: update the estimates and the rate, draw, apply the guard; True
        when the step is to be measured."""
        spent = self.spent_ns
        if self._t0_ns is None:
            self._t0_ns = self._last_offer_ns = now_ns
        else:
            step = now_ns - self._last_offer_ns - (spent - self._spent_at_last_offer_ns)
            self.engine_step_ns = ewma(self.engine_step_ns, max(step, 0))
        self._last_offer_ns, self._spent_at_last_offer_ns = now_ns, spent
        self.offered += 1
        self.rate = self.target_rate()
        if self._rng.random() >= self.rate:
            return False
        guard = self.guard_ns()
        if self.budget_frac is not None and (spent + (in_flight + 1) * guard > self.budget_frac * self.engine_ns(now_ns)
                                             or (in_flight and not guard)):
            self.skipped_budget += 1
            return False
        return True

    def one_time_costs_paid(self) -> None:
        """The one-time costs were paid outside any run (a warm-up): the first run's cost is
        a typical run's, and enters the estimates."""
        self._first_run_is_typical = True

    def account(self, ns: int, run_done: bool) -> None:
        """Add ``ns`` of shadow CPU; a finished run (all its parts) updates the per-run
        average and the guard's window, from the second run on (from the first after
        :meth:`one_time_costs_paid`)."""
        ns = max(ns, 0)
        self.spent_ns += ns
        self._pending_ns += ns
        if run_done:
            self._runs_done += 1
            if self._runs_done > 1 or self._first_run_is_typical:
                self.run_ns = ewma(self.run_ns, self._pending_ns)
                self.recent_runs_ns.append(self._pending_ns)
            self._pending_ns = 0
