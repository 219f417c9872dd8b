"""What `kvdiag replay`'s three modes share: capacities, the progress bar, percentages, and
writing the result to a reader that may leave."""

from __future__ import annotations

import os
import re
import sys
from typing import Callable, Optional

from kvdiag.events.units import BYTE_UNITS


def parse_capacity(text: str) -> tuple[Optional[int], Optional[int]]:
    """'1000' -> (1000 blocks, None); '4GiB' -> (None, bytes); 'unbounded' -> (None, None)."""
    t = text.strip().lower()
    if t in ("unbounded", "none", "inf", "infinite"):
        return None, None
    if re.fullmatch(r"\d+", t):
        return int(t), None
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmgt]i?b|b)", t)
    if not m:
        raise ValueError(f"expected a capacity like 1000 (blocks), 4GiB, 500MB or unbounded, "
                         f"got {text!r}")
    return None, int(float(m.group(1)) * BYTE_UNITS[m.group(2)])


class Usage(ValueError):
    """An option the trace cannot honour."""


def capacities_blocks(caps, block_size: int, bpt: Optional[int]) -> list[Optional[int]]:
    """Each parsed capacity in blocks of ``block_size`` tokens (bytes need ``bpt``, the KV
    bytes per token; None stays unbounded)."""
    out = []
    for blocks, nbytes in caps:
        if nbytes is not None:
            if not bpt:
                raise Usage("expected --bytes-per-token (or a log header with bytes_per_token) "
                            "for a capacity in bytes")
            blocks = nbytes // (block_size * bpt)
        out.append(blocks)
    return out


def progress(total: Optional[int], quiet: bool):
    """A rich progress bar on stderr for long work (a no-op callback when quiet); ``total``
    None = unknown (a streamed trace): the bar counts block references."""
    if quiet or (total is not None and total < 2_000_000) or not sys.stderr.isatty():
        return None, (lambda n: None)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("replay"), BarColumn(), TextColumn("{task.completed:,} block refs"),
                   TimeRemainingColumn(), transient=True, console=Console(stderr=True))
    bar.start()
    task = bar.add_task("replay", total=total)
    return bar, (lambda n: bar.advance(task, n))


def pct(x) -> str:
    """A rate as a percentage, "-" when unknown."""
    return "-" if x is None or x != x else f"{100 * x:5.1f}%"


def need_requests(path, requests: int, problems: list[str]) -> None:
    """Raise TraceFormatError when bad lines were skipped and no request was left."""
    from kvdiag.traces.lines import TraceFormatError

    if problems and not requests:
        raise TraceFormatError(f"{path}: expected at least one readable request, found "
                               f"only unreadable lines (first: {problems[0]})")


def write_stdout(write: Callable[[], None]) -> None:
    """Run ``write`` (which prints the result) and flush; a reader that left
    (``kvdiag replay ... | head``) is not an error: stdout is pointed at /dev/null."""
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
