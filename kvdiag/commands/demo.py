"""`kvdiag demo`: serve the embedded real model under the kvdiag agent and drive it with chat traffic.

The server is transformers' own continuous-batching engine (``transformers serve
--continuous-batching``, CPU, fp32) started as a child process under ``python -m kvdiag.run``,
with its KV cache sized explicitly (``--num-blocks`` blocks of ``--page-size`` tokens). The
traffic generator sends customer-service chats over the OpenAI-style HTTP API; a live line
shows requests done, generated tokens/s, KV blocks in use and the prefix-cache hit rate
(prompt tokens served from the cache / prompt tokens, from the agent's live stream). The
server is stopped cleanly at the end so that the event log is complete.

At start it prints the server's PID (any PID of the tree, this launcher's too, is what
`doctor --pid`, `top --pid` and `attach` take), the event log, the server's output and, with
--prometheus, the metrics URL. At most --max-in-flight requests are sent and unanswered: an
arrival that finds them all busy waits, so the arrival rate falls to what this machine serves
(the live line then says "arrival rate capped at X req/s: this machine serves Y req/s") and
queue wait stays bounded. --duration is wall time, then the requests in flight are drained
("draining N", bounded). Ctrl-C cuts the requests in flight (the engine records them aborted)
and stops the server within seconds.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from kvdiag.demo.child_command import kvdiag_module
from kvdiag.collectors.agent_client import AgentConnection
from kvdiag.commands import _demo_shadow
from kvdiag.demo.server_process import ServerProcess, free_port
from kvdiag.commands.fetch_model import resolve_with_progress
from kvdiag.pool.hit_rate import counts_toward_hit_rate, engine_token_hit_rate
from kvdiag.demo.smollm import ModelFetchError
from kvdiag.paths import log_dir, runtime_dir
from kvdiag.events.schema import KVPoolInfo, KVPoolSample, RequestArrived, RequestFinished
from kvdiag.demo.traffic import Result, TrafficDriver, TrafficPlan, chat

DESCRIPTION = __doc__

DEFAULT_PAGE_SIZE = 32
DEFAULT_NUM_BLOCKS = 256
# On a CPU with SDPA the engine packs a step's prompts into one sequence with a dense mask, so a
# step's attention costs grow with the square of its tokens: keep steps small
DEFAULT_MAX_BATCH_TOKENS = 256
READY_TIMEOUT_S = 180.0
DEFAULT_MAX_IN_FLIGHT = 4
DRAIN_S = 60.0
"""Longest wait for the requests in flight once no more are sent (--duration over, Ctrl-C)."""


def add_arguments(parser) -> None:
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                        help="the serving engine (default transformers; vllm runs vLLM in its own "
                             "environment: see `kvdiag fetch-engine vllm`)")
    parser.add_argument("--requests", type=int, metavar="N", help="send N chat requests (default 24)")
    parser.add_argument("--duration", type=float, metavar="S",
                        help="send requests for S seconds of wall time instead (then drain those in flight, "
                             f"at most {DRAIN_S:g} s)")
    parser.add_argument("--rate", type=float, default=1.0, help="mean arrival rate, requests/s (Poisson)")
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT, metavar="N",
                        help=f"at most N requests sent and unanswered (default {DEFAULT_MAX_IN_FLIGHT}): arrivals "
                             "wait for a free slot, so the arrival rate is capped at what this machine serves "
                             "and queue wait stays bounded; 0: no cap (the queue grows when --rate exceeds it)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the traffic generator")
    parser.add_argument("--max-tokens", type=int, default=32, help="max generated tokens per answer")
    parser.add_argument("--long-share", type=float, default=0.3,
                        help="share of conversations that open with a long (>512 tokens) prompt")
    parser.add_argument("--model", metavar="DIR", help="a local HF causal-LM folder (default: SmolLM2, "
                        "see `kvdiag fetch-model`)")
    parser.add_argument("--log", metavar="PATH", help="event log to write (.gz for gzip; default: "
                        "<cache>/logs/demo-<time>.kvlog)")
    parser.add_argument("--port", type=int, default=0, help="HTTP port of the server (default: a free one)")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="KV block size, tokens")
    parser.add_argument("--num-blocks", type=int, default=DEFAULT_NUM_BLOCKS, help="KV blocks in the pool")
    parser.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                        help="tokens per engine step; long prompts are prefilled in chunks of this size")
    parser.add_argument("--record-tokens", action="store_true",
                        help="record prompts' token ids in the log (default: salted chunk hashes; "
                             "needed by replay --similarity)")
    parser.add_argument("--ask", metavar="TEXT", help="first ask this one question and print the answer")
    parser.add_argument("--inject-leak", type=int, default=0, metavar="N",
                        help="FAULT INJECTION for testing leak detection: the agent skips the engine's "
                             "release of every N-th finished request's KV blocks (a real leak)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the server (default 1: stable on a shared CPU; 0: torch's default)")
    parser.add_argument("--prometheus", metavar="[HOST:]PORT",
                        help="the server's agent serves kvdiag's metrics for Prometheus (127.0.0.1 "
                             "unless a host is given; docs/metrics.md); with --engine vllm, from "
                             "vLLM's engine core")
    _demo_shadow.add_arguments(parser)


def _default_log_path() -> Path:
    return log_dir() / time.strftime("demo-%Y%m%d-%H%M%S.kvlog")


class LiveStats:
    """Folds the agent's live event stream into the numbers of the live line."""

    def __init__(self) -> None:
        self.blocks_used = 0
        self.blocks_cached = 0
        self.num_blocks = 0
        self.peak_blocks_used = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.arrived = 0
        self.finished = 0
        self.connected = False
        self._conn: Optional[AgentConnection] = None
        self._idle = threading.Condition()

    @property
    def prefix_hit_rate(self) -> Optional[float]:
        """The engine's token hit rate (:mod:`kvdiag.pool.hit_rate`) over the requests seen so far."""
        return engine_token_hit_rate(self.prompt_tokens, self.cached_prompt_tokens)

    def follow(self, path: Path) -> None:
        """Read the agent's stream in a daemon thread until it closes."""
        conn = AgentConnection(path)
        self._conn = conn
        self.connected = True
        threading.Thread(target=self._read, args=(conn,), name="kvdiag-demo-live", daemon=True).start()

    def _read(self, conn: AgentConnection) -> None:
        try:
            conn.read_header()
        except OSError:  # no header (AgentProtocolError) or the connection went away
            return
        for ev in conn.events():
            if isinstance(ev, KVPoolSample):
                self.blocks_used = ev.blocks_used
                self.blocks_cached = ev.blocks_cached
                self.num_blocks = ev.num_blocks
                self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used)
            elif isinstance(ev, KVPoolInfo):
                self.num_blocks = ev.num_blocks
            elif isinstance(ev, RequestArrived):
                with self._idle:
                    self.arrived += 1
            elif isinstance(ev, RequestFinished):
                if counts_toward_hit_rate(ev.status):
                    self.prompt_tokens += ev.prompt_tokens
                    self.cached_prompt_tokens += ev.cached_prompt_tokens
                with self._idle:
                    self.finished += 1
                    self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every request the engine saw arrive has finished (aborted ones included),
        at most ``timeout_s``; whether it did."""
        with self._idle:
            return self._idle.wait_for(lambda: self.finished >= self.arrived, timeout=timeout_s)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class DemoServer(ServerProcess):
    """The child process: ``python -m kvdiag.run ... -- transformers serve MODEL ...``."""

    # SIGTERM: uvicorn's graceful shutdown, then the agent flushes the log and the wrapper exits
    # 143; SIGINT: uvicorn's forced exit; then SIGKILL
    stop_signals = ((signal.SIGTERM, 60.0), (signal.SIGINT, 10.0), (signal.SIGKILL, 10.0))

    def __init__(self, model_dir: Path, log_path: Path, port: int, page_size: int, num_blocks: int,
                 max_batch_tokens: int, inject_leak: int, threads: int, agent_args: tuple = ()) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.socket_path = runtime_dir() / f"demo-{os.getpid()}-{port}.sock"
        self.server_log = log_path.with_name(log_path.name + ".server.txt")
        self.command = [
            *kvdiag_module("kvdiag.run"), "--log", str(log_path), "--socket", str(self.socket_path),
            "--model", str(model_dir), "--page-size", str(page_size),
            *(["--inject-leak", str(inject_leak)] if inject_leak else []), *agent_args,
            "--", "transformers", "serve", str(model_dir), "--continuous-batching", "--device", "cpu",
            "--dtype", "float32", "--attn-implementation", "sdpa", "--host", "127.0.0.1",
            "--port", str(port), "--cb-block-size", str(page_size), "--cb-num-blocks", str(num_blocks),
            "--cb-max-batch-tokens", str(max_batch_tokens),
            "--log-level", "warning",
        ]
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
        if threads > 0:
            self.env["OMP_NUM_THREADS"] = self.env["MKL_NUM_THREADS"] = str(threads)
        self.proc: Optional[subprocess.Popen] = None

    def ready_extra(self) -> bool:
        return self.socket_path.exists()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        super().wait_ready(timeout_s)


def _live_line(done: int, total: Optional[int], tokens: int, elapsed_s: float, stats: LiveStats) -> str:
    rate = stats.prefix_hit_rate
    pool = f"{stats.blocks_used}/{stats.num_blocks} (+{stats.blocks_cached} cached)" if stats.num_blocks else "-"
    of = f"/{total}" if total else ""
    return (f"requests {done}{of} | {tokens / elapsed_s if elapsed_s > 0 else 0.0:5.1f} tok/s | "
            f"KV blocks {pool} | prefix hit {'-' if rate is None else f'{rate:.0%}'}")


def run(args) -> int:
    if args.requests is not None and args.requests <= 0:
        print("kvdiag demo: --requests: expected a positive number", file=sys.stderr)
        return 2
    if args.duration is not None and not args.duration > 0:
        print("kvdiag demo: --duration: expected a positive number of seconds", file=sys.stderr)
        return 2
    if args.max_in_flight < 0:
        print("kvdiag demo: --max-in-flight: expected 0 (no cap) or a positive number", file=sys.stderr)
        return 2
    if args.requests is None and args.duration is None:
        args.requests = 24
    problem = _demo_shadow.check(args) or _prometheus_problem(args)
    if problem:
        print(f"kvdiag demo: {problem}", file=sys.stderr)
        return 2
    try:
        plan = TrafficPlan(seed=args.seed, rate_per_s=args.rate, long_share=args.long_share)
    except ValueError as exc:
        print(f"kvdiag demo: {exc}", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_with_progress(args.model)
    except ModelFetchError as exc:
        print(f"kvdiag demo: {exc}", file=sys.stderr)
        return 2 if args.model else 1
    log_path = Path(args.log).expanduser().resolve() if args.log else _default_log_path()
    _resolve_prometheus_port(args)
    if args.engine == "vllm":
        return _run_vllm(args, plan, model_dir, log_path)
    server = DemoServer(model_dir, log_path, args.port or free_port(), args.page_size, args.num_blocks,
                        args.max_batch_tokens, args.inject_leak, args.threads,
                        (*_demo_shadow.agent_args(args), *_prometheus_args(args),
                         *(["--record-tokens"] if args.record_tokens else [])))
    stats = LiveStats()
    traffic = _Traffic(server.base_url, model_dir, plan, args)
    print(f"kvdiag demo: starting {model_dir.name} on transformers' continuous-batching engine "
          f"(KV pool {args.num_blocks} blocks x {args.page_size} tokens), port {server.port}", flush=True)
    server.start()
    _print_started(server, log_path, args)
    try:
        try:
            server.wait_ready()
        except RuntimeError as exc:
            print(f"kvdiag demo: {exc}", file=sys.stderr)
            return 1
        stats.follow(server.socket_path)
        if args.ask and not _ask(server, model_dir, args):
            server.stop()
            stats.close()
            return 1
        counters, elapsed = _drive(traffic, args, stats)
    except KeyboardInterrupt:
        _interrupted(traffic, server, stats)
        print(f"event log: {log_path}")
        return 130
    code = _stop_after_traffic(traffic, server, stats)
    stats.close()
    failed = _summary(traffic.driver, counters, elapsed, stats, server, code, args)
    if args.shadow_logits:
        print("shadow logits: loading the model in this process ...", flush=True)
        _demo_shadow.run_logits(model_dir, log_path, args)
    if args.shadow or args.shadow_logits:
        _demo_shadow.print_tables(log_path, args.shadow, args.shadow_logits)
    print(f"event log: {log_path}")
    return 1 if failed or not traffic.driver.results else 0


def _ask(server, model_dir: Path, args) -> bool:
    """``--ask``: one question first, its answer printed; False (said) when the server fails."""
    try:
        answer = chat(server.base_url, str(model_dir), [{"role": "user", "content": args.ask}],
                      args.max_tokens, "ask/t0")
    except (OSError, http.client.HTTPException) as exc:
        print(f"kvdiag demo: the server failed to answer ({exc}); server log {server.server_log}:\n"
              f"{server.tail()}", file=sys.stderr)
        return False
    print(f"Q: {args.ask}\nA: {answer['choices'][0]['message']['content']}", flush=True)
    return True


CANCEL_WAIT_S = 5.0
"""Longest wait, after cutting the requests in flight, for the engine to record them aborted."""
QUICK_STOP = ((signal.SIGTERM, 10.0), (signal.SIGINT, 10.0), (signal.SIGKILL, 10.0))
"""How a demo stops its server once it has cut the requests in flight (Ctrl-C, `kvdiag top`
quitting, a drain that ran out): the server cancels a request whose client left, so uvicorn's
graceful shutdown has nothing to wait for (a forced exit would answer them HTTP 500)."""


class _Traffic:
    """The demo's traffic driver and its counters (shared by the live line and the summary)."""

    def __init__(self, base_url: str, model_dir: Path, plan: TrafficPlan, args) -> None:
        self.counters = {"done": 0, "failed": 0, "cut": 0, "tokens": 0}
        self.driver = TrafficDriver(base_url, str(model_dir), plan, max_tokens=args.max_tokens,
                                    on_result=self._on_result, max_in_flight=args.max_in_flight or None)

    def _on_result(self, result: Result) -> None:
        self.counters["done"] += 1
        self.counters["tokens"] += result.completion_tokens
        if result.cut:
            self.counters["cut"] += 1
        elif not result.ok:
            self.counters["failed"] += 1


