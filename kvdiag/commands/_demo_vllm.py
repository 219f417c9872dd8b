"""`kvdiag demo --engine vllm`: the same model and traffic on a real vLLM server.

vLLM runs in its own environment (:mod:`kvdiag.demo.vllm_env`) as
``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1, fp32 on the CPU, with prefix
caching on, KV events published over ZMQ and kvdiag's plugin loaded (``KVDIAG_AGENT=1``). This
process records one kvdiag log from three sources: the plugin's live stream (block and request
events from the engine core, and the shadow caches fed by them), vLLM's ``/metrics`` (scraped
every second) and its KV-event stream (also kept raw beside the log for ``kvdiag replay``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

from kvdiag.commands import _demo_shadow
from kvdiag.commands._demo_live import LiveStats
from kvdiag.commands._demo_session import Traffic, ask, drive, interrupted, print_started, stop_after_traffic, summary
from kvdiag.demo.server_process import ServerProcess, free_port
from kvdiag.demo.traffic import TrafficPlan
from kvdiag.paths import runtime_dir

READY_TIMEOUT_S = 420.0  # a first start compiles the model (~2 min on 2 cores)
KV_CACHE_GIB = 1



CPU_BLOCK_SIZE_TOKENS = 128
"""vLLM's KV block size on the CPU backend, where none is given."""


class VllmServer(ServerProcess):
    """vLLM's OpenAI server as a child process, with kvdiag's plugin and KV events on. It runs
    in the log's folder: a kvdiag source checkout as the current folder would shadow the
    kvdiag installed in vLLM's environment (python puts the folder first on sys.path)."""

    ready_path = "/health"
    # SIGTERM: vLLM shuts its engine core down (within --shutdown-timeout), whose agent flushes
    stop_signals = ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0))

    def __init__(self, python: Path, model_dir: Path, log_path: Path, port: int = 0, events_port: int = 0,
                 threads: int = 1, prefix_caching: bool = True, plugin: bool = True,
                 extra_env: Optional[dict] = None, block_size_tokens: Optional[int] = None,
                 num_blocks: Optional[int] = None, max_batch_tokens: Optional[int] = None,
                 max_model_len_tokens: int = 2048, eager: bool = False) -> None:
        """``block_size_tokens``, ``num_blocks``: the KV pool's (None: vLLM's own choice;
        ``num_blocks`` usable blocks, vLLM's null block added); ``max_batch_tokens``: tokens per
        engine step (vLLM's ``--max-num-batched-tokens``; None: vLLM's own);
        ``max_model_len_tokens``: the longest request (at most the pool's tokens); ``eager``:
        vLLM's ``--enforce-eager`` (no torch.compile warm-up: ~25 s less a start on 2 cores)."""
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.events_endpoint = f"tcp://127.0.0.1:{events_port or free_port()}"
        self.plugin = plugin
        self.socket_path = runtime_dir() / f"demo-{os.getpid()}-{self.port}.sock"
        self.server_log = log_path.with_name(log_path.name + ".server.txt")
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events_endpoint,
                  "topic": "kv"}
        self.command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                        "--dtype", "float32", "--max-model-len", str(max_model_len_tokens), "--host", "127.0.0.1",
                        "--port", str(self.port),
                        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
                        "--kv-events-config", json.dumps(events),
                        # let the engine core leave through vLLM's own shutdown (the default, 0,
                        # kills it at once), so that kvdiag's plugin flushes its last events
                        "--shutdown-timeout", "10"]
        if eager:
            self.command.append("--enforce-eager")
        if block_size_tokens is not None:
            self.command += ["--block-size", str(block_size_tokens)]
        if max_batch_tokens is not None:
            self.command += ["--max-num-batched-tokens", str(max_batch_tokens)]
        if num_blocks is not None:  # vLLM keeps block 0 as its null block, never allocated
            self.command += ["--num-gpu-blocks-override", str(num_blocks + 1)]
            # vLLM refuses to start unless one request of the longest length fits the pool
            tokens = num_blocks * (block_size_tokens or CPU_BLOCK_SIZE_TOKENS)
            at = self.command.index("--max-model-len") + 1
            self.command[at] = str(min(int(self.command[at]), tokens))
        cpus = threads if threads > 0 else (os.cpu_count() or 1)
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                        VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_CPU_OMP_THREADS_BIND=f"0-{cpus - 1}")
        # vLLM 0.32's AOT-compiled artifact does not load under torch 2.13 ("'function' object
        # has no attribute 'finalize_loading'"), so every start compiled the model again (~65 s
        # here); its classic compile cache loads (start 50 s instead of 118 s). The user's
        # own setting wins.
        self.env.setdefault("VLLM_USE_AOT_COMPILE", "0")
        if plugin:
            self.env.update(KVDIAG_AGENT="1", KVDIAG_SOCKET=str(self.socket_path))
        else:
            self.env.pop("KVDIAG_AGENT", None)
        self.env.update(extra_env or {})
        self.cwd = self.server_log.parent
        self.proc = None
        self.rpc_dir: Optional[Path] = None  # vLLM's IPC sockets while it runs (see start())

    def start(self, preexec_fn=None) -> None:
        """Starts vLLM with its ZMQ IPC sockets in a private folder that :meth:`stop` removes:
        vLLM names them by UUID in the temp folder and leaves them there when it is killed
        (the user's VLLM_RPC_BASE_PATH wins)."""
        if "VLLM_RPC_BASE_PATH" not in self.env:
            self.rpc_dir = Path(tempfile.mkdtemp(prefix="kvdiag-vllm-rpc-"))
            self.env["VLLM_RPC_BASE_PATH"] = str(self.rpc_dir)
        super().start(preexec_fn)

    def stop(self, signals: Optional[tuple] = None) -> int:
        try:
            return super().stop(signals)
        finally:
            if self.rpc_dir is not None:
                shutil.rmtree(self.rpc_dir, ignore_errors=True)
                self.env.pop("VLLM_RPC_BASE_PATH", None)
                self.rpc_dir = None

    def ready_extra(self) -> bool:
        return not self.plugin or self.socket_path.exists()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        super().wait_ready(timeout_s)


