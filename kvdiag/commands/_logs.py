"""Reading logs for a command: a rich progress bar while reading, one-line errors, and one
way to say which input lines were skipped.

Every command that reads logs or traces treats input the same way: an unreadable line in the
middle is skipped and reported (how many, and the first few as ``file:line: why``, on stderr
and under ``"skipped_lines"`` in ``--json``); ``--strict`` makes the first one an error (exit
2); a last line cut short by a killed writer is an error unless ``--partial``."""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path
from typing import Iterable, Optional

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvdiag.diagnosis.frames import Logs, load


def _estimated_lines(path: Path) -> Optional[int]:
    """Lines of a plain log estimated from its size and its first MiB (None for gzip)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        if head[:2] == b"\x1f\x8b" or not head:
            return None
        return max(1, int(os.path.getsize(path) / max(len(head) / max(head.count(b"\n"), 1), 1)))
    except OSError:
        return None


SKIPPED_SHOWN = 3
"""How many skipped lines a command names (all are counted)."""


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """``--partial`` and ``--strict``: how a command treats cut and unreadable input lines."""
    parser.add_argument("--partial", action="store_true",
                        help="accept input cut short mid-line (use what comes before the cut)")
    parser.add_argument("--strict", action="store_true",
                        help="fail (exit 2) at the first unreadable line instead of skipping it")


def skipped_lines(problems: list[str]) -> dict:
    """The ``--json`` form of the skipped lines: their count and the first few."""
    return {"count": len(problems), "first": problems[:SKIPPED_SHOWN]}


def tell_skipped(command: str, problems: list[str]) -> None:
    """Say on stderr how many input lines were skipped, naming the first few."""
    if not problems:
        return
    print(f"kvdiag {command}: skipped {len(problems)} unreadable line(s); "
          + ("first: " if len(problems) > SKIPPED_SHOWN else "")
          + "; ".join(problems[:SKIPPED_SHOWN]), file=sys.stderr)


def expand(paths: Iterable[str]) -> list[Path]:
    """The inputs, a quoted glob (of Parquet datasets, say) replaced by what it matches."""
    out = []
    for p in paths:
        matches = sorted(glob.glob(p)) if not os.path.exists(p) and glob.has_magic(p) else []
        out += [Path(m) for m in matches] or [Path(p)]
    return out


def read_logs(paths: Iterable[str], quiet: bool = False, allow_truncated: bool = False,
              strict: bool = False, every_type: bool = False) -> tuple[Logs, list[str]]:
    """Load and merge logs and Parquet datasets (folders) with a progress bar on stderr
    (shown only on a terminal). Returns the logs and the skipped lines (``strict``: the
    first one raises LogFormatError). ``every_type``: also the event types reports do not
    use (by default left out)."""
    paths = expand(paths)
    total = [None if p.is_dir() else _estimated_lines(p) for p in paths]
    progress = Progress(TextColumn("reading {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("lines"), TimeElapsedColumn(),
                        disable=quiet or not sys.stderr.isatty(), transient=True)
    with progress:
        task = progress.add_task(", ".join(p.name for p in paths),
                                 total=sum(total) if all(total) else None)
        return load(paths, on_progress=lambda n: progress.advance(task, n),
                    allow_truncated=allow_truncated, strict=strict,
                    **({"skip": frozenset()} if every_type else {}))


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename,
    so that ``path`` is either the old file or the whole new one, never half-written; mode
    0600 (:func:`kvdiag.paths.write_private_atomic`)."""
    from kvdiag.paths import write_private_atomic

    write_private_atomic(path, text)


def fail(command: str, message: str) -> int:
    print(f"kvdiag {command}: {message}", file=sys.stderr)
    return 2
