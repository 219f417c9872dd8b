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
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

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
    parser.add_argument("--metrics-url", help="Prometheus endpoint (default: probe the target's ports)")
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


class _Session:
    """The collectors of one attach, sampled from the main loop."""

    def __init__(self, args, procs, writer) -> None:
        from kvdiag.collectors import metrics, nvml
        self.args, self.procs, self.writer = args, procs, writer
        self.nvml = nvml.NvmlCollector(pids=procs.pids)
        writer.record(self.nvml.start())
        from kvdiag.collectors.hardware import HardwareRecorder
        # the target's device is not ours to allocate on: probe the GPU only through torch
        # already imported here, else the host's memory
        self.hardware = HardwareRecorder(writer).start()
        self.metrics_url: Optional[str] = args.metrics_url
        self.metrics_mod = metrics
        self.next_probe = 0.0
        self.recorder = None
        self.pyspy_failed: Optional[str] = None
        from kvdiag.collectors import vllm
        self.vllm = vllm.identify(procs.root)
        from kvdiag.collectors import servers
        self.other = servers.identify(procs.root) if self.vllm is None else None  # SGLang, TRT-LLM
        self.engine = "vllm" if self.vllm is not None else self.other.engine if self.other else None
        self.engine_probed = False
        self.kv_events = None  # the ZMQ subscriber, once a vLLM server's stream is found
        self.kv_events_tried = False
        from kvdiag.events.schema import CollectorStatus
        if self.vllm is not None:
            writer.record(CollectorStatus(ts_ns=time.time_ns(), collector="vllm", available=True,
                                          hint=self.vllm.describe()))
        if self.other is not None:
            writer.record(CollectorStatus(ts_ns=time.time_ns(), collector=self.other.engine,
                                          available=True, hint=self.other.describe()))
        if args.kv_events:
            self.kv_events_tried = True
            self._subscribe({"endpoint": args.kv_events, "topic": args.kv_events_topic,
                             "replay_endpoint": args.kv_events_replay})

    def publisher(self) -> str:
        """Who publishes the KV events: ``--kv-events-publisher``, else the recognised engine,
        else ``unknown``."""
        return self.args.kv_events_publisher or self.engine or "unknown"

    def _subscribe(self, cfg: dict) -> None:
        """Subscribe to one KV-event endpoint (the subscriber side decided by
        :func:`kvdiag.collectors.vllm.subscriber_side`); the publisher named in the status."""
        from kvdiag.collectors import vllm
        from kvdiag.collectors.vllm_kv_events import KVEventSubscriber
        from kvdiag.events.schema import CollectorStatus
        mode, address = vllm.subscriber_side(cfg["endpoint"])
        raw = Path(str(self.args.out_path) + ".kvevents.jsonl")
        publisher = self.publisher()
        try:
            self.kv_events = KVEventSubscriber(address, self.writer, topic=cfg.get("topic") or "",
                                               replay_endpoint=cfg.get("replay_endpoint"),
                                               bind=(mode == "bind"), raw_path=raw,
                                               publisher=publisher).start()
        except Exception as exc:  # e.g. the address is taken by another subscriber
            self.writer.record(CollectorStatus(ts_ns=time.time_ns(), collector="vllm-kv-events",
                                               available=False, hint=f"{mode} {address}: {exc}"))
            return
        self.writer.record(CollectorStatus(ts_ns=time.time_ns(), collector="vllm-kv-events", available=True,
                                           hint=f"publisher {publisher}: {mode} {address}; raw stream {raw}"))

    def probe_metrics(self) -> None:
        from kvdiag.collectors.procfs import connect_host
        if self.metrics_url or time.monotonic() < self.next_probe:
            return
        self.next_probe = time.monotonic() + 5.0
        ports = [(connect_host(ip), port) for _, ip, port in self.procs.listening_ports()]
        self.metrics_url = self.metrics_mod.find_metrics_url(ports, timeout_s=1.0)
        if self.metrics_url:
            from kvdiag.events.schema import CollectorStatus
            self.writer.record(CollectorStatus(ts_ns=time.time_ns(), collector="metrics", available=True,
                                               hint=self.metrics_url))

    def _engine_from_metrics(self) -> None:
        """SGLang (``sglang:*``), TensorRT-LLM (``trtllm_*``) or vLLM (``vllm:*``) by the names
        its /metrics serves; recorded as that engine's ``CollectorStatus``."""
        from kvdiag.collectors import servers
        from kvdiag.events.schema import CollectorStatus
        try:
            names = [m.name for m in self.metrics_mod.parse_prometheus(
                self.metrics_mod.fetch_metrics_text(self.metrics_url, 1.0))]
        except (OSError, ValueError):
            return
        engine = servers.engine_of_metrics(names)
        if engine is not None:
            self.engine = engine
            self.writer.record(CollectorStatus(ts_ns=time.time_ns(), collector=engine, available=True,
                                               hint=f"recognised by its metric names at {self.metrics_url}"))

    def subscribe_kv_events(self) -> None:
        """A vLLM server's KV-event stream: from ``/kv_event_sources``, else its command line."""
        from kvdiag.collectors import vllm
        from kvdiag.events.schema import CollectorStatus
        self.kv_events_tried = True
        base_url = self.metrics_url.rsplit("/metrics", 1)[0]
        self.vllm.base_url = base_url
        try:
            configs = vllm.kv_event_sources(base_url)
        except (OSError, ValueError):
            cfg = vllm.kv_events_from_cmdline(self.procs.root.cmdline())
            configs = [cfg] if cfg and cfg.get("enable_kv_cache_events") else []
        if not configs:
            self.writer.record(CollectorStatus(
                ts_ns=time.time_ns(), collector="vllm-kv-events", available=False,
                hint="the server publishes no KV events (start it with --kv-events-config "
                     "'{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\"}')"))
            return
        self._subscribe({"endpoint": configs[0]["endpoint"], "topic": configs[0].get("topic", "")})

    def sample(self) -> None:
        for ev in self.procs.sample():  # raises TargetGone
            self.writer.record(ev)
        for ev in self.nvml.sample():
            self.writer.record(ev)
        self.hardware.sample()
        self.probe_metrics()
        if self.metrics_url and self.engine is None and not self.engine_probed:
            self.engine_probed = True  # not recognised from its command line: its metric names
            self._engine_from_metrics()
        if self.metrics_url and self.vllm is not None and not self.kv_events_tried:
            self.subscribe_kv_events()
        if self.other is not None and self.other.engine == "sglang" and not self.kv_events_tried:
            self.kv_events_tried = True  # SGLang takes vLLM's flag: --kv-events-config JSON
            from kvdiag.collectors import vllm
            cfg = vllm.kv_events_from_cmdline(self.procs.root.cmdline())
            if cfg and cfg.get("publisher", "zmq") == "zmq":
                self._subscribe({"endpoint": cfg.get("endpoint", "tcp://*:5557"),
                                 "topic": cfg.get("topic", ""),
                                 "replay_endpoint": cfg.get("replay_endpoint")})
        if self.metrics_url:
            self.metrics_mod.scrape_into(self.metrics_url, self.writer)

    def pyspy_tick(self, remaining_s: float) -> None:
        from kvdiag.collectors import pyspy
        if self.args.no_pyspy or self.pyspy_failed:
            return
        if self.recorder is not None and self.recorder.done():
            self._finish_window(self.recorder.result)
        if self.recorder is None and remaining_s >= 1.0:
            window = min(self.args.pyspy_window, remaining_s)
            try:
                self.recorder = pyspy.PySpyRecorder(self.args.pid, window, rate_hz=self.args.pyspy_rate,
                                                    exclude_pids=self.procs.excluded_pids())
            except (pyspy.PySpyError, OSError) as exc:  # not installed, or not executable
                self._pyspy_unavailable(str(exc))

    def _finish_window(self, get) -> None:
        from kvdiag.collectors import pyspy
        try:
            raw = get()
            if raw.stacks:
                self.writer.record(pyspy.phase_profile(raw))
        except pyspy.PySpyError as exc:
            self._pyspy_unavailable(str(exc))
        self.recorder = None

    def _pyspy_unavailable(self, message: str) -> None:
        """Phases become N/A for the rest of the session; the reason is recorded once."""
        from kvdiag.collectors import pyspy
        from kvdiag.events.schema import CollectorError
        self.pyspy_failed = message
        self.writer.record(CollectorError(ts_ns=time.time_ns(), collector=pyspy.NAME, message=message))

    def close(self) -> None:
        if self.recorder is not None:
            self._finish_window(self.recorder.stop)
        if self.kv_events is not None:
            self.kv_events.stop()
        self.nvml.close()