class MetricsPoller:
    """Scrapes ``/metrics`` every ``interval_s`` into ``sink`` as ``EngineMetrics`` (errors as
    ``CollectorError``) from a daemon thread; :meth:`scrape` takes one more on demand."""

    def __init__(self, url: str, sink, interval_s: float = 1.0) -> None:
        self.url, self.sink, self.interval_s = url, sink, interval_s
        self.scrapes = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdiag-vllm-metrics", daemon=True)

    def start(self) -> "MetricsPoller":
        self._thread.start()
        return self

    def scrape(self) -> None:
        from kvdiag.collectors.metrics import scrape_into

        if scrape_into(self.url, self.sink):
            self.scrapes += 1
        else:
            self.errors += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.scrape()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Recording:
    """The one log of a vLLM demo: the plugin's stream, ``/metrics`` and the KV events."""

    def __init__(self, server: VllmServer, log_path: Path, model_dir: Path,
                 record_tokens: bool = False) -> None:
        from kvdiag.collectors.agent_client import AgentStream
        from kvdiag.collectors.vllm import subscriber_side
        from kvdiag.collectors.vllm_kv_events import KVEventSubscriber
        from kvdiag.events.eventlog import make_header
        from kvdiag.events.log_writer import LogWriter

        self.agent = AgentStream(server.socket_path, sink=None) if server.plugin else None
        ah = self.agent.header if self.agent else None
        from kvdiag.agent import content_header
        # what the plugin records of prompts (hashes and its salt, or ids); without it, ours
        content = (dict(content=ah.content, content_salt=ah.content_salt,
                        content_chunk_tokens=ah.content_chunk_tokens)
                   if ah is not None and ah.content else content_header(record_tokens))
        header = make_header(engine="vllm", model=str(model_dir), **content,
                             block_size_tokens=ah.block_size_tokens if ah else None,
                             bytes_per_token=ah.bytes_per_token if ah else None,
                             extra={**(ah.extra if ah else {}), "base_url": server.base_url,
                                    "kv_events_endpoint": server.events_endpoint,
                                    "server_pid": server.proc.pid})
        self.writer = LogWriter(log_path, header, interval_s=0.5)
        self.raw_events_path = log_path.with_name(log_path.name + ".kvevents.jsonl")
        if self.agent is not None:
            self.agent.sink = self.writer
            self.agent.start()
        self.metrics = MetricsPoller(f"{server.base_url}/metrics", self.writer).start()
        mode, address = subscriber_side(server.events_endpoint)
        events_sink = self.writer
        if header.content == "hashes":  # the engine's own KV events carry token ids: drop them
            from kvdiag.pool.hashing import ContentHasher, HashingSink
            events_sink = HashingSink(self.writer, ContentHasher(header.content_salt))
        self.events = KVEventSubscriber(address, events_sink, topic="kv", bind=(mode == "bind"),
                                        raw_path=self.raw_events_path).start()

    def finish_before_stop(self) -> None:
        """The last metrics scrape and KV events, while the server still runs."""
        self.metrics.stop()
        self.metrics.scrape()
        self.events.stop()

    def close(self) -> None:
        """After the server stopped: drain the plugin's last events, close the log."""
        if self.agent is not None:
            self.agent.close(drain_s=2.0)
        self.writer.close()


