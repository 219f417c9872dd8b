"""The overhead harness: what kvdiag costs the process it observes, measured so that the answer
survives a shared, noisy machine. Used by bench_agent_overhead.py (agent and attach on the
embedded engine), bench_demo_shadow.py (shadow in the engine) and bench_vllm_overhead.py.

- **Interleaved rounds.** The same seeded work runs under every condition in each round, in
  orders of a Williams design (:func:`order_of_round`): load that drifts over minutes falls on
  every condition alike, no condition owns a position in the round, and each round gives one
  paired sample. Run a multiple of 2 x conditions rounds for a fully balanced design.
- **Cost per token, not wall time.** Per round: CPU seconds (user + system) of the observed
  process tree per generated token, read from /proc by psutil. Wall time on a 2-core machine
  shared with other work mostly measures the other work. Where the CPU's counters are readable
  (``perf stat -e instructions:u``), instructions retired per token too: they barely move with
  load. A virtual machine often hides them; the harness then says so once and goes on.
- **Interleaved engine steps,** where the condition is a switch inside the observed process
  (shadow on/off): :class:`StepArms` assigns blocks of consecutive engine steps to the
  conditions, each pair of adjacent blocks in a seeded random order, and counts the engine
  thread's CPU (``time.thread_time``) and the tokens of each block. Pairs are a fraction of a
  second apart instead of rounds tens of seconds apart, so the machine's drift cancels far
  better. A pair counts only if its two blocks did the same work (the same batch shape, step by
  step): a prefill step costs several decode steps' CPU for one token, and a pair of a prefill
  block and a decode block would measure that, not the switch (measured: with such pairs the
  interval was 0.92..1.09, wider than whole rounds'). Only the steps are counted, not the
  process's other threads: the switch acts only inside the step, so the difference is whole
  while the denominator is smaller, and the ratio so measured overstates the process's
  overhead (conservative).
- **Intervals and verdicts.** tokens per CPU-second of each condition over the baseline's, as a
  paired ratio with a 95% bootstrap interval over rounds, and a verdict on the goal: met,
  missed or undecided (:mod:`kvdiag.diagnosis.intervals`, the definitions the report uses).
- **The machine's load** (1-minute load average) before, during (sampled every round) and after.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import psutil

from kvdiag.diagnosis.intervals import Estimate, goal_verdict, paired_rate_ratio, paired_ratio


def tree_pids(pid: int) -> list[int]:
    """A process and all its descendants, now."""
    root = psutil.Process(pid)
    return [root.pid, *(c.pid for c in root.children(recursive=True))]


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and all its descendants, now. A child that
    exited since the last call takes its CPU with it; servers keep theirs for their lifetime."""
    total = 0.0
    for p in tree_pids(pid):
        try:
            t = psutil.Process(p).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def perf_instructions_available() -> Optional[str]:
    """None if ``perf stat`` can count instructions retired here, else why not (one line)."""
    if shutil.which("perf") is None:
        return "perf not installed"
    try:
        out = subprocess.run(["perf", "stat", "-x,", "-e", "instructions:u", "true"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"perf failed: {exc}"
    line = next((ln for ln in out.stderr.splitlines() if "instructions" in ln), "")
    if not line or line.split(",")[0] in ("<not supported>", "<not counted>", ""):
        return "the CPU's instruction counter is not exposed here (perf: <not supported>)"
    return None


class InstructionCounter:
    """``perf stat -e instructions:u`` on a set of pids for the length of a ``with`` block;
    ``.count`` is None when perf cannot count here."""

    def __init__(self, pids: Sequence[int], enabled: bool) -> None:
        self.pids, self.enabled = list(pids), enabled
        self.count: Optional[int] = None
        self._proc: Optional[subprocess.Popen] = None
        self._out = Path(tempfile.mkstemp(prefix="kvdiag-perf-", suffix=".csv")[1])

    def __enter__(self) -> "InstructionCounter":
        if self.enabled:
            self._proc = subprocess.Popen(
                ["perf", "stat", "-x,", "-e", "instructions:u", "-o", str(self._out),
                 "-p", ",".join(map(str, self.pids))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._proc is not None:
                self._proc.send_signal(signal.SIGINT)
                self._proc.wait(timeout=30)
                for line in self._out.read_text().splitlines():
                    head = line.split(",")[0]
                    if "instructions" in line and head.isdigit():
                        self.count = int(head)
        finally:
            self._out.unlink(missing_ok=True)


class Attached:
    """``kvdiag attach PID`` running for the length of a ``with`` block, its log in ``out``
    (its own process: not counted in the target's CPU)."""

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out = pid, out
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Attached":
        from kvdiag.demo.child_command import reset_interrupt_signal

        self.proc = subprocess.Popen([sys.executable, "-m", "kvdiag", "attach", str(self.pid), "--duration", "3600",
                                      "--out", str(self.out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     # from a background shell SIGINT would be ignored, and inherited:
                                     # attach would not stop
                                     preexec_fn=reset_interrupt_signal)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)


@dataclass
class RoundCost:
    """What one condition cost in one round."""

    tokens: int
    cpu_s: float
    instructions: Optional[int] = None

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s if self.cpu_s > 0 else float("nan")


@dataclass
class Goal:
    """``condition``'s tokens per CPU-second must be >= ``min_ratio`` of the baseline's."""

    condition: str
    min_ratio: float


@dataclass
class Results:
    conditions: Sequence[str]
    baseline: str
    costs: dict = field(default_factory=dict)  # condition -> [RoundCost] (one per round)
    load1: list = field(default_factory=list)  # 1-minute load average after each round
    load_before: tuple = ()
    load_after: tuple = ()
    perf_note: Optional[str] = None

    def ratio(self, condition: str, metric: str = "tokens_per_cpu_s") -> Estimate:
        """Paired ratio of ``metric`` (per round) to the baseline's, with its 95% interval."""
        a = np.array([getattr(c, metric) for c in self.costs[condition]], dtype=float)
        b = np.array([getattr(c, metric) for c in self.costs[self.baseline]], dtype=float)
        return paired_ratio(a, b)

    def instruction_ratio(self, condition: str) -> Optional[Estimate]:
        """Paired ratio of instructions per token, baseline over condition (so that, like
        tokens per CPU-second, < 1 means the condition costs more); None without perf."""
        rows = list(zip(self.costs[condition], self.costs[self.baseline]))
        if not rows or any(c.instructions is None or b.instructions is None for c, b in rows):
            return None
        base = np.array([b.instructions / b.tokens for _, b in rows], dtype=float)
        cond = np.array([c.instructions / c.tokens for c, _ in rows], dtype=float)
        return paired_ratio(base, cond)


def round_prompts(seed: int, requests: int) -> list[tuple[str, str]]:
    """A round's chats: (system prompt, question), seeded; one system prompt per round, shared
    by its chats (prefix caching at work), varied questions from kvdiag's traffic corpus."""
    from kvdiag.demo.traffic import load_corpus

    corpus = load_corpus()
    rng = random.Random(seed)
    system = f"[round {seed}] " + rng.choice(corpus["system_prompts"])["text"]
    fill = {"order": "NW1001", "days": "5", "item": "tent"}
    return [(system, rng.choice(corpus["questions"]).format_map(_Defaults(fill))) for _ in range(requests)]


class _Defaults(dict):
    """Template fields the corpus uses that :func:`round_prompts` does not fill stay as they are."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def order_of_round(conditions: Sequence[str], round_index: int) -> list[str]:
    """A Williams design: rotations of the conditions (A B C, B C A, C A B), then the same
    reversed (C B A, A C B, B A C). Over every 2n rounds each condition runs in each position
    equally often and follows each other condition equally often, so neither a position (the
    first of a round meets a server idle since the last round) nor the condition before it
    (a warm server) favours one. With two conditions: A B, B A, B A, A B."""
    n = len(conditions)
    rotated = [conditions[(i + round_index) % n] for i in range(n)]
    return rotated if (round_index // n) % 2 == 0 else list(reversed(rotated))


def run_interleaved(conditions: Sequence[str], baseline: str, rounds: int,
                    run_round: Callable[[str, int], RoundCost], progress: bool = True) -> Results:
    """Run ``run_round(condition, round_index)`` for every condition in every round, interleaved
    (:func:`order_of_round`), and collect the costs."""
    res = Results(conditions, baseline, {c: [] for c in conditions}, load_before=os.getloadavg())
    for r in range(rounds):
        for cond in order_of_round(conditions, r):
            res.costs[cond].append(run_round(cond, r))
        res.load1.append(os.getloadavg()[0])
        if progress:
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{c} {res.costs[c][-1].tokens_per_cpu_s:.1f} tok/CPU-s" for c in conditions)
                + f"; load {res.load1[-1]:.2f}", flush=True)
    res.load_after = os.getloadavg()
    return res


class StepArms:
    """Engine steps assigned to two conditions in blocks (module docstring): ``arm()`` is the
    condition of the next step, ``record(tokens, cpu_ns, work)`` books that step, ``work`` a
    signature of what it computed (e.g. the batch's requests and query tokens). Block pair ``j``
    runs ``(a, b)`` or ``(b, a)``, drawn from ``seed``."""

    def __init__(self, conditions: tuple[str, str], block_steps: int, seed: int = 0) -> None:
        if block_steps < 1:
            raise ValueError("block_steps must be >= 1")
        self.conditions, self.block_steps = conditions, block_steps
        self._rng = random.Random(seed)
        self._orders: list[tuple[str, str]] = []
        self.steps = 0
        # per condition, per block pair: tokens, CPU nanoseconds and the work of each step
        self.tokens: dict[str, list[int]] = {c: [] for c in conditions}
        self.cpu_ns: dict[str, list[int]] = {c: [] for c in conditions}
        self.work: dict[str, list[list]] = {c: [] for c in conditions}

    def arm(self) -> str:
        block = self.steps // self.block_steps
        pair, second = divmod(block, 2)
        while len(self._orders) <= pair:
            a, b = self.conditions
            self._orders.append((a, b) if self._rng.random() < 0.5 else (b, a))
            for c in self.conditions:
                self.tokens[c].append(0)
                self.cpu_ns[c].append(0)
                self.work[c].append([])
        return self._orders[pair][second]

    def record(self, tokens: int, cpu_ns: int, work=None) -> None:
        arm, pair = self.arm(), self.steps // (2 * self.block_steps)
        self.tokens[arm][pair] += tokens
        self.cpu_ns[arm][pair] += cpu_ns
        self.work[arm][pair].append(work)
        self.steps += 1

    def matched_pairs(self) -> list[int]:
        """Complete block pairs whose two blocks did the same work, step by step."""
        a, b = self.conditions
        whole = self.steps // (2 * self.block_steps)
        return [j for j in range(whole) if self.work[a][j] == self.work[b][j]]

    def ratio(self, condition: str, baseline: str) -> Estimate:
        """Tokens per engine CPU-second of ``condition`` over ``baseline``, over the matched block
        pairs, with its 95% interval (pairs resampled)."""
        pairs = self.matched_pairs()

        def pick(books):
            return [books[j] for j in pairs]
        return paired_rate_ratio(pick(self.tokens[condition]), pick(self.cpu_ns[condition]),
                                 pick(self.tokens[baseline]), pick(self.cpu_ns[baseline]))


def report(res: Results, goals: Sequence[Goal], extra: Optional[dict] = None) -> str:
    """The table: per condition, tokens per CPU-second, its paired ratio to the baseline with
    the 95% interval, instructions per token (if counted), and each goal's verdict."""
    lines = [f"machine: {os.cpu_count()} CPUs; load average (1 min) before {res.load_before[0]:.2f}, "
             f"during {min(res.load1):.2f}..{max(res.load1):.2f} (median {float(np.median(res.load1)):.2f}), "
             f"after {res.load_after[0]:.2f}; {len(res.load1)} interleaved rounds"]
    if res.perf_note:
        lines.append(f"instructions retired: not counted ({res.perf_note})")
    lines.append(f"{'condition':<16} {'tokens/CPU-s':>12} {'ratio':>7} {'95% interval':>15} "
                 f"{'instr. ratio':>20}" + "".join(f" {k:>14}" for k in (extra or {})))
    for cond in res.conditions:
        tps = np.mean([c.tokens_per_cpu_s for c in res.costs[cond]])
        est = res.ratio(cond)
        ins = res.instruction_ratio(cond)
        ins_s = f"{ins.value:.3f} ({ins.lo:.3f}..{ins.hi:.3f})" if ins else "-"
        cells = "".join(f" {v.get(cond, ''):>14}" for v in (extra or {}).values())
        lines.append(f"{cond:<16} {tps:12.2f} {est.value:7.3f} {f'{est.lo:.3f}..{est.hi:.3f}':>15} {ins_s:>20}{cells}")
    for g in goals:
        est = res.ratio(g.condition)
        lines.append(f"goal: {g.condition} tokens per CPU-second >= {g.min_ratio} x {res.baseline}: "
                     f"{goal_verdict(est, g.min_ratio).upper()} (ratio {est.value:.3f}, 95% interval "
                     f"{est.lo:.3f}..{est.hi:.3f}, {est.n} rounds)")
    return "\n".join(lines)
