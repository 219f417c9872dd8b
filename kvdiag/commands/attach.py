"""`kvdiag attach PID`: join a running server from outside and record what is visible.

Read-only towards the target: attach never signals it (no kill, no SIGSTOP/SIGINT; the only
signals it sends go to its own py-spy children), never ptrace-attaches it (py-spy always runs
``--nonblocking``: it reads the target's memory without stopping it) and never writes to it
(it reads /proc, GETs the target's HTTP endpoints, subscribes to its ZMQ KV events and reads
the kvdiag agent's socket). A target that is an ancestor of kvdiag (a container's PID 1, the
shell that started it) has kvdiag's own processes left out of its tree, RSS and profiles.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from kvdiag.commands._attach_session import Session, check_pyspy
from kvdiag.commands._attach_text import format_summary

DESCRIPTION = """\
Join a running server from outside: its process tree (RSS, threads, CPU time), NVIDIA GPUs
(NVML), Python stacks by phase (py-spy, non-blocking), its Prometheus /metrics if it serves
one, and, if it runs the kvdiag agent, the agent's live KV events. A vLLM server is recognised
(its command line, its VLLM::EngineCore and VLLM::Worker children); when it publishes KV events
(GET /kv_event_sources, or --kv-events-config on its command line) they are subscribed to over
ZMQ, sequence gaps included, and kept raw beside the log for `kvdiag replay`. Nothing is sent
to the server but GETs. Everything goes into one kvdiag log; a summary is printed at the end
(--json for machine-readable output).

SGLang and TensorRT-LLM servers are recognised too (their command line; their sglang:* and
trtllm_* metrics are mapped like vLLM's); an SGLang server's --kv-events-config stream is
subscribed to. --kv-events ENDPOINT subscribes to any engine's KV events (vLLM's wire format:
vLLM, SGLang, a TensorRT-LLM or LMCache relay), the publisher named in the log.

