"""The agent package: the in-process agent (this module: ``start``/``stop``), its live socket,
and what starts it inside servers (``transformers serve``'s engine process, vLLM's plugin entry
point). May import every layer below it (prometheus, live, collectors, diagnosis and down);
outside it, only the commands and ``kvdiag.run`` import it.

The in-process agent: observes the engine running in this process and records what it sees.

``start()`` installs the engine's adapter (transformers' continuous batching by default; the
vLLM plugin passes its own), samples this process's host
memory every sample interval (``ProcessSample``: RSS, PSS and swap, through the procfs
collector), writes the events to an event log (``LogWriter``) and serves them live to local
clients over a Unix socket.

Live stream protocol: a client connects to the socket (mode 0600, in the runtime dir, path
``kvdiag.paths.agent_socket_path(pid)`` unless given) and reads JSON lines: first the
``LogHeader``, then the events that describe the setup whenever they happened (the latest
``KVPoolInfo`` and every ``CollectorStatus``: a client that joins after the engine built its
pool still learns its shape; the latest ``ShadowSharing`` of each configuration: the baseline
from which a late client compares shadow and engine over the same requests), then every event as it happens (the same JSON as a log line). A client that
reads too slowly loses its own events (counted and told; the agent never blocks the engine);
limits in :mod:`kvdiag.agent.live_socket`. There is no TCP listener unless ``prometheus`` is given
(an HTTP /metrics endpoint, :mod:`kvdiag.prometheus.exporter`, on 127.0.0.1 unless a host is given). When the runtime dir may not
be trusted (:func:`kvdiag.paths.check_private_dir`) or the socket cannot be made, the agent
logs one warning and records without it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Protocol

import msgspec

from kvdiag.agent.live_socket import LiveSocketSink
from kvdiag.pool.kv_bytes import kv_bytes_per_token
from kvdiag.events.sinks import FanoutSink, Sink

__all__ = ["Agent", "LiveSocketSink", "current", "start", "stop"]

ENGINE = "transformers-cb"


class Adapter(Protocol):
    """What the agent needs of an engine adapter: hooks that record block and request events
    into the sink they were installed with, a pool sample on demand, and removal."""

    def sample_now(self) -> None: ...

    def uninstall(self) -> None: ...


class KVShape(NamedTuple):
    """The KV cache's shape per token, from a model's config."""

    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int

    @property
    def fp32_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, K and V, in fp32 (as the model runs on the CPU)."""
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, "fp32")


def _config_path(model: str) -> Optional[Path]:
    """A model's config.json: in its folder, or for a hub id the copy in the local Hugging Face
    cache (never fetched: the engine does that); None when there is neither."""
    path = Path(model) / "config.json"
    if path.is_file():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
    except Exception:  # not a hub id, or no huggingface_hub
        return None
    return Path(cached) if isinstance(cached, str) and Path(cached).is_file() else None