PYSPY_PROBES = 3


def _check_pyspy(pid: int, writer) -> Optional[str]:
    """Record py-spy's status; returns a fatal message (no permission) or None."""
    from kvdiag.collectors import pyspy
    from kvdiag.events.schema import CollectorStatus
    st = pyspy.status()
    if not st.available:
        writer.record(st)
        return None
    # a non-blocking dump reads the target's memory while it runs and can catch it mid-update
    # (py-spy then fails to copy an object): only a dump that fails every time, or for want of
    # permission, makes the phases N/A
    for attempt in range(PYSPY_PROBES):
        try:
            pyspy.dump(pid)
            break
        except (pyspy.PySpyError, subprocess.TimeoutExpired) as exc:
            msg = str(exc)
            if "may not read" in msg or attempt == PYSPY_PROBES - 1:
                writer.record(CollectorStatus(ts_ns=time.time_ns(), collector=pyspy.NAME, available=False,
                                              hint=msg))
                return msg if "may not read" in msg else None
    writer.record(CollectorStatus(ts_ns=time.time_ns(), collector=pyspy.NAME, available=True,
                                  hint="non-blocking sampling"))
    return None


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    import signal

    from kvdiag.collectors import procfs
    from kvdiag.collectors.vllm import vllm_root
    from kvdiag.collectors.agent_client import (NO_ENGINE_EXIT, AgentStream, find_agent_socket,
                                                process_label)
    from kvdiag.events.eventlog import LogWriter, iter_events, make_header, read_header
    from kvdiag.paths import make_private_dirs
    from kvdiag.events.schema import CollectorStatus
    from kvdiag.events.sinks import FanoutSink

    pid = parse_pid(args.pid)
    if pid is None:
        shown = args.pid if args.pid.lstrip("-").isdigit() else repr(args.pid)
        _err(f"PID {shown} is not a process id: expected an integer from 1 to {pid_max()}")
        return 2
    args.pid = pid
    if pid == os.getpid():
        _err(f"PID {pid} is kvdiag itself")
        return 2
    root = vllm_root(pid) if not args.socket else None
    other = None
    if root is None and not args.socket:  # SGLang, TensorRT-LLM: the process itself
        import psutil

        from kvdiag.collectors import servers
        try:
            other = servers.identify(psutil.Process(pid))
        except psutil.Error:
            other = None
    if root is not None and root != pid:  # an engine child: its server's /metrics and KV events too
        _err(f"PID {pid} is part of vLLM server {root}'s process tree: attaching to {root}")
        pid = args.pid = root
    if args.duration <= 0 or args.interval <= 0:
        _err("expected --duration and --interval > 0")
        return 2
    try:
        procs = procfs.ProcessCollector(pid)
    except (procfs.TargetGone, procfs.TargetNotAccessible) as exc:
        _err(str(exc))
        return 1
    out = Path(args.out) if args.out else _default_out(args.pid)
    if out.exists():
        _err(f"{out}: already exists; choose another --out")
        return 2
    make_private_dirs(out.parent)
    args.out_path = out

    agent = None
    found = find_agent_socket(pid) if not args.socket else None
    socks = [Path(args.socket)] if args.socket else [found] if found else []
    if not (socks or args.metrics_url or args.any_process or root is not None or other is not None
            or args.kv_events):
        _err(f"process {process_label(pid)} serves no recognised engine: no kvdiag agent in its process "
             f"tree and not a vLLM server (--any-process attaches to it anyway: process tree, NVML, py-spy)")
        return NO_ENGINE_EXIT
    agent_problem = "the target runs no kvdiag agent (start it with python -m kvdiag.run)"
    for path in socks:
        try:
            agent = AgentStream(path, sink=None)  # sink set once the writer exists
            break
        except (OSError, ConnectionError) as exc:
            agent_problem = f"{path}: {exc}"
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
    code = 0
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    exporter = None
    if args.prometheus is not None:
        from kvdiag.prometheus.exporter import serve
        try:
            exporter = serve(args.prometheus, header)
        except (ValueError, OSError) as exc:
            _err(f"--prometheus {args.prometheus}: {exc}")
            return 2
        _err(f"serving kvdiag metrics on http://{exporter.host}:{exporter.port}/metrics")
    log_writer = LogWriter(out, header, interval_s=0.5)
    writer = FanoutSink([log_writer, exporter.sink]) if exporter else log_writer
    if hasher is not None:  # every event, the agent's and the KV events' alike
        from kvdiag.pool.hashing import HashingSink
        writer = HashingSink(writer, hasher)
    session = None
    try:
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
        fatal = None if args.no_pyspy else _check_pyspy(args.pid, writer)
        if fatal:
            _err(fatal)
            return 1
        session = _Session(args, procs, writer)
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
            code = 3
        except KeyboardInterrupt:
            _err("interrupted; summarising what was recorded")
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
        log_writer.close()
        if exporter is not None:
            exporter.close()

    from kvdiag.diagnosis.attach_summary import summarize
    summary = summarize(iter_events(out), read_header(out), grace_s=args.grace)
    summary["log"] = str(out)
    if session is not None and session.pyspy_failed and code != 3:
        summary["pyspy_error"] = session.pyspy_failed
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(format_summary(summary))
    return code