Never signals, stops or writes to the target. Attached to an ancestor of kvdiag (a
container's PID 1, its shell), kvdiag's own processes are left out of the target's tree.

PID may be any process of a served tree: `kvdiag demo`, the server it starts, an engine child
(VLLM::EngineCore, VLLM::Worker: attach then joins their vLLM server); the agent is found the
same way as by `doctor --pid` and `top --pid`.

Exit status: 0 done; 1 no such process / not ours to trace; 2 bad arguments (a PID that is
not an integer from 1 to the kernel's pid_max, kvdiag's own PID); 3 the target exited while
attached (the log recorded so far is kept); 4 the process serves no recognised engine (no
kvdiag agent in its process tree, not a vLLM server; --any-process attaches anyway).
"""


def add_outside_arguments(parser: argparse.ArgumentParser) -> None:
    """The outside collectors' options (:class:`kvdiag.collectors.outside.OutsideOptions`),
    attach's and ``top --pid``'s alike."""
    parser.add_argument("--metrics-url", help="Prometheus endpoint (default: probe the target's ports)")
    parser.add_argument("--kv-events", metavar="ENDPOINT", default=None,
                        help="subscribe to this ZMQ endpoint's KV events (BlockStored/BlockRemoved/"
                             "AllBlocksCleared, msgpack: vLLM, SGLang, a TensorRT-LLM or LMCache relay); "
                             "a wildcard or ipc endpoint is connected to, any other bound, as the "
                             "publisher would expect")
    parser.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                        help="ZMQ topic of --kv-events (default: every topic)")
    parser.add_argument("--kv-events-replay", metavar="ENDPOINT", default=None,
                        help="the publisher's ROUTER replay endpoint, to fill lost batches")
    parser.add_argument("--kv-events-publisher", metavar="NAME", default=None,
                        help="who publishes --kv-events, named in the log (default: the engine "
                             "recognised from the command line, else 'unknown')")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pid", help="process id of the server")
    parser.add_argument("--duration", type=float, default=30.0, metavar="S",
                        help="seconds to stay attached (default 30; Ctrl-C or SIGTERM ends early)")
    parser.add_argument("--out", metavar="LOG", help="event log to write (default: kvdiag log dir)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--interval", type=float, default=1.0, metavar="S",
                        help="seconds between process/NVML/metrics samples (default 1)")
    parser.add_argument("--pyspy-rate", type=int, default=20, metavar="HZ",
                        help="py-spy samples per second (default 20)")
    parser.add_argument("--pyspy-window", type=float, default=10.0, metavar="S",
                        help="seconds per phase profile (default 10)")
    parser.add_argument("--no-pyspy", action="store_true", help="do not sample Python stacks")
    parser.add_argument("--socket", help="agent socket (default: found from the target's process tree)")
    parser.add_argument("--any-process", action="store_true",
                        help="attach also to a process that serves no recognised engine (no kvdiag agent "
                             "in its tree, not vLLM): the outside view only (process tree, NVML, py-spy)")
    parser.add_argument("--prometheus", metavar="[HOST:]PORT", default=None,
                        help="also serve what is recorded as kvdiag's metrics for Prometheus while "
                             "attached (127.0.0.1 unless a host is given; docs/metrics.md)")
    parser.add_argument("--record-tokens", action="store_true",
                        help="keep prompts' token ids when the target's agent records them "
                             "(KVDIAG_RECORD_TOKENS=1 there); default: hash them into the log")
    add_outside_arguments(parser)
    parser.add_argument("--grace", type=float, default=5.0, metavar="S",
                        help="seconds after which a finished request's held blocks count as leaked")


def _content_of(agent_header, record_tokens: bool):
    """(the hasher every recorded event goes through, or None; the log header's content
    fields): the agent's own hashes and salt when it records hashes, token ids (the agent's,
    an engine's KV events') hashed under a fresh salt unless ``--record-tokens`` keeps them."""
    from kvdiag.pool.hashing import CONTENT_CHUNK_TOKENS, ContentHasher

    if agent_header.content == "hashes":
        if record_tokens:
            _err("--record-tokens: the target's agent records hashes only (start it with "
                 "KVDIAG_RECORD_TOKENS=1 to record token ids)")
        # the hasher only drops the token ids of an engine's own KV events
        return ContentHasher(agent_header.content_salt), dict(
            content="hashes", content_salt=agent_header.content_salt,
            content_chunk_tokens=agent_header.content_chunk_tokens)
    if record_tokens:
        from kvdiag.agent import warn_recording_tokens
        warn_recording_tokens()
        return None, dict(content="token_ids")
    hasher = ContentHasher()
    return hasher, dict(content="hashes", content_salt=hasher.salt,
                        content_chunk_tokens=CONTENT_CHUNK_TOKENS)


def _err(msg: str) -> None:
    print(f"kvdiag attach: {msg}", file=sys.stderr)


PID_MAX_LIMIT = 1 << 22
"""The kernel's largest possible pid_max (used when /proc/sys/kernel/pid_max is unreadable)."""


def pid_max() -> int:
    """The largest PID this kernel hands out."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return PID_MAX_LIMIT


def parse_pid(text: str) -> Optional[int]:
    """``text`` as a PID (an integer from 1 to :func:`pid_max`), else None."""
    try:
        pid = int(text.strip())
    except ValueError:
        return None
    return pid if 1 <= pid <= pid_max() else None


def _default_out(pid: int) -> Path:
    from kvdiag.paths import log_dir

    return log_dir() / f"attach-{pid}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


class _Exit(Exception):
    """Ends ``attach`` before recording: ``code`` is its exit status (the message was said)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _fail(code: int, message: str) -> _Exit:
    _err(message)
    return _Exit(code)


def _target(args: argparse.Namespace):
    """The process to attach to, checked (``args.pid`` set to it: an engine child of a vLLM
    server becomes its server), and the recognised server: (pid, vLLM root or None, another
    recognised engine or None)."""
    from kvdiag.collectors.outside import recognised_server

    pid = parse_pid(args.pid)
    if pid is None:
        shown = args.pid if args.pid.lstrip("-").isdigit() else repr(args.pid)
        raise _fail(2, f"PID {shown} is not a process id: expected an integer from 1 to {pid_max()}")
    args.pid = pid
    if pid == os.getpid():
        raise _fail(2, f"PID {pid} is kvdiag itself")
    served = recognised_server(pid) if not args.socket else None  # vLLM's tree; SGLang, TRT-LLM: pid itself
    root = served.pid if served is not None and served.engine == "vllm" else None
    other = served if served is not None and served.engine != "vllm" else None
    if root is not None and root != pid:  # an engine child: its server's /metrics and KV events too
        _err(f"PID {pid} is part of vLLM server {root}'s process tree: attaching to {root}")
        pid = args.pid = root
    if args.duration <= 0 or args.interval <= 0:
        raise _fail(2, "expected --duration and --interval > 0")
    return pid, root, other


