"""A real vLLM server for tests (started from vLLM's own environment, always stopped) and the
traffic the vLLM tests send: chats that share a long system prompt."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from pathlib import Path

from kvdiag.commands._demo_vllm import VllmServer
from kvdiag.demo.traffic import CHAT_ROUTE

SYSTEM = ("You are the support assistant of ACME Rail. Answer briefly and politely. " * 24).strip()
QUESTIONS = ["When does the first train leave?", "Can I bring a bicycle?", "Is there Wi-Fi on board?",
             "How do I get a refund?", "Are pets allowed?", "Where is the dining car?"]


@contextlib.contextmanager
def running_vllm(python: Path, model_dir: Path, folder: Path, **kwargs):
    """Start vLLM (bounded wait for /health), yield the :class:`VllmServer`, always stop it."""
    server = VllmServer(python, model_dir, folder / "server.kvlog", **kwargs)
    server.start()
    rpc_dir = server.rpc_dir
    try:
        server.wait_ready()
        # vLLM's ZMQ IPC sockets are in kvdiag's private folder, not strewn over the temp folder
        assert rpc_dir is not None and any(p.is_socket() for p in rpc_dir.iterdir()), rpc_dir
        server.model = str(model_dir)
        yield server
    finally:
        server.stop()
    assert not rpc_dir.exists()  # removed with its sockets, also when vLLM had to be killed


def chat(server, question: str, system: str = SYSTEM, max_tokens: int = 12) -> dict:
    body = {"model": server.model, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    req = urllib.request.Request(f"{server.base_url}/{CHAT_ROUTE}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def metrics_text(server) -> str:
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as resp:
        return resp.read().decode()


def counter(text: str, name: str) -> float:
    """A vLLM counter summed over its label sets, read with prometheus_client's own parser
    (independent of kvdiag's scraper)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total