def _mib(x) -> str:
    return "N/A" if x is None else f"{x / 2**20:,.1f} MiB"


def _pct(x) -> str:
    return "N/A" if x is None else f"{x:.1%}"


def _latency_lines(lat) -> list[str]:
    """The latency block of the summary (kvdiag.diagnosis.user_latency's figures)."""
    if not lat:
        return []
    from kvdiag.diagnosis.user_latency import LABELS, METRICS, fmt_s
    o = lat["overall"]
    out = [f"latency of finished requests ({o['requests_finished']}; P50 / P99)"]
    for m in METRICS:
        st = o["stats"][m]
        out.append(f"  {LABELS[m]:<18} " + (f"{fmt_s(st['p50_s'])} / {fmt_s(st['p99_s'])} (n {st['count']})"
                                           if st["p50_s"] is not None else st["reason"]))
    rate = lambda x: "N/A" if x is None else f"{x:.2f}/s"  # noqa: E731
    out += [f"  arrivals           {rate(o['arrival_rate_per_s'])}, completions {rate(o['completion_rate_per_s'])}", ""]
    return out


def _sharing_lines(sh: dict) -> list[str]:
    """Shadow vs engine over the same requests, with the window they cover."""
    if sh.get("requests") is None:
        return []
    start = sh.get("window_start_ns")
    since = (f"since join at {time.strftime('%H:%M:%S', time.localtime(start / 1e9))}" if start
             else "since the shadow started")
    return [f"  prefix sharing     {since}, {sh['requests']} requests: engine {_pct(sh.get('engine_hit_rate'))},"
            f" shadow {_pct(sh.get('shadow_hit_rate'))}"
            + (f" (gap {sh['gap'] * 100:+.1f} pts)" if sh.get("gap") is not None else "")]