def _arrivals_line(args) -> str:
    if not args.max_in_flight:
        return (f"kvdiag demo: arrivals Poisson {args.rate:g} req/s, no cap on requests in flight "
                "(the queue grows if this machine serves fewer)")
    return (f"kvdiag demo: arrivals Poisson {args.rate:g} req/s, at most {args.max_in_flight} requests in "
            "flight: the arrival rate is capped at what this machine serves, so queue wait stays bounded "
            "(--max-in-flight 0 lifts the cap)")


def _cap_note(driver: TrafficDriver, args) -> str:
    """"arrival rate capped at X req/s: this machine serves Y req/s" once the cap delayed an
    arrival ("" before)."""
    if not driver.capped:
        return ""
    released, served = driver.rates_per_s()
    return (f"arrival rate capped at {released:.2f} req/s (asked {args.rate:g}): this machine serves "
            f"{served:.2f} req/s with {args.max_in_flight} in flight")


def _drive(traffic: _Traffic, args, stats: LiveStats):
    """Send the planned chats, printing the live line; returns (counters, seconds). With
    --duration, sending stops after that wall time and the requests in flight are drained
    (``draining N`` is printed; at most :data:`DRAIN_S`)."""
    tty = sys.stdout.isatty()
    counters, driver = traffic.counters, traffic.driver
    start = time.monotonic()
    print(_arrivals_line(args), flush=True)

    def on_drain(n: int) -> None:
        print(("\n" if tty else "") + f"kvdiag demo: draining {n} request{'s' if n != 1 else ''} in flight "
              f"(at most {DRAIN_S:g} s)", flush=True)

    worker = threading.Thread(target=driver.run, kwargs={"num_requests": args.requests, "duration_s": args.duration,
                                                         "drain_s": DRAIN_S, "on_drain": on_drain}, daemon=True)
    worker.start()
    last_print = 0.0
    while worker.is_alive():
        worker.join(timeout=0.5)
        now = time.monotonic()
        if tty or now - last_print >= 5.0 or not worker.is_alive():
            line = _live_line(counters["done"], args.requests, counters["tokens"], now - start, stats)
            note = _cap_note(driver, args)
            line += f" | {note}" if note else ""
            print(("\r" + line + "  ") if tty else line, end="" if tty else "\n", flush=True)
            last_print = now
    if tty:
        print()
    return counters, time.monotonic() - start


