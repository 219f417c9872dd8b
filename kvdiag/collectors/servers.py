"""Engines besides vLLM seen from outside: SGLang and TensorRT-LLM servers, recognised by
their command line or by the names of their Prometheus metrics (vLLM itself:
:mod:`kvdiag.collectors.vllm`).

- SGLang: ``python -m sglang.launch_server ...`` or ``sglang serve ...``; metrics ``sglang:*``;
  KV events with ``--kv-events-config '{"publisher": "zmq", "endpoint": ...}'`` (the same flag
  and JSON as vLLM, the same wire format).
- TensorRT-LLM: ``trtllm-serve ...`` or ``python -m tensorrt_llm.commands.serve ...``; metrics
  ``trtllm_*``. Its KV events reach ZMQ through a relay (e.g. Dynamo's): attach takes that
  endpoint with ``--kv-events``; events in TensorRT-LLM's own serialized form are read too
  (:func:`kvdiag.pool.trtllm_kv_events.trtllm_event_dicts`). Its ``/kv_cache_events`` endpoint is not
  polled: reading it drains the engine's event queue (a POST that takes them from any other
  consumer), and attach only ever reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

ENGINES = ("vllm", "sglang", "trtllm")
METRIC_PREFIXES = {"vllm:": "vllm", "sglang:": "sglang", "trtllm_": "trtllm"}


@dataclass
class EngineServer:
    """A recognised server: ``engine`` one of :data:`ENGINES`, its root ``pid``."""

    engine: str
    pid: int

    def describe(self) -> str:
        names = {"sglang": "SGLang", "trtllm": "TensorRT-LLM", "vllm": "vLLM"}
        return f"{names[self.engine]} server {self.pid}"


def engine_of_cmdline(argv: Iterable[str]) -> Optional[str]:
    """``"sglang"`` or ``"trtllm"`` when the command line runs that engine's server, else None
    (vLLM: :func:`kvdiag.collectors.vllm.is_vllm_cmdline`)."""
    argv = list(argv)
    for i, arg in enumerate(argv[:4]):
        base = arg.rsplit("/", 1)[-1]
        module = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else ""
        if base == "sglang" or module.startswith("sglang."):
            return "sglang"
        if base == "trtllm-serve" or module.startswith("tensorrt_llm."):
            return "trtllm"
    return None


def engine_of_metrics(names: Iterable[str]) -> Optional[str]:
    """The engine whose metric prefix most of ``names`` carry (None when none does)."""
    counts: dict[str, int] = {}
    for name in names:
        for prefix, engine in METRIC_PREFIXES.items():
            if name.startswith(prefix):
                counts[engine] = counts.get(engine, 0) + 1
    return max(counts, key=counts.get) if counts else None


def identify(root) -> Optional[EngineServer]:
    """The SGLang or TensorRT-LLM server rooted at psutil process ``root``, else None."""
    try:
        engine = engine_of_cmdline(root.cmdline())
    except Exception:
        return None
    return EngineServer(engine, root.pid) if engine else None
