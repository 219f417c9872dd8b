"""The in-process agent: observes the engine running in this process and records what it sees.

``start()`` installs the engine's adapter (transformers' continuous batching by default; the
vLLM plugin passes its own), samples this process's host
memory every sample interval (``ProcessSample``: RSS, PSS and swap, through the procfs
collector), writes the events to an event log (``LogWriter``) and serves them live to local
clients over a Unix socket.

Live stream protocol: a client connects to the socket (mode 0600, in the runtime dir, path
``kvdiag.paths.agent_socket_path(pid)`` unless given) and reads JSON lines: first the
``LogHeader``, then the events that describe the setup whenever they happened (the latest
``KVPoolInfo`` and every ``CollectorStatus``: a client that joins after the engine built its
pool still learns its shape), then every event as it happens (the same JSON as a log line). A client that
reads too slowly loses events (counted; the agent never blocks the engine). There is no TCP
listener.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import deque
from pathlib import Path
from typing import Callable, Optional, Protocol

import msgspec

from kvdiag.paths import agent_socket_path
from kvdiag.schema import CollectorStatus, Event, KVPoolInfo, LogHeader
from kvdiag.sinks import FanoutSink, Sink

ENGINE = "transformers-cb"


class Adapter(Protocol):
    """What the agent needs of an engine adapter: hooks that record block and request events
    into the sink they were installed with, a pool sample on demand, and removal."""

    def sample_now(self) -> None: ...

    def uninstall(self) -> None: ...


class LiveSocketSink:
    """A Sink that streams events as JSON lines to every client of a Unix socket."""

    def __init__(self, path: Path, header: LogHeader, max_pending: int = 50_000) -> None:
        self.path = Path(path)
        self.dropped_events = 0
        self._encoder = msgspec.json.Encoder()
        self._header_line = self._encoder.encode(header) + b"\n"
        self._pending: deque[Event] = deque()
        self._setup_lines: dict[str, bytes] = {}  # what a late client is told first (see module doc)
        self._max_pending = max_pending
        self._clients: list[socket.socket] = []
        self._clients_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self._server.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._server.listen(8)
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvdiag-agent-accept",
                                               daemon=True)
        self._send_thread = threading.Thread(target=self._send_loop, name="kvdiag-agent-send", daemon=True)
        self._accept_thread.start()
        self._send_thread.start()

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    def record(self, event: Event) -> None:
        if isinstance(event, (KVPoolInfo, CollectorStatus)):
            key = "pool" if isinstance(event, KVPoolInfo) else f"status:{event.collector}"
            if key in self._setup_lines or len(self._setup_lines) < 256:
                self._setup_lines[key] = self._encoder.encode(event) + b"\n"
        if not self._clients:  # nobody listening: nothing to do on the hot path
            return
        if len(self._pending) >= self._max_pending:
            self.dropped_events += 1
            return
        self._pending.append(event)
        self._wake.set()

    def flush(self) -> None:
        self._wake.set()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            try:
                conn.sendall(self._header_line + b"".join(list(self._setup_lines.values())))
            except OSError:
                conn.close()
                continue
            with self._clients_lock:
                self._clients.append(conn)

    def _send_loop(self) -> None:
        while not self._closed or self._pending:
            self._wake.wait(timeout=0.2)
            self._wake.clear()
            if not self._pending:
                continue
            lines = []
            while self._pending:
                lines.append(self._encoder.encode(self._pending.popleft()))
            payload = b"\n".join(lines) + b"\n"
            with self._clients_lock:
                clients = list(self._clients)
            for conn in clients:
                try:
                    conn.sendall(payload)
                except OSError:
                    with self._clients_lock:
                        if conn in self._clients:
                            self._clients.remove(conn)
                    conn.close()

    def close(self) -> None:
        """Send what is pending, close every client and remove the socket file."""
        self._closed = True
        self._wake.set()
        self._send_thread.join(timeout=2)
        try:
            self._server.close()
        except OSError:
            pass
        with self._clients_lock:
            for conn in self._clients:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()
            self._clients.clear()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def bytes_per_token_of(model_dir: Optional[str]) -> Optional[int]:
    """KV bytes of one token over all layers, K and V, from a HF folder's config.json (fp32 assumed
    unless the config says otherwise)."""
    if not model_dir:
        return None
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    cfg = msgspec.json.decode(config_path.read_bytes())
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError):
        return None
    return 2 * layers * kv_heads * head_dim * 4


# What-if prefix caches recorded beside the engine: LRU, unbounded, at the block sizes engines
# use (vLLM 16, the article's 64-token chunks, LMCache 256). The engine's own settings (LRU,
# its page size and pool size) are added when its pool appears.
WHAT_IF_BLOCK_SIZES_TOKENS = (16, 64, 256)


class Agent:
    """One recording session: adapter + log writer + live socket. Use ``start()``/``stop()``."""

    def __init__(self, log_path: Optional[str] = None, socket_path: Optional[str] = None,
                 live: bool = True, model: str = "", block_size_tokens: Optional[int] = None,
                 inject_leak_every: int = 0, sample_interval_s: float = 0.5,
                 record_token_ids: bool = True, extra: Optional[dict] = None,
                 shadow_sharing: bool = True, shadow: Optional[dict] = None,
                 host_memory: bool = True, engine: str = ENGINE,
                 adapter: Optional[Callable[..., Adapter]] = None) -> None:
        self.log_path = Path(log_path) if log_path else None
        self.socket_path = Path(socket_path) if socket_path else (agent_socket_path() if live else None)
        from kvdiag.eventlog import make_header

        self.header = make_header(engine=engine, model=str(model), block_size_tokens=block_size_tokens,
                                  bytes_per_token=bytes_per_token_of(model), extra=dict(extra or {}))
        self._inject_leak_every = inject_leak_every
        self._sample_interval_s = sample_interval_s
        self._record_token_ids = record_token_ids
        self._shadow_sharing = shadow_sharing and record_token_ids  # it re-chunks token ids
        self.writer = None
        self.live: Optional[LiveSocketSink] = None
        self.shadow_sharing = None
        self.adapter = None
        self._install_adapter = adapter  # None: transformers' continuous batching
        self._shadow_kwargs = shadow  # kvdiag.collectors.transformers_cb_shadow.install kwargs
        self.shadow = None
        self._host_memory = host_memory
        self.host_sampler = None  # kvdiag.collectors.procfs.ProcessSampler of this process

    def start(self) -> "Agent":
        install = self._install_adapter
        if install is None:
            from kvdiag.collectors.transformers_cb import install
        sinks: list[Sink] = []
        if self.log_path is not None:
            from kvdiag.eventlog import LogWriter
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.writer = LogWriter(str(self.log_path), self.header)
            sinks.append(self.writer)
        if self.socket_path is not None:
            self.socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.live = LiveSocketSink(self.socket_path, self.header)
            sinks.append(self.live)
        recorded: Sink = FanoutSink(sinks)
        adapter_sink = recorded
        if self._shadow_sharing:
            # what-if prefix caches fed by the same events; their results are recorded too
            from kvdiag.analysis.live_sharing import ShadowConfig, ShadowSharingSink

            what_ifs = [ShadowConfig("lru", size) for size in WHAT_IF_BLOCK_SIZES_TOKENS]
            self.shadow_sharing = ShadowSharingSink(what_ifs, out=recorded)
            adapter_sink = FanoutSink([recorded, self.shadow_sharing])
        self.adapter = install(adapter_sink, sample_interval_s=self._sample_interval_s,
                               inject_leak_every=self._inject_leak_every,
                               record_token_ids=self._record_token_ids)
        if self._shadow_kwargs is not None:
            from kvdiag.collectors.transformers_cb_shadow import install as install_shadow
            self.shadow = install_shadow(recorded, **self._shadow_kwargs)
        if self._host_memory:
            from kvdiag.collectors.procfs import ProcessSampler
            self.host_sampler = ProcessSampler.of_self(recorded, interval_s=self._sample_interval_s).start()
        return self

    def stop(self) -> None:
        """Take a last pool and host memory sample, uninstall the hooks, flush and close the log
        and the socket."""
        if self.host_sampler is not None:
            self.host_sampler.stop()
            self.host_sampler = None
        if self.shadow is not None:
            self.shadow.uninstall()
        if self.adapter is not None:
            try:
                self.adapter.sample_now()
            finally:
                self.adapter.uninstall()
        if self.shadow_sharing is not None:
            self.shadow_sharing.flush()  # the final what-if numbers, over all requests
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.live is not None:
            self.live.close()
            self.live = None


_AGENT: Optional[Agent] = None


def start(log_path: Optional[str] = None, socket: bool = True, socket_path: Optional[str] = None,
          **kwargs) -> Agent:
    """Start the agent in this process (call before the engine creates its cache).

    ``log_path``: event log to write (``.gz`` for gzip; None = no log); ``socket``: serve live
    events on a Unix socket (``socket_path`` or the default per-pid path). Other keyword
    arguments go to :class:`Agent` (``model``, ``block_size_tokens``, ``inject_leak_every``,
    ``sample_interval_s``, ``record_token_ids``, ``extra``, ``engine`` and ``adapter`` (the
    header's engine name and a callable ``adapter(sink, sample_interval_s=...,
    inject_leak_every=..., record_token_ids=...)`` that installs the engine's hooks; default:
    transformers' continuous batching), ``shadow``: keyword arguments of
    :func:`kvdiag.collectors.transformers_cb_shadow.install` to run shadow compression,
    ``host_memory``: sample this process's RSS, PSS and swap every ``sample_interval_s``)."""
    global _AGENT
    if _AGENT is not None:
        raise RuntimeError("the kvdiag agent is already running in this process")
    _AGENT = Agent(log_path=log_path, socket_path=socket_path, live=socket, **kwargs).start()
    return _AGENT


def stop() -> None:
    """Stop the agent started with :func:`start` (no-op if none)."""
    global _AGENT
    if _AGENT is not None:
        agent, _AGENT = _AGENT, None
        agent.stop()


def current() -> Optional[Agent]:
    """The running agent of this process, if any."""
    return _AGENT
