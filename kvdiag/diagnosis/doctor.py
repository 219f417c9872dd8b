"""The doctor: every rule over a log, each a :class:`Finding`, in one registry
(:data:`REGISTRY`). Thresholds and verdicts come from :mod:`kvdiag.diagnosis.rules`;
``doctor``, ``report`` and ``top``'s alerts all call :func:`run_rules`.

Memory leak (:mod:`kvdiag.diagnosis.leak_rules`): ``leak.memory_growth`` (process memory grows
without matching KV growth), ``leak.release_paths`` (finished requests whose blocks were never
given back), ``leak.double_release``, ``leak.pool_growth`` (:mod:`kvdiag.diagnosis.leaks`),
``fragmentation.kv_pool`` / ``fragmentation.allocator``, ``leak.oom`` (OOMs, allocator retries).
P99 spike (:mod:`kvdiag.diagnosis.p99_rules`): ``p99.regression`` (a P99 shift inside the log or
against a baseline) and one ``p99.<cause>`` rule per candidate cause
(:mod:`kvdiag.diagnosis.causes`); the article's four questions
(:data:`kvdiag.diagnosis.p99_rules.P99_CHECKLIST`) are answered by four of them.
Forecast: ``forecast.memory_pressure`` (KV the active requests still need vs free blocks) and
pool: ``pool.preemptions`` (:mod:`kvdiag.diagnosis.pressure_rules`).
Latency as users see it: ``latency.queueing`` (queue wait dominating TTFT, arrivals
outpacing completions: :mod:`kvdiag.diagnosis.user_latency`).
Sharing: ``sharing.consistency`` (the engine's prefix hit rate vs the content's, measured by
the shadow cache at the engine's settings: :mod:`kvdiag.diagnosis.sharing_rules`). Observation
(:mod:`kvdiag.diagnosis.kv_stream_rules`): ``kv_events.gaps`` (batches of the engine's KV event
stream lost by the subscriber), ``kv_events.health`` (the stream's consistency:
:mod:`kvdiag.pool.kv_stream_health`).
Engine numbers: ``engine.number_traps`` (the engine's own usage gauge and prefix counters
against kvdiag's recount: :mod:`kvdiag.diagnosis.engine_numbers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from kvdiag.diagnosis import engine_numbers, latency, user_latency
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.frames import Logs
from kvdiag.diagnosis.kv_stream_rules import kv_event_gaps, kv_stream_health
from kvdiag.diagnosis.leak_rules import fragmentation, memory_growth, ooms, release_paths
from kvdiag.diagnosis.p99_rules import P99_RULE_IDS, p99
from kvdiag.diagnosis.pressure_rules import memory_pressure, preemptions
from kvdiag.diagnosis.sharing_rules import sharing_consistency


@dataclass
class RuleContext:
    """What every registered rule is evaluated on: the logs, the baseline (``--baseline``) and
    where the P99 rules leave the latency comparisons behind them (for reports)."""

    logs: Logs
    baseline: Optional[Logs] = None
    comparisons: list = field(default_factory=list)


@dataclass(frozen=True)
class RegisteredRule:
    """One entry of :data:`REGISTRY`: the rule ids an evaluator reports and the evaluator."""

    rule_ids: tuple[str, ...]
    evaluate: Callable[[RuleContext], list[Finding]]


def _p99_rules(ctx: RuleContext) -> list[Finding]:
    found, ctx.comparisons = p99(ctx.logs, ctx.baseline)
    return found


def _one(fn: Callable[[Logs], Finding]) -> Callable[[RuleContext], list[Finding]]:
    return lambda ctx: [fn(ctx.logs)]


def _many(fn: Callable[[Logs], list[Finding]]) -> Callable[[RuleContext], list[Finding]]:
    return lambda ctx: fn(ctx.logs)


REGISTRY: tuple[RegisteredRule, ...] = (
    RegisteredRule(("leak.memory_growth",), _one(memory_growth)),
    RegisteredRule(("leak.release_paths", "leak.double_release", "leak.pool_growth"), _many(release_paths)),
    RegisteredRule(("fragmentation.kv_pool", "fragmentation.allocator"), _many(fragmentation)),
    RegisteredRule(("leak.oom",), _one(ooms)),
    RegisteredRule(("latency.queueing",), _one(user_latency.queueing)),
    RegisteredRule(P99_RULE_IDS, _p99_rules),
    RegisteredRule(("forecast.memory_pressure",), _one(memory_pressure)),
    RegisteredRule(("sharing.consistency",), _one(sharing_consistency)),
    RegisteredRule(("pool.preemptions",), _one(preemptions)),
    RegisteredRule(("kv_events.gaps",), _one(kv_event_gaps)),
    RegisteredRule(("kv_events.health",), _many(kv_stream_health)),
    RegisteredRule((engine_numbers.RULE_ID,), _one(engine_numbers.number_traps)),
)
"""Every rule the doctor evaluates, in the order it reports them: each evaluator with the ids
of the findings it returns. Its ids are :data:`kvdiag.diagnosis.rules.RULE_IDS` (tested), and
every verdict an evaluator gives comes from a function of :mod:`kvdiag.diagnosis.rules`."""


def run_rules(logs: Logs, baseline: Optional[Logs] = None) -> tuple[list[Finding], list[latency.Comparison]]:
    """Every rule of :data:`REGISTRY` over ``logs`` (a finding per rule and node where a rule
    judges nodes apart); also the latency comparisons behind the P99 rules (for reports)."""
    ctx = RuleContext(logs, baseline)
    findings = [f for entry in REGISTRY for f in entry.evaluate(ctx)]
    return findings, ctx.comparisons
