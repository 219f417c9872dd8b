"""A real vLLM server for tests (started from vLLM's own environment, always stopped) and the
traffic the vLLM tests send: chats that share a long system prompt."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvdiag.commands._demo_vllm import VllmServer
from kvdiag.demo.traffic import CHAT_ROUTE

SYSTEM = ("You are the support assistant of ACME Rail. Answer briefly and politely. " * 24).strip()
QUESTIONS = ["When does the first train leave?", "Can I bring a bicycle?", "Is there Wi-Fi on board?",
             "How do I get a refund?", "Are pets allowed?", "Where is the dining car?"]


@contextlib.contextmanager
def running_vllms(python: Path, model_dir: Path, servers: dict[str, tuple[Path, dict]]):
    """Start one vLLM server per name all at once, each pinned to its own core while there are
    cores enough; wait for every one (bounded wait for /health), yield them by name, always stop
    them all. A start is mostly one process after another importing vLLM on one core: on 2 cores
    two starts together took 90 s here, one after the other 166 s. ``servers``: name -> (folder,
    :class:`VllmServer`'s keyword arguments; ``eager=True`` for tests whose subject compiling
    the model leaves alone)."""
    cores = sorted(os.sched_getaffinity(0))
    started = {}
    try:
        for i, (name, (folder, kwargs)) in enumerate(servers.items()):
            if "threads" not in kwargs:  # one thread (VllmServer's default) on a core of its own
                pin = {"VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])}
                kwargs = dict(kwargs, extra_env={**pin, **kwargs.get("extra_env", {})})
            started[name] = server = VllmServer(python, model_dir, folder / "server.kvlog", **kwargs)
            server.start()
            server.model = str(model_dir)
        rpc_dirs = [server.rpc_dir for server in started.values()]
        for server in started.values():
            server.wait_ready()
            # vLLM's ZMQ IPC sockets are in kvdiag's private folder, not strewn over the temp folder
            assert server.rpc_dir is not None and any(p.is_socket() for p in server.rpc_dir.iterdir()), server.rpc_dir
        yield dict(started)
    finally:  # all at once: each waits for vLLM's own shutdown (~10 s)
        with ThreadPoolExecutor() as pool:
            list(pool.map(VllmServer.stop, started.values()))
    assert not any(d.exists() for d in rpc_dirs)  # removed with their sockets, also when vLLM had to be killed


@contextlib.contextmanager
def running_vllm(python: Path, model_dir: Path, folder: Path, **kwargs):
    """Start vLLM (bounded wait for /health), yield the :class:`VllmServer`, always stop it."""
    with running_vllms(python, model_dir, {"": (folder, kwargs)}) as servers:
        yield servers[""]


def collected_tests_use(request, fixture: str) -> bool:
    """Whether a test this session runs needs ``fixture`` (directly or through another)."""
    return any(fixture in item.fixturenames for item in request.session.items)


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
