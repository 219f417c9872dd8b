"""`kvdiag attach` on a real vLLM server: the engine and its children are recognised, /metrics
is scraped faithfully, the KV-event stream arrives without gaps, and the plugin's stream is
recorded beside them."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from kvdiag.traces.kv_event_traces import kv_event_gaps
from kvdiag.collectors.vllm import identify
from kvdiag.events.eventlog import iter_events
from kvdiag.events.schema import BlockStored, CollectorGap, CollectorStatus, EngineMetrics, PrefixCacheStored, RequestFinished
from vllm_harness import QUESTIONS, chat, counter, metrics_text

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_identify_finds_the_engine_core_and_the_worker(vllm_server):
    server = identify(psutil.Process(vllm_server.proc.pid))
    assert server is not None and server.pid == vllm_server.proc.pid
    # an independent read of the kernel's process titles (truncated to 15 characters)
    children = {p.pid for p in psutil.Process(vllm_server.proc.pid).children(recursive=True)}
    assert server.engine_core_pids and set(server.engine_core_pids) <= children
    assert server.worker_pids and set(server.worker_pids) <= children
    assert all(_comm(p).startswith("VLLM::EngineCor") for p in server.engine_core_pids)
    assert all(_comm(p).startswith("VLLM::Worker") for p in server.worker_pids)
    assert identify(psutil.Process()) is None  # pytest is no vLLM server


def _last_queries(log) -> float | None:
    """The prefix-cache queries of the last EngineMetrics attach has written so far."""
    try:
        scraped = [e for e in iter_events(log) if isinstance(e, EngineMetrics)]
    except Exception:  # a line being written: read again on the next poll
        return None
    return scraped[-1].prefix_cache_queries_tokens if scraped else None


def test_attach_records_metrics_kv_events_and_the_plugin(vllm_server, tmp_path):
    out = tmp_path / "attach.kvlog"
    attach = subprocess.Popen([sys.executable, "-m", "kvdiag", "attach", str(vllm_server.proc.pid),
                               "--duration", "600", "--interval", "0.5", "--no-pyspy", "--json",
                               "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # traffic once attach has found the KV-event stream (it says so in its log), not after a sleep
    deadline = time.monotonic() + 20
    while not (out.exists() and "vllm-kv-events" in out.read_text()):
        assert attach.poll() is None, attach.stderr.read()
        assert time.monotonic() < deadline, "attach did not subscribe to the KV events"
        time.sleep(0.1)
    time.sleep(0.5)  # vLLM's publisher reconnects to a new listener within 100 ms
    answers = []
    worker = threading.Thread(target=lambda: answers.extend(chat(vllm_server, q, system=f"Session {i}. " * 200)
                                                            for i, q in enumerate(QUESTIONS)))
    worker.start()
    worker.join(timeout=300)
    direct = metrics_text(vllm_server)  # the server is idle now: its counters no longer move
    # attach stays until it has scraped the idle server once (an event, not a fixed duration that
    # a loaded machine's traffic can outlast), then SIGTERM ends it as a supervisor would
    deadline = time.monotonic() + 60
    while _last_queries(out) != counter(direct, "vllm:prefix_cache_queries_total"):
        assert attach.poll() is None, attach.stderr.read()
        assert time.monotonic() < deadline, "attach never scraped the idle server's counters"
        time.sleep(0.2)
    attach.terminate()
    stdout, stderr = attach.communicate(timeout=120)
    assert attach.returncode == 0, stderr
    summary = json.loads(stdout)
    assert len(answers) == len(QUESTIONS)

    events = list(iter_events(out))
    status = {e.collector: e for e in events if isinstance(e, CollectorStatus)}
    assert status["vllm"].available and str(vllm_server.proc.pid) in status["vllm"].hint
    assert status["metrics"].available and status["vllm-kv-events"].available
    assert status["agent"].available  # the plugin's socket in the engine core, found from the tree
    # scraped counters equal a direct read with prometheus_client's parser
    last = [e for e in events if isinstance(e, EngineMetrics)][-1]
    assert last.prefix_cache_queries_tokens == counter(direct, "vllm:prefix_cache_queries_total")
    assert last.prefix_cache_hits_tokens == counter(direct, "vllm:prefix_cache_hits_total")
    assert last.block_size_tokens == 128 and last.prefix_caching
    # the KV events: each prompt (all distinct from their first token) stored its full blocks,
    # those of the prompt and perhaps one filled while decoding; no batch was lost
    stored = sum(len(e.block_hashes) for e in events if isinstance(e, PrefixCacheStored))
    finished = [e for e in events if isinstance(e, RequestFinished)]
    assert len(finished) == len(QUESTIONS)
    assert (sum(e.prompt_tokens // 128 for e in finished) <= stored
            <= sum((e.prompt_tokens + e.output_tokens) // 128 for e in finished))
    assert not [e for e in events if isinstance(e, CollectorGap) and e.collector == "vllm-kv-events"]
    # the keys vLLM published for the blocks it cached are those the plugin recorded for them
    published = {h for e in events if isinstance(e, PrefixCacheStored) for h in e.block_hashes}
    recorded = {e.block_hash for e in events if isinstance(e, BlockStored)}
    assert published and published == recorded
    raw = Path(str(out) + ".kvevents.jsonl")
    assert raw.is_file() and kv_event_gaps(raw) == []
    assert {f["rule"]: f["status"] for f in summary["findings"]}.get("kv_events.gaps", "pass") == "pass"


def test_every_pid_of_the_vllm_tree_reaches_the_plugin(vllm_server, tmp_path):
    """`doctor --pid` with the API server's, the engine core's or the worker's PID reaches the
    plugin's agent in the engine core; `attach` given the worker joins the API server."""
    from kvdiag.collectors.agent_client import find_agent_socket
    from kvdiag.events.eventlog import read_header

    server = identify(psutil.Process(vllm_server.proc.pid))
    pids = [server.pid, *server.engine_core_pids, *server.worker_pids]
    assert {find_agent_socket(p) for p in pids} == {Path(vllm_server.socket_path)}
    for pid in pids:
        r = subprocess.run([sys.executable, "-m", "kvdiag", "doctor", "--pid", str(pid), "--seconds", "2", "--json"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode in (0, 1) and json.loads(r.stdout)["findings"], (pid, r.stderr)
    worker = server.worker_pids[0]
    out = tmp_path / "worker.kvlog"
    r = subprocess.run([sys.executable, "-m", "kvdiag", "attach", str(worker), "--duration", "3", "--no-pyspy",
                        "--json", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"attaching to {server.pid}" in r.stderr and read_header(out).pid == server.pid
    status = {e.collector: e for e in iter_events(out) if isinstance(e, CollectorStatus)}
    assert status["vllm"].available and status["agent"].available