def _stop_after_traffic(traffic: _Traffic, server, stats: LiveStats) -> int:
    """Stop the server once the traffic is over; requests the drain gave up on are cut first."""
    if traffic.driver.abandoned:
        traffic.driver.abort()
        stats.wait_idle(CANCEL_WAIT_S)
        return server.stop(QUICK_STOP)
    return server.stop()


def _interrupted(traffic: _Traffic, server, stats: LiveStats) -> None:
    """Ctrl-C (or `kvdiag top` quitting): no more requests, then the server stops quickly
    (:data:`QUICK_STOP`); what the traffic got is said in one line."""
    c = traffic.counters
    cut = traffic.driver.abort()
    print(f"\nkvdiag demo: interrupted; no more requests, {cut} in flight cut, stopping the server",
          file=sys.stderr, flush=True)
    stats.wait_idle(CANCEL_WAIT_S)  # the engine records the cancelled requests as aborted
    server.stop(QUICK_STOP)
    stats.close()
    print(f"kvdiag demo: stopped: {c['done'] - c['failed'] - c['cut']} requests answered, {c['failed']} failed, "
          f"{cut} cut by the stop", file=sys.stderr, flush=True)


def _summary(driver, counters: dict, elapsed: float, stats: LiveStats, server, code: int, args) -> list:
    """Print what the run did; returns the failed results."""
    results = driver.results
    failed = [r for r in results if not r.ok and not r.cut]
    long_count = sum(r.is_long for r in results)
    answered = [r for r in results if r.ok]
    print(f"done: {len(answered)} requests answered ({long_count} long prompts), "
          f"{len(failed)} failed, {counters['tokens']} tokens in {elapsed:.1f} s "
          f"({counters['tokens'] / elapsed:.1f} tok/s)")
    if driver.abandoned:
        print(f"kvdiag demo: {driver.abandoned} requests still unanswered after draining {DRAIN_S:g} s: "
              "cut when the server stopped, not counted")
    note = _cap_note(driver, args)
    if note:
        print(note)
    if stats.prefix_hit_rate is not None:
        print(f"prefix cache: {stats.cached_prompt_tokens}/{stats.prompt_tokens} prompt tokens served from "
              f"cache ({stats.prefix_hit_rate:.0%}); peak KV blocks used {stats.peak_blocks_used}/{stats.num_blocks}")
    sample = next((r for r in results if r.ok and r.answer), None)
    if sample is not None:
        print(f"sample answer ({sample.request_id}): {sample.answer.strip()[:160]!r}")
    if failed:
        print(f"first failure: {failed[0].request_id}: {failed[0].error}; server log {server.server_log}:\n"
              f"{server.tail()}", file=sys.stderr)
    if code not in (0, 128 + signal.SIGTERM):
        print(f"kvdiag demo: the server exited with code {code}; see {server.server_log}", file=sys.stderr)
    return failed