def format_summary(s: dict) -> str:
    """The human-readable summary (what --json prints as data)."""
    m, kv, hr, ph = s["memory"], s["kv"], s["hit_rate"], s["phases"]
    lines = [f"kvdiag attach: PID {s['target_pid']}, {s['window']['duration_s']:.1f} s, "
             f"{s['events']} events -> {s['log']}", "",
             *_latency_lines(s.get("latency")),
             "memory by source",
             f"  process tree RSS   {_mib(m.get('process_rss_bytes'))} (peak {_mib(m.get('process_rss_peak_bytes'))},"
             f" {m.get('processes', 'N/A')} processes)",
             f"  GPU (NVML)         {_mib(m.get('gpu_process_bytes'))} of target, {_mib(m.get('gpu_used_bytes'))} device",
             f"  CUDA allocator     {_mib(m.get('allocator_reserved_bytes'))} reserved,"
             f" {_mib(m.get('allocator_allocated_bytes'))} allocated",
             f"  KV pool            {_mib(m.get('kv_used_bytes'))} used, {_mib(m.get('kv_cached_bytes'))} cached,"
             f" {_mib(m.get('kv_pool_bytes'))} total", "",
             "KV pool"]
    if "num_blocks" in kv:
        lines += [f"  blocks             {kv['blocks_used']} used, {kv['blocks_cached']} cached, {kv['blocks_free']} free"
                  f" of {kv['num_blocks']} (block {kv['block_size_tokens']} tokens)",
                  f"  occupancy          blocks {_pct(kv.get('block_occupancy'))}, tokens {_pct(kv.get('token_occupancy'))}"
                  f" (mean {_pct(kv.get('mean_block_occupancy'))} / {_pct(kv.get('mean_token_occupancy'))})"]
    else:
        lines.append("  N/A (no kvdiag agent events)")
    lines += [f"  block events       {kv['blocks_allocated']} allocated, {kv['blocks_released']} released,"
              f" {kv['blocks_evicted']} evicted, {kv['prefix_hits']} prefix hits",
              f"  requests finished  {kv['requests_finished']} ({kv['prompt_tokens']} prompt tokens,"
              f" {kv['output_tokens']} generated)",
              f"  prefix hit rate    {_pct(hr.get('token_hit_rate'))} of prompt tokens"
              + (f"; engine counters {_pct(hr.get('engine_hit_rate'))}" if "engine_hit_rate" in hr else ""),
              *_sharing_lines(s.get("sharing") or {}),
              f"  fragmentation      {_pct(s['fragmentation']['kv_empty_slot_share'])} empty slots in used blocks;"
              f" allocator {_pct(s['fragmentation']['allocator'])}", "",
              f"phases (py-spy, {ph['samples']} samples)"]
    if ph["shares"]:
        lines += [f"  {p:<18} {v:6.1%}" for p, v in ph["shares"].items()]
        lines += ["  hottest: " + "; ".join(f"{fn} {v:.1%}" for fn, v in ph["top_functions"][:3])]
    else:
        lines.append("  N/A" + (f" ({s['pyspy_error']})" if s.get("pyspy_error") else ""))
    lines += ["", "collectors"] + [f"  {c['collector']:<18} {'ok' if c['available'] else 'N/A'}  {c['hint']}"
                                   for c in s["collectors"]]
    lines += ["", "findings"] + [f"  [{f['status']:>4}] {f['rule']}: {f['message']}" for f in s["findings"]]
    return "\n".join(lines)