def _out_path(args: argparse.Namespace) -> Path:
    """The log to write (``--out``, else one under the log folder); it must not exist yet."""
    from kvdiag.paths import make_private_dirs

    out = Path(args.out) if args.out else _default_out(args.pid)
    if out.exists():
        raise _fail(2, f"{out}: already exists; choose another --out")
    make_private_dirs(out.parent)
    args.out_path = out
    return out


def _agent(args: argparse.Namespace, pid: int, served: bool):
    """The kvdiag agent's stream in the target's tree, connected (None when there is none),
    and why not; exits when the target serves nothing recognised (``served``: a vLLM, SGLang
    or TensorRT-LLM server) and nothing was asked for by hand."""
    from kvdiag.collectors.agent_client import (NO_ENGINE_EXIT, AgentStream, find_agent_socket,
                                                process_label)

    found = find_agent_socket(pid) if not args.socket else None
    socks = [Path(args.socket)] if args.socket else [found] if found else []
    if not (socks or args.metrics_url or args.any_process or served or args.kv_events):
        raise _fail(NO_ENGINE_EXIT, f"process {process_label(pid)} serves no recognised engine: no "
                    "kvdiag agent in its process tree and not a vLLM server (--any-process "
                    "attaches to it anyway: process tree, NVML, py-spy)")
    problem = "the target runs no kvdiag agent (start it with python -m kvdiag.run)"
    for path in socks:
        try:
            return AgentStream(path, sink=None), problem  # sink set once the writer exists
        except (OSError, ConnectionError) as exc:
            problem = f"{path}: {exc}"
    return None, problem


def _log_header(args: argparse.Namespace, procs, agent):
    """The attach log's header (the agent's model and KV shape when it has one) and the
    content hasher its events go through (None: token ids as recorded)."""
    from kvdiag.events.eventlog import make_header

    try:
        cmdline = " ".join(procs.root.cmdline())
    except Exception:
        cmdline = ""
    ah = agent.header if agent else make_header()
    hasher, content = _content_of(ah, args.record_tokens)
    header = make_header(pid=args.pid, engine="attach", model=ah.model, block_size_tokens=ah.block_size_tokens,
                         **content,
                         bytes_per_token=ah.bytes_per_token, node=socket.gethostname(),
                         extra={"target_cmdline": cmdline, "agent_engine": ah.engine,
                                "agent_socket": str(agent.path) if agent else None})
    return header, hasher


class _Sinks:
    """Where the session's events go: the log, the Prometheus exporter with ``--prometheus``,
    through the content hasher when there is one (``writer`` records into all)."""

    def __init__(self, args: argparse.Namespace, out: Path, header, hasher) -> None:
        from kvdiag.events.log_writer import LogWriter
        from kvdiag.events.sinks import FanoutSink

        self.exporter = None
        if args.prometheus is not None:
            from kvdiag.prometheus.exporter import serve
            try:
                self.exporter = serve(args.prometheus, header)
            except (ValueError, OSError) as exc:
                raise _fail(2, f"--prometheus {args.prometheus}: {exc}") from None
            _err(f"serving kvdiag metrics on http://{self.exporter.host}:{self.exporter.port}/metrics")
        self.log = LogWriter(out, header, interval_s=0.5)
        writer = FanoutSink([self.log, self.exporter.sink]) if self.exporter else self.log
        if hasher is not None:  # every event, the agent's and the KV events' alike
            from kvdiag.pool.hashing import HashingSink
            writer = HashingSink(writer, hasher)
        self.writer = writer

    def close(self) -> None:
        self.log.close()
        if self.exporter is not None:
            self.exporter.close()