def _prometheus_problem(args) -> str:
    """Why ``--prometheus`` cannot be used as given ("" when it can)."""
    if args.prometheus is None:
        return ""
    from kvdiag.prometheus.exporter import parse_address
    try:
        parse_address(args.prometheus)
    except ValueError as exc:
        return f"--prometheus: {exc}"
    return ""


def _resolve_prometheus_port(args) -> None:
    """``--prometheus [HOST:]0``: a free port chosen here, so that the URL can be printed (the
    exporter runs in the server's process)."""
    if args.prometheus is None:
        return
    from kvdiag.prometheus.exporter import parse_address
    host, port = parse_address(args.prometheus)
    if port == 0:
        args.prometheus = f"[{host}]:{free_port()}" if ":" in host else f"{host}:{free_port()}"


def prometheus_url(address: str) -> str:
    """The ``/metrics`` URL of an exporter serving on ``[HOST:]PORT``."""
    from kvdiag.prometheus.exporter import parse_address
    host, port = parse_address(address)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def _print_started(server, log_path: Path, args) -> None:
    """Where to find the run: the server's PID (what `doctor --pid`, `top --pid` and `attach`
    take, as they take this launcher's), the event log, the server's output, the metrics URL;
    the warning when the log records token ids."""
    if args.record_tokens:
        from kvdiag.agent import warn_recording_tokens
        warn_recording_tokens()
    print(f"kvdiag demo: server PID {server.proc.pid} (launcher PID {os.getpid()}: `kvdiag doctor --pid`, "
          f"`kvdiag top --pid` and `kvdiag attach` take either)", flush=True)
    print(f"kvdiag demo: event log {log_path}", flush=True)
    print(f"kvdiag demo: server output {server.server_log}", flush=True)
    if args.prometheus is not None:
        print(f"kvdiag demo: Prometheus metrics at {prometheus_url(args.prometheus)}", flush=True)


