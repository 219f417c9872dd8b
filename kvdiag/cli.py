"""`kvdiag` command line: one subcommand per module in ``kvdiag.commands``.

A subcommand whose module is not there yet says so and exits 2: no pretend output.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvdiag import __version__

COMMANDS: dict[str, str] = {
    "demo": "serve the embedded real model (SmolLM2 on transformers' engine, or vLLM) with chat traffic, recording a log",
    "top": "live terminal UI of a KV cache (demo, --pid PID or --log FILE)",
    "attach": "join a running server from outside and record what is visible",
    "report": "turn recorded logs into a self-contained HTML or markdown report",
    "replay": "replay a trace through shadow prefix caches: hit rates per policy and capacity",
    "plan": "KV memory and GPUs a workload needs on a model (peak, P99, with sharing and compression)",
    "doctor": "run the memory-leak and P99-spike checklists on a log or a running server",
    "export": "write recorded logs to a Parquet dataset partitioned by event type and node",
    "shadow": "run the embedded model in-process with shadow KV compression and attention locality",
    "fetch-model": "download and convert the embedded default model (SmolLM2-135M-Instruct)",
    "fetch-engine": "build vLLM's own environment under the kvdiag cache (for demo/top --engine vllm)",
}


def _module_name(command: str) -> str:
    return "kvdiag.commands." + command.replace("-", "_")


def _load(command: str):
    try:
        return importlib.import_module(_module_name(command))
    except ModuleNotFoundError as exc:
        if exc.name == _module_name(command):
            return None
        raise


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(
        prog="kvdiag",
        description="Make the KV cache of LLM serving engines observable.",
    )
    parser.add_argument("--version", action="version", version=f"kvdiag {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, help_text in COMMANDS.items():
        module = _load(name)
        modules[name] = module
        doc = getattr(module, "DESCRIPTION", None) or help_text
        p = sub.add_parser(name, help=help_text, description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if module is not None:
            module.add_arguments(p)
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = modules[args.command]
    if module is None:
        print(f"kvdiag {args.command}: not available yet in kvdiag {__version__}", file=sys.stderr)
        return 2
    from kvdiag.paths import RuntimeDirError

    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except RuntimeDirError as exc:  # one line, no traceback: what to fix is in the message
        print(f"kvdiag {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