def _start(args: argparse.Namespace, pid: int, procs, agent, agent_problem: str, writer) -> "Session":
    """Record what is known at the start (the agent, kvdiag's own processes in the target's
    tree, py-spy's status), start the agent's stream and open the collectors' session."""
    from kvdiag.events.schema import CollectorStatus

    writer.record(CollectorStatus(ts_ns=time.time_ns(), collector="agent", available=agent is not None,
                                  hint=str(agent.path) if agent else agent_problem))
    if agent is not None:
        agent.sink = writer
        agent.start()
    if procs.lineage:
        writer.record(CollectorStatus(
            ts_ns=time.time_ns(), collector="procfs", available=True,
            hint=f"PID {pid} is an ancestor of kvdiag: kvdiag's own processes "
                 f"({', '.join(map(str, procs.lineage))} and below) are left out of its tree"))
    fatal = None if args.no_pyspy else check_pyspy(args.pid, writer)
    if fatal:
        raise _fail(1, fatal)
    return Session(args, procs, writer)


def _sample_until_done(args: argparse.Namespace, session: "Session", out: Path) -> int:
    """Sample every ``--interval`` for ``--duration`` seconds, or until Ctrl-C or SIGTERM
    (which end the session as its end would); 3 when the target exited meanwhile, else 0."""
    import signal

    from kvdiag.collectors import procfs

    # SIGTERM (a supervisor, a script that started attach in the background, where SIGINT
    # is ignored) ends the session as Ctrl-C does: summary printed, log kept
    signal.signal(signal.SIGTERM, _interrupted)
    deadline = time.monotonic() + args.duration
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            session.pyspy_tick(deadline - now)
            session.sample()
            time.sleep(max(0.0, min(args.interval, deadline - time.monotonic())))
    except procfs.TargetGone as exc:
        _err(f"{exc} while attached; the log recorded so far is kept in {out}")
        return 3
    except KeyboardInterrupt:
        _err("interrupted; summarising what was recorded")
    return 0


def _print_summary(args: argparse.Namespace, out: Path, session: Optional["Session"], code: int) -> None:
    """The summary of the recorded log (:func:`kvdiag.diagnosis.attach_summary.summarize`)."""
    from kvdiag.diagnosis.attach_summary import summarize
    from kvdiag.events.eventlog import iter_events, read_header

    summary = summarize(iter_events(out), read_header(out), grace_s=args.grace)
    summary["log"] = str(out)
    if session is not None and session.pyspy_failed and code != 3:
        summary["pyspy_error"] = session.pyspy_failed
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(format_summary(summary))


def run(args: argparse.Namespace) -> int:
    """Attach: check the target, connect to what it offers, record until the end, summarise.
    Whatever happens while recording, the collectors stop and the log is closed and kept."""
    try:
        return _attach(args)
    except _Exit as stop:
        return stop.code


def _attach(args: argparse.Namespace) -> int:
    import signal

    from kvdiag.collectors import procfs

    pid, root, other = _target(args)
    try:
        procs = procfs.ProcessCollector(pid)
    except (procfs.TargetGone, procfs.TargetNotAccessible) as exc:
        raise _fail(1, str(exc)) from None
    out = _out_path(args)
    agent, agent_problem = _agent(args, pid, served=root is not None or other is not None)
    header, hasher = _log_header(args, procs, agent)
    code = 0
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    sinks = _Sinks(args, out, header, hasher)
    session = None
    try:
        session = _start(args, pid, procs, agent, agent_problem, sinks.writer)
        code = _sample_until_done(args, session, out)
    finally:
        if previous_sigterm is not None:  # None: set from C, not restorable
            signal.signal(signal.SIGTERM, previous_sigterm)
        if session is not None:
            try:
                session.close()
            except Exception as exc:  # never lose the log because a collector failed to stop
                _err(f"py-spy did not stop cleanly: {exc}")
        if agent is not None:
            agent.close(drain_s=0.5 if code == 0 else 0.0)
        sinks.close()
    _print_summary(args, out, session, code)
    return code
