"""The P99 spike checklist as rules over a log: ``p99.regression`` (a P99 shift inside the log
or against a baseline: :mod:`kvdiag.diagnosis.latency_regression`) and one ``p99.<cause>`` rule
per candidate cause (:mod:`kvdiag.diagnosis.causes`); the article's four questions
(:data:`P99_CHECKLIST`) are answered by four of them. Verdicts come from
:mod:`kvdiag.diagnosis.rules`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvdiag.diagnosis import bandwidth, latency, latency_regression, rules
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.frames import Logs
from kvdiag.events.schema import RequestFinished
from kvdiag.pool.hit_rate import counted, frame_hit_rate


def p99(logs: Logs, baseline: Optional[Logs] = None,
        threshold: float = rules.P99_THRESHOLD) -> tuple[list[Finding], list[latency.Comparison]]:
    """``p99.regression``: fail when any latency (TTFT, TPOT, engine step) regressed past
    ``threshold`` at P99, or, with too few samples for P99, grossly at P90/P50 (module
    :mod:`kvdiag.diagnosis.latency_regression`, :func:`~kvdiag.diagnosis.latency_regression.detect_all`); the message
    says what each comparison compared and which latencies had too few samples (``n/a (N of M
    needed)``). One ``p99.<cause>`` per candidate cause: warn when it is supported for a
    flagged regression, pass otherwise."""
    comps, skipped = latency_regression.detect_all(logs, baseline, threshold)
    title = f"P99 latency stable (no rise beyond {threshold:+.0%}; TTFT, TPOT, engine steps)"
    gaps = "; ".join(s.describe() for s in skipped)
    if not comps:
        return [Finding("p99.regression", "n/a", title, gaps or "no latency samples",
                        {"skipped": [s.to_dict() for s in skipped]}),
                *(Finding(f"p99.{name}", "n/a", _CAUSE_TITLES[name],
                          f"no P99 comparison; over the log: {_over_log(logs, name)}")
                  for name, _ in P99_CHECKLIST)], comps
    flagged = [c for c in comps if c.flagged]
    desc = "; ".join([c.describe() for c in comps] + ([gaps] if gaps else []))
    out = [Finding("p99.regression", rules.p99_regression_status(len(flagged)), title, desc,
                   {"comparisons": [c.to_dict() for c in comps], "skipped": [s.to_dict() for s in skipped]})]
    supported: dict[str, list] = {}
    titles: dict[str, str] = {}
    measured_causes: dict[str, str] = {}  # what an unsupported cause measured, first flagged metric
    for c in flagged:
        for cause in c.causes:
            titles[cause.cause] = cause.title
            if cause.supported:
                supported.setdefault(cause.cause, []).append((c.metric, cause))
            else:
                measured_causes.setdefault(cause.cause, f"{c.metric}: {cause.message}")
    measured = bandwidth.summarize(logs)
    for name, ttl in _CAUSE_TITLES.items():
        hits = supported.get(name, [])
        if hits:
            out.append(Finding(f"p99.{name}", "warn", ttl,
                               "; ".join(f"{m}: {c.message}" for m, c in hits),
                               {m: c.evidence for m, c in hits}))
        elif name == "kv_bandwidth" and not measured.steps:
            out.append(Finding(f"p99.{name}", "n/a", ttl, "no engine steps with KV blocks to measure"))
        else:
            msg = (f"not behind the regression ({measured_causes[name]})" if name in measured_causes
                   else "not behind the regression" if flagged else "no P99 regression to explain")
            if name == "kv_bandwidth":  # the checklist asks how busy it is: say so either way
                out.append(Finding(f"p99.{name}", "pass", ttl, f"{msg}; over the log: {bandwidth.describe(measured)}",
                                   {"log": measured.to_dict()}))
            else:
                out.append(Finding(f"p99.{name}", "pass", ttl, msg))
    return out, comps


P99_CHECKLIST = (
    ("compression", "Was the compression/decompression path triggered?"),
    ("kv_bandwidth", "How busy is the memory bandwidth?"),
    ("prefix_hit_rate", "Does the cache hit rate fluctuate?"),
    ("long_sequences", "Did abnormally long sequences arrive?"),
)
"""The article's checklist for a P99 spike, in its order: the item and the ``p99.<item>`` rule
that answers it."""


def _over_log(logs: Logs, item: str) -> str:
    """What the log shows for one checklist item when no comparison can judge it."""
    if item == "kv_bandwidth":
        return bandwidth.describe(bandwidth.summarize(logs))
    if item == "compression":
        return f"{len(logs.frame('shadow_compression'))} compression runs"
    fin = logs.frame(RequestFinished)
    if fin.empty:
        return "no finished requests"
    if item == "prefix_hit_rate":
        rate, n = frame_hit_rate(fin), len(counted(fin))
        return ("token hit rate N/A (no request finished normally)" if rate is None else
                f"token hit rate {rate:.1%} over {n} requests that finished normally")
    p = fin["prompt_tokens"].to_numpy(dtype="float64")
    return f"prompts P50 {np.median(p):.0f}, P90 {np.quantile(p, 0.9):.0f}, longest {p.max():.0f} tokens"


def p99_checklist(findings: list[Finding]) -> list[tuple[str, Finding]]:
    """The article's four P99 questions, each with the finding that answers it (status n/a
    where the P99 rules did not run)."""
    by_rule = {f.rule: f for f in findings}
    return [(question, by_rule.get(f"p99.{item}") or Finding(f"p99.{item}", "n/a", question, "not evaluated"))
            for item, question in P99_CHECKLIST]


_CAUSE_TITLES = {
    "compression": "compression path not behind a P99 rise",
    "kv_bandwidth": "KV bandwidth utilisation steady",
    "prefix_hit_rate": "prefix hit rate steady",
    "long_sequences": "no burst of abnormally long sequences",
    "memory_pressure": "no rise in memory pressure, preemptions or evictions",
    "fragmentation": "no rise in fragmentation",
    "queueing": "no rise in queue wait",
}


P99_RULE_IDS = ("p99.regression", *(f"p99.{name}" for name in _CAUSE_TITLES))
"""The ids of the findings :func:`p99` returns, in its order."""
