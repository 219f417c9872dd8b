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

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from kvdiag.demo.child_command import kvdiag_module
from kvdiag.commands import _demo_prometheus, _demo_shadow
from kvdiag.commands._demo_vllm import CPU_BLOCK_SIZE_TOKENS
from kvdiag.commands._demo_live import LiveStats
from kvdiag.commands._demo_session import (DRAIN_S, Traffic, ask, drive, interrupted, print_started,
                                           stop_after_traffic, summary)
from kvdiag.demo.server_process import ServerProcess, free_port
from kvdiag.commands.fetch_model import resolve_with_progress
from kvdiag.demo.smollm import ModelFetchError
from kvdiag.paths import log_dir, runtime_dir
from kvdiag.demo.traffic import TrafficPlan

DESCRIPTION = __doc__

DEFAULT_PAGE_SIZE = 32
DEFAULT_NUM_BLOCKS = 256
# On a CPU with SDPA the engine packs a step's prompts into one sequence with a dense mask, so a
# step's attention costs grow with the square of its tokens: keep steps small
DEFAULT_MAX_BATCH_TOKENS = 256
READY_TIMEOUT_S = 180.0
DEFAULT_MAX_IN_FLIGHT = 4


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
    parser.add_argument("--page-size", type=int, default=None,
                        help=f"KV block size, tokens (default {DEFAULT_PAGE_SIZE}; with --engine vllm, "
                             f"vLLM's own: {CPU_BLOCK_SIZE_TOKENS} on CPU)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help=f"KV blocks in the pool (default {DEFAULT_NUM_BLOCKS}; with --engine vllm, "
                             f"what vLLM's KV cache space holds)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help=f"tokens per engine step; long prompts are prefilled in chunks of this size "
                             f"(default {DEFAULT_MAX_BATCH_TOKENS}; with --engine vllm, vLLM's own)")
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


def run(args) -> int:
    """Check the options, fetch the model if needed, then run the demo on the chosen engine."""
    code = _check_counts(args)
    if code is not None:
        return code
    problem = _demo_shadow.check(args) or _demo_prometheus.problem(args)
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
    _demo_prometheus.resolve_port(args)
    if args.engine == "vllm":
        from kvdiag.commands import _demo_vllm
        return _demo_vllm.run(args, plan, model_dir, log_path)
    return _run_transformers(args, plan, model_dir, log_path)


def _check_counts(args) -> Optional[int]:
    """--requests, --duration and --max-in-flight checked (exit 2, said, when one is out of
    range; None when all are fine); neither of the first two given: 24 requests."""
    if args.requests is not None and args.requests <= 0:
        print("kvdiag demo: --requests: expected a positive number", file=sys.stderr)
        return 2
    if args.duration is not None and not args.duration > 0:
        print("kvdiag demo: --duration: expected a positive number of seconds", file=sys.stderr)
        return 2
    if args.max_in_flight < 0:
        print("kvdiag demo: --max-in-flight: expected 0 (no cap) or a positive number", file=sys.stderr)
        return 2
    for name in ("page_size", "num_blocks", "max_batch_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            print(f"kvdiag demo: --{name.replace('_', '-')}: expected a positive number", file=sys.stderr)
            return 2
    if args.requests is None and args.duration is None:
        args.requests = 24
    return None


def _run_transformers(args, plan: TrafficPlan, model_dir: Path, log_path: Path) -> int:
    """The demo on transformers' continuous-batching engine, then the --shadow* tables."""
    args.page_size = args.page_size or DEFAULT_PAGE_SIZE
    args.num_blocks = args.num_blocks or DEFAULT_NUM_BLOCKS
    args.max_batch_tokens = args.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
    server = DemoServer(model_dir, log_path, args.port or free_port(), args.page_size, args.num_blocks,
                        args.max_batch_tokens, args.inject_leak, args.threads,
                        (*_demo_shadow.agent_args(args), *_demo_prometheus.agent_args(args),
                         *(["--record-tokens"] if args.record_tokens else [])))
    stats = LiveStats()
    traffic = Traffic(server.base_url, model_dir, plan, args)
    print(f"kvdiag demo: starting {model_dir.name} on transformers' continuous-batching engine "
          f"(KV pool {args.num_blocks} blocks x {args.page_size} tokens), port {server.port}", flush=True)
    server.start()
    print_started(server, log_path, args)
    try:
        try:
            server.wait_ready()
        except RuntimeError as exc:
            print(f"kvdiag demo: {exc}", file=sys.stderr)
            return 1
        stats.follow(server.socket_path)
        if args.ask and not ask(server, model_dir, args):
            server.stop()
            stats.close()
            return 1
        counters, elapsed = drive(traffic, args, stats)
    except KeyboardInterrupt:
        interrupted(traffic, server, stats)
        print(f"event log: {log_path}")
        return 130
    code = stop_after_traffic(traffic, server, stats)
    stats.close()
    failed = summary(traffic.driver, counters, elapsed, stats, server, code, args)
    if args.shadow_logits:
        print("shadow logits: loading the model in this process ...", flush=True)
        _demo_shadow.run_logits(model_dir, log_path, args)
    if args.shadow or args.shadow_logits:
        _demo_shadow.print_tables(log_path, args.shadow, args.shadow_logits)
    print(f"event log: {log_path}")
    return 1 if failed or not traffic.driver.results else 0
