"""The alerts of ``kvdiag top``: the doctor's rule findings (the block ledger's leak rules,
judged on every event, in their place), then collector health (events dropped, collector
errors, collectors not available here), failures and warnings first."""

from __future__ import annotations

from kvdiag.pool.blockledger import BlockLedger
from kvdiag.diagnosis import leaks
from kvdiag.diagnosis.findings import Finding
from kvdiag.live.snapshot import Snapshot


def alerts(snap: Snapshot, rule_findings: tuple[Finding, ...], ledger: BlockLedger) -> tuple[Finding, ...]:
    """The rules' findings (:func:`kvdiag.diagnosis.doctor.run_rules`, run by the caller
    over the events seen so far, in ``rule_findings``; the release-path and double-release
    rules from the block ledger, over every event), then collector health: events
    dropped, collector errors and collectors not available here."""
    out: list[Finding] = list(rule_findings)
    if ledger.block_events:  # the leak rules the ledger decides, judged on all events
        ledger_rules = {f.rule: f for f in leaks.ledger_findings(ledger, now_ns=snap.now_ns)}
        merged = []
        for f in out:  # in the doctor's order: the ledger's rules where release_paths stands
            merged.append(ledger_rules.pop(f.rule, f))
            if f.rule == "leak.release_paths":
                merged += [ledger_rules.pop(r) for r in list(ledger_rules)]
        out = merged + list(ledger_rules.values())
    if snap.pool.inconsistency:
        out.append(Finding("collector.pool_samples", "warn", "KV pool samples inconsistent",
                           snap.pool.inconsistency, {}))
    if snap.health.dropped_events or snap.health.gaps:
        out.append(Finding("collector.gaps", "warn", "collector gaps",
                           f"{snap.health.dropped_events} events dropped in {snap.health.gaps} gaps",
                           {"dropped_events": snap.health.dropped_events}))
    for collector, count, message in snap.health.errors:
        out.append(Finding(f"collector.errors.{collector}", "warn", f"{collector} errors",
                           f"{count} errors; last: {message}", {"count": count}))
    for collector, hint in snap.health.unavailable:
        out.append(Finding(f"collector.unavailable.{collector}", "n/a", f"{collector} unavailable",
                           hint or "not available on this host", {}))
    # failures and warnings first; among the rest, why data is missing before rules that
    # had no data to judge
    order = {"fail": 0, "warn": 1, "n/a": 2, "pass": 3}
    return tuple(sorted(out, key=lambda f: (order[f.status], not f.rule.startswith("collector."))))
