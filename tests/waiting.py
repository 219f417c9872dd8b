"""Waiting on a condition in tests: poll it with a bounded deadline, never sleep a fixed time
for something to happen (a loaded machine outlasts any fixed sleep)."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(condition: Callable[[], object], timeout_s: float = 5.0, what: str = "condition",
             poll_s: float = 0.01) -> float:
    """Seconds until ``condition()`` is true; AssertionError naming ``what`` after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start