def _prometheus_args(args) -> list[str]:
    """``python -m kvdiag.run`` options of the exporter."""
    return ["--prometheus", args.prometheus] if args.prometheus is not None else []


def _run_vllm(args, plan: TrafficPlan, model_dir: Path, log_path: Path) -> int:
    """The demo on a real vLLM server (see :mod:`kvdiag.commands._demo_vllm`)."""
    from kvdiag.commands import _demo_vllm
    from kvdiag.demo.vllm_env import SETUP_HINT, vllm_python

    python = vllm_python()
    if python is None:
        print(f"kvdiag demo: {SETUP_HINT}", file=sys.stderr)
        return 1
    if args.inject_leak or args.shadow or args.shadow_logits:
        print("kvdiag demo: --inject-leak and --shadow* run on the transformers engine only", file=sys.stderr)
        return 2
    extra_env = {"KVDIAG_PROMETHEUS": args.prometheus} if args.prometheus else {}
    if args.record_tokens:
        extra_env["KVDIAG_RECORD_TOKENS"] = "1"
    server = _demo_vllm.VllmServer(python, model_dir, log_path, port=args.port, threads=args.threads,
                                   extra_env=extra_env or None)
    stats = LiveStats()
    traffic = _Traffic(server.base_url, model_dir, plan, args)
    print(f"kvdiag demo: starting {model_dir.name} on vLLM (prefix caching, KV events and kvdiag's "
          f"plugin on), port {server.port}", flush=True)
    server.start()
    _print_started(server, log_path, args)
    recording = None
    try:
        try:
            server.wait_ready()
        except RuntimeError as exc:
            print(f"kvdiag demo: {exc}", file=sys.stderr)
            server.stop()
            return 1
        recording = _demo_vllm.Recording(server, log_path, model_dir, record_tokens=args.record_tokens)
        stats.follow(server.socket_path)
        if args.ask and not _ask(server, model_dir, args):
            raise RuntimeError("--ask failed")
        counters, elapsed = _drive(traffic, args, stats)
    except (KeyboardInterrupt, RuntimeError) as exc:
        if recording is not None:
            recording.finish_before_stop()
        if isinstance(exc, KeyboardInterrupt):
            _interrupted(traffic, server, stats)
        else:
            server.stop()
            stats.close()
        if recording is not None:
            recording.close()
        print(f"event log: {log_path}")
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    recording.finish_before_stop()
    code = _stop_after_traffic(traffic, server, stats)
    stats.close()
    recording.close()
    failed = _summary(traffic.driver, counters, elapsed, stats, server, code, args)
    print(f"KV events: {recording.events.batches} batches, {recording.events.dropped_batches} lost "
          f"(raw stream {recording.raw_events_path})")
    print(f"event log: {log_path}")
    return 1 if failed or not traffic.driver.results else 0
