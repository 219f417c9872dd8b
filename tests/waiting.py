"""Waiting on a condition in tests: poll it with a bounded deadline, never sleep a fixed time
for something to happen (a loaded machine outlasts any fixed sleep)."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(condition: Callable[[], object], timeout_s: float = 5.0, what: str = "condition",
             poll_s: float = 0.01, ignore: tuple[type[BaseException], ...] = ()) -> float:
    """Seconds until ``condition()`` is true; AssertionError naming ``what`` after ``timeout_s``.

    ``ignore``: exception types that ``condition`` may raise while what it polls is not up yet
    (e.g. ``(OSError,)`` for a server still starting); they count as false, and the last one is
    named in the timeout's message. Any other exception propagates at once."""
    start = time.monotonic()
    last: BaseException | None = None
    while True:
        try:
            if condition():
                return time.monotonic() - start
        except ignore as err:
            last = err
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s"
                                 + (f" (last error: {last!r})" if last is not None else ""))
        time.sleep(poll_s)
