"""Run a Python server command with the kvdiag agent installed before its engine starts.

    python -m kvdiag.run [--log PATH] [--socket PATH | --no-socket] [--prometheus [HOST:]PORT] \
        -- transformers serve MODEL ...

The command runs in this process: a console script (``transformers``), ``-m module`` or a
``script.py`` (a leading ``python`` is dropped). On exit, including SIGINT/SIGTERM, the agent
takes a last pool sample and flushes the log before the process ends.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import threading
from importlib import metadata
from typing import Callable, Optional

from kvdiag import agent


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("kvdiag.run: expected `-- <server command ...>` after the options")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m kvdiag.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", help="event log to write (.gz for gzip)")
    parser.add_argument("--socket", help="Unix socket for live events (default: runtime dir, per pid)")
    parser.add_argument("--no-socket", action="store_true", help="do not serve live events")
    parser.add_argument("--model", default="", help="model label or folder, recorded in the log header")
    parser.add_argument("--page-size", type=int, help="KV block size in tokens, recorded in the header")
    parser.add_argument("--inject-leak", type=int, default=0, metavar="N",
                        help="FAULT INJECTION for testing: skip the engine's release of every N-th "
                             "finished request's KV blocks (a real leak)")
    parser.add_argument("--sample-interval", type=float, default=0.5, help="seconds between pool samples")
    parser.add_argument("--record-tokens", action="store_true",
                        help="record prompts' token ids (the log then holds the prompts; default: "
                             "salted chunk hashes, or KVDIAG_RECORD_TOKENS=1)")
    parser.add_argument("--shadow", action="store_true",
                        help="shadow compression and locality on sampled decode steps of the live KV")
    parser.add_argument("--shadow-methods", help="comma-separated compression methods (default: all)")
    parser.add_argument("--shadow-rate", type=float,
                        help="most share of decode steps sampled (default 0.005: sampled steps are slower, and "
                             "this keeps them out of P99; the budget may lower it)")
    parser.add_argument("--shadow-layers", type=int,
                        help="layers measured per sampled step, spread over the depth and rotating "
                             "(default 3; 0: all)")
    parser.add_argument("--shadow-budget", type=float, default=0.01,
                        help="shadow CPU budget, fraction of the engine's CPU time (0: none)")
    parser.add_argument("--prometheus", metavar="[HOST:]PORT",
                        help="serve kvdiag's metrics for Prometheus (HTTP /metrics; host 127.0.0.1 "
                             "unless given; docs/metrics.md)")
    args = parser.parse_args(argv[:split])
    if args.prometheus is not None:
        from kvdiag.prometheus.exporter import parse_address
        try:
            parse_address(args.prometheus)
        except ValueError as exc:
            raise SystemExit(f"kvdiag.run: --prometheus: {exc}")
    if args.shadow:
        from kvdiag.kernels.methods import parse_methods
        try:
            parse_methods(args.shadow_methods) if args.shadow_methods else None
        except ValueError as exc:
            raise SystemExit(f"kvdiag.run: --shadow-methods: {exc}")
        if args.shadow_rate is not None and not 0.0 <= args.shadow_rate <= 1.0:
            raise SystemExit("kvdiag.run: --shadow-rate: expected a number in [0, 1]")
        if args.shadow_layers is not None and args.shadow_layers < 0:
            raise SystemExit("kvdiag.run: --shadow-layers: expected 0 (all) or more")
    command = argv[split + 1:]
    if not command:
        raise SystemExit("kvdiag.run: expected a server command after `--`")
    return args, command


def resolve_command(command: list[str]) -> tuple[Callable[[], object], list[str]]:
    """The callable that runs ``command`` in-process, and the ``sys.argv`` it should see."""
    if os.path.basename(command[0]).startswith("python"):
        command = command[1:]
        if not command:
            raise SystemExit("kvdiag.run: expected a module, script or console script after python")
    head = command[0]
    if head == "-m":
        if len(command) < 2:
            raise SystemExit("kvdiag.run: expected a module name after -m")
        module = command[1]
        return (lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)), [module] + command[2:]
    if head.endswith(".py"):
        # as `python script.py` would: the script's folder first on sys.path (kvdiag's own
        # children run with -P, which leaves it out)
        sys.path.insert(0, os.path.dirname(os.path.abspath(head)))
        return (lambda: runpy.run_path(head, run_name="__main__")), command
    name = os.path.basename(head)
    matches = metadata.entry_points(group="console_scripts", name=name)
    for entry in matches:
        return entry.load(), command
    raise SystemExit(f"kvdiag.run: {head}: expected a Python console script, `-m module` or script.py")


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _leftover_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
            and t.is_alive()]


def agent_kwargs(args: argparse.Namespace, command: list[str]) -> dict:
    """:func:`kvdiag.agent.start`'s arguments from the command line."""
    return dict(log_path=args.log, socket=not args.no_socket, socket_path=args.socket,
                model=args.model, block_size_tokens=args.page_size,
                inject_leak_every=args.inject_leak, sample_interval_s=args.sample_interval,
                extra={"command": command}, prometheus=args.prometheus,
                record_token_ids=True if args.record_tokens else None,
                shadow=shadow_options(args) if args.shadow else None)


def start_agent(args: argparse.Namespace, command: list[str]) -> None:
    """Start the agent here, or where the server runs its engine when that is another process
    (``transformers serve`` from 5.25 on); its default socket is named after this process, the
    one the user started, so that ``--pid`` finds it either way."""
    from kvdiag.agent import transformers_serve

    kwargs = agent_kwargs(args, command)
    if not transformers_serve.serves_in_a_child(command):
        agent.start(**kwargs)
        return
    if kwargs["socket"] and kwargs["socket_path"] is None:
        from kvdiag import paths
        try:
            kwargs["socket_path"] = str(paths.agent_socket_path())
            paths.remove_stale_sockets(paths.runtime_dir())
        except Exception:
            pass  # the agent in the engine's process says why it records without the socket
    transformers_serve.route_agent_to_engine_process(kwargs)


def shadow_options(args: argparse.Namespace) -> dict:
    """``kvdiag.shadow.transformers_cb.install`` options from the flags; a flag not
    given keeps install's default (the one definition of each)."""
    options = {"methods": args.shadow_methods, "budget_frac": args.shadow_budget or None}
    if args.shadow_rate is not None:
        options["sample_rate"] = args.shadow_rate
    if args.shadow_layers is not None:
        options["layers_per_run"] = args.shadow_layers or None
    return options


def main(argv: Optional[list[str]] = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    target, target_argv = resolve_command(command)
    start_agent(args, command)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    code = 0
    sys.argv = target_argv
    try:
        result = target()
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    finally:
        agent.stop()
    if _leftover_threads():
        # the engine's generation thread is not a daemon and the server does not always stop it;
        # the log is flushed, so end the process instead of hanging
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
