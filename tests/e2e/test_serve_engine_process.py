"""``python -m kvdiag.run -- transformers serve``: the agent records where the engine runs.

From transformers 5.25 on, ``transformers serve`` runs the model in a spawned process of its
own; the agent must run there (the HTTP process never touches the KV cache). Checked on the
real server: the log's events come from the model's process, a child of the process the user
started; the live socket is named after the process the user started, so ``kvdiag doctor
--pid`` finds it; SIGTERM to that process leaves a complete log (the agent's last sample).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from kvdiag.demo.child_command import kvdiag_module
from kvdiag.demo.server_process import free_port
from kvdiag.events.eventlog import read_log
from kvdiag.paths import agent_socket_path
from kvdiag.demo.traffic import chat
from waiting import wait_for

pytestmark = [pytest.mark.model, pytest.mark.slow]


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def test_agent_runs_in_the_model_process_and_is_found_by_the_server_pid(model_dir, tmp_path):
    from kvdiag.agent.transformers_serve import serves_in_a_child

    port, log_path = free_port(), tmp_path / "serve.jsonl"
    # a pool of 64 blocks: without one, transformers sizes its KV cache to 60-90% of the memory
    # available at start (14 GB here), which the suite's other lane needs for vLLM servers
    command = ["transformers", "serve", str(model_dir), "--continuous-batching", "--device", "cpu",
               "--dtype", "float32", "--cb-num-blocks", "64", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    server = subprocess.Popen([*kvdiag_module("kvdiag.run"), "--log", str(log_path), "--", *command],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    socket_path = agent_socket_path(server.pid)
    try:
        wait_for(lambda: socket_path.exists() or server.poll() is not None, 300, "the agent's socket", poll_s=0.2)
        assert server.poll() is None, server.stderr.read()[-3000:]
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/v1/models"), 300, "the server's HTTP API", poll_s=0.2)
        engine_pids = _children(server.pid)
        answer = chat(f"http://127.0.0.1:{port}", str(model_dir),
                      [{"role": "user", "content": "What is the capital of France?"}],
                      max_tokens=8, request_id="q0", timeout_s=300)
        assert answer
        doctor = subprocess.run([*kvdiag_module("kvdiag"), "doctor", "--pid", str(server.pid),
                                 "--seconds", "2", "--json"], capture_output=True, text=True, timeout=120)
        assert doctor.returncode in (0, 1), doctor.stdout[-2000:] + doctor.stderr[-2000:]
        assert json.loads(doctor.stdout)["findings"]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    log = read_log(log_path, strict=True)
    assert not log.problems
    if serves_in_a_child(command):
        assert log.header.pid in engine_pids and log.header.pid != server.pid
    else:
        assert log.header.pid == server.pid
    arrived = log.frame("request_arrived")
    allocated = log.frame("block_allocated")
    assert len(arrived) == 1 and set(allocated["request_id"]) == set(arrived["request_id"])
    assert len(log.frame("kv_pool_sample")) >= 1


def test_the_engine_serves_when_the_agent_cannot_start(caplog):
    """Nothing kvdiag does is raised into the engine: a port already taken keeps the agent
    out, and transformers' target runs all the same."""
    import socket as sk

    from kvdiag import agent
    from kvdiag.agent.transformers_serve import run_engine_with_agent

    taken = sk.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ran = []
    try:
        run_engine_with_agent({"socket": False, "prometheus": f"127.0.0.1:{taken.getsockname()[1]}",
                               "host_memory": False},
                              lambda target, *args: target(*args), ran.append, "engine ran")
    finally:
        taken.close()
    assert ran == ["engine ran"] and agent.current() is None
    assert "serving without it" in caplog.text
