"""`kvdiag top`: the live terminal UI of a KV cache."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

DESCRIPTION = """\
Live terminal UI of a KV cache: memory by source, KV pool occupancy and fragmentation, prefix
sharing (engine vs shadow), compression, attention locality, latency, requests and alerts.

  kvdiag top                    start the embedded demo server and watch it (stopped on quit)
  kvdiag top --engine vllm      the same demo on a real vLLM server (kvdiag fetch-engine vllm)
  kvdiag top --pid PID          watch a running server (its kvdiag agent, else from outside);
                                PID: any process of its tree (kvdiag demo, the server, an engine child)

Without a kvdiag agent, --pid of a vLLM, SGLang or TensorRT-LLM server reads it as `kvdiag attach`
does: its /metrics (found on its ports, or --metrics-url) fill the KV pool (usage gauge), prefix
hits (counter increases since top joined) and latency (histogram increases since the join); its
KV events (found, or --kv-events ENDPOINT) feed the KV-event checks. The status line names it
("pid N outside: /metrics + KV events (since join HH:MM:SS UTC)").
  kvdiag top --log FILE         replay a recorded log as if live (--speed, p pause, f seek)

Quitting never stops a server that top attached to; it stops the demo it started within
seconds (the requests in flight are cut). Press ? inside for the keys.
Exit status 2 when the source cannot be opened: among others, --pid of no process, whose agent is not
answering (no header within 5 s), refuses top (too many clients) or is another user's; 4 when
--pid serves no recognised engine (no kvdiag agent in its tree, not a vLLM, SGLang or TensorRT-LLM
server; --any-process watches it from outside anyway).
"""


DEMO_DURATION_S = 24 * 3600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--pid", type=int, help="attach to a running server process")
    parser.add_argument("--any-process", action="store_true",
                        help="--pid of a process that serves no recognised engine: watch it from outside anyway")
    src.add_argument("--log", type=Path, metavar="FILE", help="replay a recorded event log")
    src.add_argument("--socket", type=Path, metavar="PATH", help="read a kvdiag agent socket directly")
    parser.add_argument("--engine", choices=("transformers", "vllm"),
                        help="the demo's serving engine (default transformers)")
    from kvdiag.commands.attach import add_outside_arguments
    add_outside_arguments(parser)  # --pid of a server without the kvdiag agent: as attach reads it
    parser.add_argument("--speed", type=float, default=1.0, help="replay speed for --log (default 1.0)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--output-dir", type=Path, default=Path("."),
                        help="where s (screenshot) and r (recording) write files (default: .)")
    parser.add_argument("--paused", action="store_true", help="start a replay paused")
    parser.add_argument("demo_args", nargs=argparse.REMAINDER,
                        help="without a source: arguments passed to `kvdiag demo` after --")


def _error(message: str) -> int:
    print(f"kvdiag top: {message}", file=sys.stderr)
    return 2


def open_source(args: argparse.Namespace):
    """The event source the arguments ask for; raises SourceError with a one-line message."""
    from kvdiag.live.demo_source import DemoSource
    from kvdiag.live.merged_source import with_host_view
    from kvdiag.live.pid_source import attach
    from kvdiag.live.replay_source import ReplaySource
    from kvdiag.live.socket_source import SocketSource
    from kvdiag.live.sources import SourceError

    demo_args = [a for a in args.demo_args if a != "--"]
    if demo_args and (args.log or args.pid or args.socket):
        raise SourceError(f"unexpected arguments {' '.join(demo_args)!r} (they are for the demo, "
                          "which runs only without --log/--pid/--socket)")
    if args.engine and (args.log or args.pid or args.socket):
        raise SourceError("--engine chooses the demo's engine; it does not go with --log/--pid/--socket")
    if args.engine == "vllm":
        from kvdiag.demo.vllm_env import SETUP_HINT, vllm_python

        if vllm_python() is None:
            raise SourceError(SETUP_HINT)
        demo_args = ["--engine", "vllm", *demo_args]
    if args.interval <= 0:
        raise SourceError(f"--interval must be positive, got {args.interval}")
    if args.log is not None:
        if not args.log.is_file():
            raise SourceError(f"{args.log}: no such file")
        if args.speed <= 0:
            raise SourceError(f"--speed must be positive, got {args.speed}")
        return ReplaySource(args.log, speed=args.speed, start_paused=args.paused)
    if args.socket is not None:
        return SocketSource(args.socket)
    outside = _outside_options(args)
    if (outside.metrics_url or outside.kv_events) and args.pid is None:
        raise SourceError("--metrics-url and --kv-events go with --pid (a server watched from outside)")
    if args.pid is not None:
        return attach(args.pid, any_process=args.any_process, outside=outside)
    if not any(a.startswith("--model") for a in demo_args):
        from kvdiag.commands.fetch_model import resolve_with_progress

        resolve_with_progress(None)  # on first use, in the foreground: the demo's output is a file
    if not any(a.startswith(("--requests", "--duration")) for a in demo_args):
        demo_args = ["--duration", str(DEMO_DURATION_S), *demo_args]  # run until top quits
    from kvdiag.paths import log_dir

    # its output beside its event log
    demo = DemoSource(demo_args, log_dir=_demo_log(demo_args).parent if _demo_log(demo_args) else log_dir())
    return with_host_view(demo, demo.child.pid)


def _outside_options(args: argparse.Namespace):
    """attach's outside collectors' options given to top (no hardware probe: top shows none)."""
    from kvdiag.collectors.outside import OutsideOptions

    return OutsideOptions.from_args(args, hardware=False)


def _demo_log(demo_args: list[str]) -> Optional[Path]:
    """The demo's ``--log PATH`` among its arguments, if given."""
    for i, arg in enumerate(demo_args):
        if arg == "--log" and i + 1 < len(demo_args):
            return Path(demo_args[i + 1]).expanduser()
        if arg.startswith("--log="):
            return Path(arg.split("=", 1)[1]).expanduser()
    return None


def run(args: argparse.Namespace) -> int:
    from kvdiag.events.eventlog import LogFormatError
    from kvdiag.demo.smollm import ModelFetchError
    from kvdiag.collectors.agent_client import NO_ENGINE_EXIT
    from kvdiag.live.sources import NoEngineError, SourceError

    try:
        source = open_source(args)
    except NoEngineError as exc:
        print(f"kvdiag top: {exc}", file=sys.stderr)
        return NO_ENGINE_EXIT
    except (SourceError, LogFormatError) as exc:
        return _error(str(exc))
    except ModelFetchError as exc:
        print(f"kvdiag top: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        return _error(f"{getattr(exc, 'filename', '') or ''}: {exc.strerror or exc}")
    try:
        from kvdiag.tui.app import KvTopApp

        app = KvTopApp(source, interval_s=args.interval, output_dir=args.output_dir)
        app.run()
    finally:
        if hasattr(source, "child") or hasattr(getattr(source, "primary", None), "child"):
            print("kvdiag top: stopping the demo server…", file=sys.stderr)
        source.close()
    return app.return_code or 0