def run(args, plan: TrafficPlan, model_dir: Path, log_path: Path) -> int:
    """`kvdiag demo --engine vllm`: the demo on a real vLLM server, recorded by :class:`Recording`."""
    server = _server(args, model_dir, log_path)
    if isinstance(server, int):
        return server
    stats = LiveStats()
    traffic = Traffic(server.base_url, model_dir, plan, args)
    print(f"kvdiag demo: starting {model_dir.name} on vLLM (prefix caching, KV events and kvdiag's "
          f"plugin on), port {server.port}", flush=True)
    server.start()
    print_started(server, log_path, args)
    recording = None
    try:
        try:
            server.wait_ready()
        except RuntimeError as exc:
            print(f"kvdiag demo: {exc}", file=sys.stderr)
            server.stop()
            return 1
        recording = Recording(server, log_path, model_dir, record_tokens=args.record_tokens)
        stats.follow(server.socket_path)
        if args.ask and not ask(server, model_dir, args):
            raise RuntimeError("--ask failed")
        counters, elapsed = drive(traffic, args, stats)
    except (KeyboardInterrupt, RuntimeError) as exc:
        return _cut_short(exc, traffic, server, stats, recording, log_path)
    recording.finish_before_stop()
    code = stop_after_traffic(traffic, server, stats)
    stats.close()
    recording.close()
    failed = summary(traffic.driver, counters, elapsed, stats, server, code, args)
    print(f"KV events: {recording.events.batches} batches, {recording.events.dropped_batches} lost "
          f"(raw stream {recording.raw_events_path})")
    print(f"event log: {log_path}")
    if args.shadow:
        _demo_shadow.print_tables(log_path, shadow=True, logits=False)
    return 1 if failed or not traffic.driver.results else 0


def _server(args, model_dir: Path, log_path: Path):
    """The :class:`VllmServer` the options ask for, or the exit code (said) when vLLM's environment
    is missing (1) or an option runs on the transformers engine only (2)."""
    from kvdiag.demo.vllm_env import SETUP_HINT, vllm_python

    python = vllm_python()
    if python is None:
        print(f"kvdiag demo: {SETUP_HINT}", file=sys.stderr)
        return 1
    if args.inject_leak or args.shadow_logits:
        print("kvdiag demo: --inject-leak and --shadow-logits run on the transformers engine only "
              "(--shadow runs in vLLM's worker)", file=sys.stderr)
        return 2
    extra_env = {"KVDIAG_PROMETHEUS": args.prometheus} if args.prometheus else {}
    extra_env.update(_demo_shadow.vllm_env(args))
    if args.record_tokens:
        extra_env["KVDIAG_RECORD_TOKENS"] = "1"
    return VllmServer(python, model_dir, log_path, port=args.port, threads=args.threads,
                      extra_env=extra_env or None, block_size_tokens=args.page_size,
                      num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens)


def _cut_short(exc: BaseException, traffic: Traffic, server: VllmServer, stats: LiveStats,
               recording: Optional[Recording], log_path: Path) -> int:
    """Ctrl-C (exit 130) or a failed --ask (exit 1): the recording finished, the server stopped
    (quickly after Ctrl-C), the log closed."""
    if recording is not None:
        recording.finish_before_stop()
    if isinstance(exc, KeyboardInterrupt):
        interrupted(traffic, server, stats)
    else:
        server.stop()
        stats.close()
    if recording is not None:
        recording.close()
    print(f"event log: {log_path}")
    return 130 if isinstance(exc, KeyboardInterrupt) else 1
