"""The logs the report and doctor tests run on.

Until the recorded demo logs land in tests/data/demo_small/, these are CONSTRUCTED logs
(tests/constructed.py)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import constructed as C


@functools.lru_cache(maxsize=None)
def _dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvdiag-test-logs-"))


@functools.lru_cache(maxsize=None)
def clean_log() -> str:
    return str(C.write(_dir() / "clean.jsonl", C.events(n_requests=120)))


@functools.lru_cache(maxsize=None)
def leak_log() -> str:
    return str(C.write(_dir() / "leak.jsonl", C.events(n_requests=120, leak_ids=(5, 17))))


def second_log(tmp: Path) -> str:
    return str(C.write(tmp / "node-b.jsonl", C.events(n_requests=60, seed=3), node="node-b"))


def leaked_request_ids() -> list[str]:
    """Requests of leak_log() whose release path was skipped."""
    return ["req-5", "req-17"]