def kv_shape_of(model: Optional[str]) -> Optional[KVShape]:
    """The KV shape from a model's config.json (a folder, or a hub id already in the local Hugging
    Face cache); None when there is none, or it lacks a field."""
    config_path = _config_path(model) if model else None
    if config_path is None:
        return None
    try:
        cfg = msgspec.json.decode(config_path.read_bytes())
        heads = int(cfg["num_attention_heads"])
        return KVShape(int(cfg["num_hidden_layers"]), heads, int(cfg.get("num_key_value_heads") or heads),
                       int(cfg.get("head_dim") or cfg["hidden_size"] // heads))
    except (KeyError, TypeError, ValueError, ZeroDivisionError, msgspec.DecodeError):
        return None


# What-if prefix caches recorded beside the engine: LRU, unbounded, at the block sizes engines
# use (vLLM 16, the article's 64-token chunks, LMCache 256). The engine's own settings (LRU,
# its page size and pool size) are added when its pool appears.
WHAT_IF_BLOCK_SIZES_TOKENS = (16, 64, 256)


RECORD_TOKENS_ENV = "KVDIAG_RECORD_TOKENS"
RECORD_TOKENS_WARNING = ("kvdiag: recording prompts' token ids (--record-tokens): the log holds "
                         "your users' prompts; `kvdiag export LOG --strip-tokens -o OUT` hashes them")


def record_tokens_from_env() -> bool:
    """``KVDIAG_RECORD_TOKENS=1`` (or true/yes): record token ids instead of hashes."""
    return os.environ.get(RECORD_TOKENS_ENV, "").strip().lower() in ("1", "true", "yes")


def warn_recording_tokens() -> None:
    """The one-line warning printed (stderr) when a recording keeps token ids."""
    print(RECORD_TOKENS_WARNING, file=sys.stderr, flush=True)


def content_header(record_token_ids: bool) -> dict:
    """The header fields that say what a new log holds of prompts (a fresh salt when hashes)."""
    from kvdiag.pool.hashing import CONTENT_CHUNK_TOKENS, new_salt

    if record_token_ids:
        return dict(content="token_ids")
    return dict(content="hashes", content_salt=new_salt(), content_chunk_tokens=CONTENT_CHUNK_TOKENS)


class Agent:
    """One recording session: adapter + log writer + live socket. Use ``start()``/``stop()``."""

    def __init__(self, log_path: Optional[str] = None, socket_path: Optional[str] = None,
                 live: bool = True, model: str = "", block_size_tokens: Optional[int] = None,
                 inject_leak_every: int = 0, sample_interval_s: float = 0.5,
                 record_token_ids: Optional[bool] = None, extra: Optional[dict] = None,
                 shadow_sharing: bool = True, shadow: Optional[dict] = None,
                 host_memory: bool = True, engine: str = ENGINE,
                 adapter: Optional[Callable[..., Adapter]] = None,
                 prometheus: Optional[str | int] = None, hardware: bool = True) -> None:
        self.log_path = Path(log_path) if log_path else None
        self.socket_path = Path(socket_path) if socket_path else None
        self._live = live
        from kvdiag.events.eventlog import make_header

        self.kv_shape = kv_shape_of(model)  # None when the model's config cannot be read
        if record_token_ids is None:
            record_token_ids = record_tokens_from_env()
        if record_token_ids:
            warn_recording_tokens()
        self.header = make_header(engine=engine, model=str(model), block_size_tokens=block_size_tokens,
                                  bytes_per_token=None if self.kv_shape is None else self.kv_shape.fp32_bytes_per_token,
                                  extra=dict(extra or {}), **content_header(record_token_ids))
        self._inject_leak_every = inject_leak_every
        self._sample_interval_s = sample_interval_s
        self._record_token_ids = record_token_ids
        self._shadow_sharing = shadow_sharing
        self.writer = None
        self.live: Optional[LiveSocketSink] = None
        self.shadow_sharing = None
        self.adapter = None
        self._install_adapter = adapter  # None: transformers' continuous batching
        self._shadow_kwargs = shadow  # kvdiag.shadow.transformers_cb.install kwargs
        self.shadow = None
        self._host_memory = host_memory
        self.host_sampler = None  # kvdiag.collectors.procfs.ProcessSampler of this process
        self._prometheus = prometheus  # [HOST:]PORT of the Prometheus endpoint (None: none)
        self.exporter = None  # kvdiag.prometheus.exporter.Exporter
        self._hardware = hardware  # the bandwidth probe and host energy (RAPL) readings
        self.hardware = None  # kvdiag.collectors.hardware.HardwareRecorder

    def start(self) -> "Agent":
        install = self._install_adapter
        if install is None:
            from kvdiag.collectors.transformers_cb import install
        sinks: list[Sink] = []
        if self.log_path is not None:
            from kvdiag.events.log_writer import LogWriter
            self.writer = LogWriter(str(self.log_path), self.header)
            sinks.append(self.writer)
        if self._live or self.socket_path is not None:
            self.live = self._open_socket()
            if self.live is not None:
                sinks.append(self.live)
        if self._prometheus is not None:
            from kvdiag.prometheus.exporter import serve
            self.exporter = serve(self._prometheus, self.header)
            sinks.append(self.exporter.sink)
        recorded: Sink = FanoutSink(sinks)
        adapter_sink = recorded
        if self._shadow_sharing:
            # what-if prefix caches fed by the same events; their results are recorded too
            from kvdiag.simulation.live_sharing import ShadowConfig, ShadowSharingSink

            what_ifs = [ShadowConfig("lru", size) for size in WHAT_IF_BLOCK_SIZES_TOKENS]
            self.shadow_sharing = ShadowSharingSink(what_ifs, out=recorded)
            adapter_sink = FanoutSink([recorded, self.shadow_sharing])
        self.adapter = install(adapter_sink, sample_interval_s=self._sample_interval_s,
                               inject_leak_every=self._inject_leak_every,
                               record_token_ids=self._record_token_ids,
                               content_salt=self.header.content_salt)
        if self._shadow_kwargs is not None:
            from kvdiag.shadow.transformers_cb import install as install_shadow
            self.shadow = install_shadow(recorded, **self._shadow_kwargs)
            self._warm_up_shadow()
        if self._hardware:
            from kvdiag.collectors.hardware import HardwareRecorder
            self.hardware = HardwareRecorder(recorded, nvml=True, interval_s=self._sample_interval_s).start()
        if self._host_memory:
            from kvdiag.collectors.procfs import ProcessSampler
            self.host_sampler = ProcessSampler.of_self(recorded, interval_s=self._sample_interval_s).start()
        return self

    def _warm_up_shadow(self) -> None:
        """Pay the shadow's one-time costs now, before the engine serves
        (:meth:`ShadowRunner.warm_up`), when the model's config gives the KV shape; otherwise
        the first sampled step pays them."""
        shape = self.kv_shape
        if shape is None:
            return
        seconds = self.shadow.runner.warm_up(shape.kv_heads, shape.query_heads, shape.head_dim)
        logging.getLogger("kvdiag.agent").info("kvdiag agent: shadow kernels ready in %.1f s", seconds)

    def _open_socket(self) -> Optional[LiveSocketSink]:
        """The live socket, or None after one logged warning (the engine must not fail for it)."""
        from kvdiag import paths

        try:
            if self.socket_path is None:
                self.socket_path = paths.agent_socket_path()
                paths.remove_stale_sockets(self.socket_path.parent)
            else:
                paths.make_private_dirs(self.socket_path.parent)
            return LiveSocketSink(self.socket_path, self.header)
        except Exception as exc:
            logging.getLogger("kvdiag.agent").warning(
                "kvdiag agent: running without its live socket (the log still records): %s", exc)
            return None

    def stop(self) -> None:
        """Take a last pool and host memory sample, uninstall the hooks, flush and close the log
        and the socket."""
        if self.host_sampler is not None:
            self.host_sampler.stop()
            self.host_sampler = None
        if self.shadow is not None:
            self.shadow.uninstall()
        if self.hardware is not None:
            self.hardware.stop()
            self.hardware = None
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
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None


_AGENT: Optional[Agent] = None


def start(log_path: Optional[str] = None, socket: bool = True, socket_path: Optional[str] = None,
          **kwargs) -> Agent:
    """Start the agent in this process (call before the engine creates its cache).

    ``log_path``: event log to write (``.gz`` for gzip; None = no log); ``socket``: serve live
    events on a Unix socket (``socket_path`` or the default per-pid path). Other keyword
    arguments go to :class:`Agent` (``model``, ``block_size_tokens``, ``inject_leak_every``,
    ``sample_interval_s``, ``record_token_ids`` (record prompts' token ids instead of salted
    chunk hashes; default: ``KVDIAG_RECORD_TOKENS=1`` in the environment), ``extra``, ``engine`` and ``adapter`` (the
    header's engine name and a callable ``adapter(sink, sample_interval_s=...,
    inject_leak_every=..., record_token_ids=..., content_salt=...)`` that installs the engine's hooks; default:
    transformers' continuous batching), ``shadow``: keyword arguments of
    :func:`kvdiag.shadow.transformers_cb.install` to run shadow compression,
    ``prometheus``: serve kvdiag's metrics for Prometheus on ``[HOST:]PORT`` (127.0.0.1
    unless a host is given; :mod:`kvdiag.prometheus.exporter`), ``host_memory``: sample this process's RSS, PSS and swap every ``sample_interval_s``)."""
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
