"""One PID story: `doctor --pid`, `top --pid` and `attach` find the agent serving any PID of a
served process tree the same way, and refuse a process that serves no engine.

The tree is built of real processes shaped like a vLLM server's: a launcher (``kvdiag demo``'s
place) starts a server, the server an engine process running the real kvdiag agent (its socket
in a kvdiag runtime dir, found through the engine's listening sockets), and the engine a
worker; the launcher also starts an unrelated ``sleep``, which must not be taken for the
server. The real demo's three PIDs are checked in tests/e2e/test_demo.py."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from kvdiag.cli import main
from kvdiag.collectors.agent_client import NO_ENGINE_EXIT, AgentConnection, find_agent_socket

ENGINE = textwrap.dedent("""
    import subprocess, sys, time
    from kvdiag import agent
    class Idle:
        def sample_now(self): pass
        def uninstall(self): pass
    agent.start(socket_path=sys.argv[1], engine="stand-in", adapter=lambda sink, **kw: Idle())
    worker = subprocess.Popen(["sleep", "300"])
    print(worker.pid, flush=True)
    time.sleep(300)
""")
SERVER = textwrap.dedent("""
    import subprocess, sys, time
    engine = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
    print(engine.pid, engine.stdout.readline().strip(), flush=True)
    time.sleep(300)
""")
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    server = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]],
                              stdout=subprocess.PIPE, text=True)
    sleeper = subprocess.Popen(["sleep", "300"])
    print(server.pid, server.stdout.readline().strip(), sleeper.pid, flush=True)
    time.sleep(300)
""")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "kvdiag"  # a kvdiag runtime dir's name
    run_dir.mkdir(mode=0o700)
    socket_path = run_dir / "demo-1-2.sock"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, SERVER, ENGINE, str(socket_path)],
                                stdout=subprocess.PIPE, text=True)
    try:
        server, engine, worker, sleeper = map(int, launcher.stdout.readline().split())
        yield {"launcher": launcher.pid, "server": server, "engine": engine, "worker": worker,
               "sleeper": sleeper, "socket": socket_path}
    finally:
        for p in reversed(psutil.Process(launcher.pid).children(recursive=True)):
            p.kill()
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize("role", ["launcher", "server", "engine", "worker"])
def test_every_pid_of_the_tree_finds_the_one_agent(tree, role):
    assert find_agent_socket(tree[role]) == tree["socket"]
    with AgentConnection(tree["socket"]) as conn:  # it is the live agent, serving its header
        assert conn.read_header().engine == "stand-in"


@pytest.mark.parametrize("role", ["launcher", "server", "engine", "worker"])
def test_doctor_pid_reaches_the_agent_from_every_pid(tree, role, capsys):
    assert main(["doctor", "--pid", str(tree[role]), "--seconds", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] != "fail"


def test_top_pid_reads_the_agent_from_an_engine_child(tree):
    from kvdiag.live.pid_source import attach

    src = attach(tree["worker"])
    try:
        assert src.primary.path == tree["socket"] and src.header.engine == "stand-in"
    finally:
        src.close()


def test_a_sibling_of_the_server_is_not_the_server(tree, capsys, tmp_path):
    pid = tree["sleeper"]
    assert find_agent_socket(pid) is None  # its parent (the launcher) runs no agent itself
    assert main(["doctor", "--pid", str(pid), "--seconds", "1"]) == NO_ENGINE_EXIT
    err = capsys.readouterr().err
    assert err.startswith(f"kvdiag doctor: process {pid} (sleep) serves no recognised engine") and err.count("\n") == 1
    out = tmp_path / "a.jsonl"
    assert main(["attach", str(pid), "--duration", "1", "--out", str(out)]) == NO_ENGINE_EXIT
    err = capsys.readouterr().err
    assert err.startswith(f"kvdiag attach: process {pid} (sleep) serves no recognised engine") and err.count("\n") == 1
    assert not out.exists()


def test_attach_doctor_and_top_on_a_plain_sleep_exit_non_zero(tmp_path):
    """As a user types them: one line on stderr, the documented exit status, nothing written;
    with --any-process, top watches it from outside."""
    from kvdiag.live.pid_source import attach

    sleeper = subprocess.Popen(["sleep", "100"])
    try:
        out = tmp_path / "a.jsonl"
        for cmd, name in ((["attach", str(sleeper.pid), "--duration", "2", "--out", str(out)], "attach"),
                          (["doctor", "--pid", str(sleeper.pid), "--seconds", "2"], "doctor"),
                          (["top", "--pid", str(sleeper.pid)], "top")):
            started = time.monotonic()
            r = subprocess.run([sys.executable, "-m", "kvdiag", *cmd], capture_output=True, text=True, timeout=60)
            assert r.returncode == NO_ENGINE_EXIT and r.stdout == "", (r.stdout, r.stderr)
            lines = r.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith(
                f"kvdiag {name}: process {sleeper.pid} (sleep) serves no recognised engine: no kvdiag agent"), lines
            assert time.monotonic() - started < 30  # refused at once, not after --duration
        assert not out.exists()
        src = attach(sleeper.pid, any_process=True)
        try:
            assert type(src).__name__ == "ProcessSource"
        finally:
            src.close()
        assert sleeper.poll() is None  # untouched
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_pid_that_does_not_exist(capsys):
    from kvdiag.commands.attach import pid_max

    gone = next(p for p in range(pid_max(), 1, -1) if not psutil.pid_exists(p))
    assert main(["doctor", "--pid", str(gone)]) == 2
    assert capsys.readouterr().err == f"kvdiag doctor: no process with PID {gone}\n"
    assert main(["top", "--pid", str(gone)]) == 2
    assert capsys.readouterr().err == f"kvdiag top: no process with PID {gone}\n"
    assert main(["attach", str(gone)]) == 1
    assert capsys.readouterr().err == f"kvdiag attach: no process with PID {gone}\n"


def test_attach_to_a_vllm_engine_child_joins_its_server(tmp_path):
    """A process whose command line runs vLLM (``exec -a vllm``: argv[0] is ``vllm``) with a
    child: attach given the child joins the server (its /metrics, KV events and whole tree)."""
    from kvdiag.collectors.vllm import vllm_root
    from kvdiag.events.eventlog import read_header

    # this interpreter, not whatever `python3` is on PATH: a wrapper script there (pyenv's shim)
    # would start the real interpreter under its own name, not `vllm`
    server = subprocess.Popen(["bash", "-c", f"exec -a vllm {shlex.quote(sys.executable)} -c 'import subprocess, time; "
                               "p = subprocess.Popen([\"sleep\", \"300\"]); print(p.pid, flush=True); "
                               "time.sleep(300)'"], stdout=subprocess.PIPE, text=True)
    try:
        child = int(server.stdout.readline())
        assert vllm_root(child) == vllm_root(server.pid) == server.pid
        out = tmp_path / "a.jsonl"
        r = subprocess.run([sys.executable, "-m", "kvdiag", "attach", str(child), "--duration", "1", "--no-pyspy",
                            "--json", "--out", str(out)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert f"PID {child} is part of vLLM server {server.pid}'s process tree: attaching to {server.pid}" in r.stderr
        assert read_header(out).pid == server.pid
        assert json.loads(r.stdout)["memory"]["processes"] == 2  # the server and its child
    finally:
        for p in psutil.Process(server.pid).children(recursive=True):
            p.kill()
        server.kill()
        server.wait()
