"""A finding: the outcome of one diagnostic rule, with the evidence behind it.

Shared by the doctor, the leak and fragmentation analyses, reports and the TUI's alerts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["pass", "warn", "fail", "n/a"]

_SEVERITY = {"n/a": 0, "pass": 1, "warn": 2, "fail": 3}


@dataclass(frozen=True, slots=True)
class Finding:
    """``rule``: a stable id (e.g. ``leak.release_paths``); ``title``: what was checked;
    ``message``: the measured value beside the rule's threshold; ``evidence``: the numbers,
    request ids, block ids and time window behind it (JSON-serialisable)."""

    rule: str
    status: Status
    title: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "status": self.status, "title": self.title,
                "message": self.message, "evidence": self.evidence}


def worst(findings: list[Finding]) -> Status:
    """The most severe status among ``findings`` ("n/a" when there are none)."""
    return max((f.status for f in findings), key=_SEVERITY.__getitem__, default="n/a")
