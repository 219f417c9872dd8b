"""vLLM from outside: recognise a vLLM server, find its HTTP API and its KV-event stream.

Nothing is ever sent to the server but HTTP GETs (``/metrics``, ``/kv_event_sources``); the
KV-event stream is a ZMQ subscription. A vLLM API server is a process whose command line runs
``vllm`` (``vllm serve`` or ``python -m vllm.entrypoints...``) with children titled
``VLLM::EngineCore`` (the scheduler and the KV block pool) and ``VLLM::Worker`` (the model).

vLLM's publisher binds its endpoint when it holds a wildcard (``tcp://*:5557``) or is an
``ipc://``/``inproc://`` path, and *connects* to any other (``tcp://127.0.0.1:5557``): in that
case the subscriber must be the one that binds (:func:`subscriber_side`).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from typing import Iterable, Optional

ENGINE_CORE_TITLE = "VLLM::EngineCore"
WORKER_TITLE = "VLLM::Worker"


@dataclass
class VllmServer:
    """A vLLM server seen from outside: its processes and, once found, its HTTP base URL."""

    pid: int
    engine_core_pids: list[int] = field(default_factory=list)
    worker_pids: list[int] = field(default_factory=list)
    base_url: Optional[str] = None

    def describe(self) -> str:
        return (f"vLLM API server {self.pid}, engine core {self.engine_core_pids or '?'}, "
                f"workers {self.worker_pids or '?'}")


def _title(proc) -> str:
    try:
        return proc.name() or ""
    except Exception:
        return ""


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:
        return []


def is_vllm_cmdline(argv: Iterable[str]) -> bool:
    """``vllm serve ...``, ``python -m vllm.entrypoints.openai.api_server ...`` and the like."""
    argv = list(argv)
    for i, arg in enumerate(argv[:4]):
        base = arg.rsplit("/", 1)[-1]
        if base == "vllm" or (arg == "-m" and i + 1 < len(argv) and argv[i + 1].startswith("vllm.")):
            return True
    return False


def vllm_root(pid: int) -> Optional[int]:
    """The vLLM API server whose tree ``pid`` belongs to: ``pid`` itself or its nearest
    ancestor that is one (None when neither is)."""
    import psutil

    from kvdiag.collectors.agent_client import ancestors
    for p in [pid, *ancestors(pid)]:
        try:
            if identify(psutil.Process(p)) is not None:
                return p
        except psutil.Error:
            continue
    return None


def identify(root) -> Optional[VllmServer]:
    """The vLLM server rooted at psutil process ``root``, or None when it is not one: neither
    its command line runs vLLM nor is one of its own children vLLM's engine core (a shell or a
    supervisor that merely has a vLLM server somewhere below it is not a vLLM server)."""
    try:
        direct = root.children()
        below = root.children(recursive=True)
    except Exception:
        direct, below = [], []
    if not (is_vllm_cmdline(_cmdline(root)) or any(_title(c).startswith(ENGINE_CORE_TITLE) for c in direct)):
        return None
    return VllmServer(pid=root.pid,
                      engine_core_pids=[c.pid for c in below if _title(c).startswith(ENGINE_CORE_TITLE)],
                      worker_pids=[c.pid for c in below if _title(c).startswith(WORKER_TITLE)])


def kv_events_from_cmdline(argv: Iterable[str]) -> Optional[dict]:
    """The ``--kv-events-config`` JSON of a vLLM command line (None when absent or unreadable)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        text = None
        if arg == "--kv-events-config" and i + 1 < len(argv):
            text = argv[i + 1]
        elif arg.startswith("--kv-events-config="):
            text = arg.split("=", 1)[1]
        if text:
            try:
                cfg = json.loads(text)
            except ValueError:
                return None
            return cfg if isinstance(cfg, dict) else None
    return None


def kv_event_sources(base_url: str, timeout_s: float = 2.0) -> list[dict]:
    """vLLM's ``GET /kv_event_sources``: one KV-events config per data-parallel rank, only those
    with events enabled and a ZMQ publisher. Raises OSError/ValueError when unreadable."""
    with urllib.request.urlopen(f"{base_url}/kv_event_sources", timeout=timeout_s) as resp:
        data = json.loads(resp.read(1 << 20))
    configs = data.values() if isinstance(data, dict) else []
    return [c for c in configs if isinstance(c, dict) and c.get("enable_kv_cache_events")
            and c.get("publisher", "zmq") == "zmq" and c.get("endpoint")]


def subscriber_side(endpoint: str) -> tuple[str, str]:
    """``("connect", address)`` when vLLM's publisher binds ``endpoint`` (a wildcard host, an
    ipc/inproc path: we connect to it, on loopback for a wildcard), else ``("bind", endpoint)``
    (vLLM connects to that address, so the subscriber must listen there)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return "connect", endpoint
    if "*" in endpoint or "::" in endpoint:
        return "connect", endpoint.replace("*", "127.0.0.1", 1)
    return "bind", endpoint
