"""Reading logs for a command: a rich progress bar while reading, one-line errors."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvdiag.analysis.logs import Logs, load
from kvdiag.eventlog import LogFormatError


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


def read_logs(paths: Iterable[str], quiet: bool = False,
              allow_truncated: bool = False) -> tuple[Logs, list[str]]:
    """Load and merge logs with a progress bar on stderr (shown only on a terminal)."""
    paths = [Path(p) for p in paths]
    total = [_estimated_lines(p) for p in paths]
    progress = Progress(TextColumn("reading {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("lines"), TimeElapsedColumn(),
                        disable=quiet or not sys.stderr.isatty(), transient=True)
    with progress:
        task = progress.add_task(", ".join(p.name for p in paths),
                                 total=sum(total) if all(total) else None)
        return load(paths, on_progress=lambda n: progress.advance(task, n),
                    allow_truncated=allow_truncated)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename,
    so that ``path`` is either the old file or the whole new one, never half-written."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def fail(command: str, message: str) -> int:
    print(f"kvdiag {command}: {message}", file=sys.stderr)
    return 2
