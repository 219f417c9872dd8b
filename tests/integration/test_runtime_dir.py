"""Trusting only our own runtime dir and sockets (issue 14, item 4): a runtime dir owned by
someone else, open to others or a symlink is refused; a socket of another uid is never
connected to; stale sockets of dead agents are removed; an agent that cannot use the runtime
dir runs without its socket instead of failing.

Ownership tests chown to uid 65534 (nobody), which needs root (CI runs the tests as root)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvdiag import paths
from kvdiag.collectors.agent_client import AgentConnection, candidate_sockets

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def xdg(tmp_path, monkeypatch) -> Path:
    """XDG_RUNTIME_DIR pointed at a temp folder: the runtime dir is ``<it>/kvdiag``."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_the_runtime_dir_is_created_private(xdg):
    path = paths.runtime_dir()
    assert path == xdg / "kvdiag"
    st = os.lstat(path)
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700


@needs_root
def test_a_runtime_dir_owned_by_another_uid_is_refused(xdg):
    (xdg / "kvdiag").mkdir(mode=0o700)
    os.chown(xdg / "kvdiag", NOBODY, NOBODY)
    with pytest.raises(paths.RuntimeDirError, match=f"owned by uid {NOBODY}"):
        paths.runtime_dir()


def test_a_runtime_dir_open_to_others_is_refused(xdg):
    (xdg / "kvdiag").mkdir()
    os.chmod(xdg / "kvdiag", 0o777)
    with pytest.raises(paths.RuntimeDirError, match="0777"):
        paths.runtime_dir()
    assert os.lstat(xdg / "kvdiag").st_mode & 0o777 == 0o777  # refused, not silently changed


def test_a_runtime_dir_that_is_a_symlink_is_refused(xdg):
    target = xdg / "elsewhere"
    target.mkdir(mode=0o700)
    (xdg / "kvdiag").symlink_to(target)
    with pytest.raises(paths.RuntimeDirError, match="symlink"):
        paths.runtime_dir()


class FakeAdapter:
    def sample_now(self) -> None:
        pass

    def uninstall(self) -> None:
        pass


@needs_root
def test_the_agent_runs_without_its_socket_when_the_runtime_dir_is_refused(xdg, caplog):
    from kvdiag.agent import Agent
    from kvdiag.events.eventlog import read_header
    from kvdiag.events.schema import BlockAllocated

    (xdg / "kvdiag").mkdir(mode=0o700)
    os.chown(xdg / "kvdiag", NOBODY, NOBODY)
    log = xdg / "run.jsonl"
    sinks = []
    agent = Agent(log_path=str(log), live=True, shadow_sharing=False, host_memory=False,
                  adapter=lambda sink, **_kw: sinks.append(sink) or FakeAdapter()).start()
    try:
        assert agent.live is None
        sinks[0].record(BlockAllocated(ts_ns=1, request_id="r", block_id=0))
    finally:
        agent.stop()
    assert list((xdg / "kvdiag").iterdir()) == []  # nothing written into the foreign dir
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("kvdiag")]
    assert len(warnings) == 1 and "without its live socket" in warnings[0]
    assert read_header(log).engine and b"block_allocated" in log.read_bytes()


def _listen(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    server.setblocking(False)
    return server


@needs_root
def test_a_socket_owned_by_another_uid_is_not_connected_to(tmp_path):
    path = tmp_path / f"agent-{os.getpid()}.sock"
    server = _listen(path)
    os.chown(path, NOBODY, NOBODY)
    try:
        with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
            AgentConnection(path, timeout_s=2)
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection was ever made
        assert path not in candidate_sockets([os.getpid()])
    finally:
        server.close()


def _forge(path: Path, ready_w: int) -> None:
    """In a forked child running as NOBODY: serve a forged header at ``path``."""
    try:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen(1)
        os.write(ready_w, b"r")
        conn, _ = server.accept()
        conn.sendall(b'{"schema_version": 1, "engine": "forged"}\n')
        conn.recv(1)
    finally:
        os._exit(0)


@needs_root
def test_a_peer_of_another_uid_is_refused_even_behind_our_own_socket_file():
    """The socket file is chowned to us after another uid bound it: the peer's credentials
    (SO_PEERCRED) still tell who serves it."""
    folder = Path(tempfile.mkdtemp(prefix="kvdiag-test-peer-"))
    os.chmod(folder, 0o777)
    path = folder / "agent-forged.sock"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _forge(path, ready_w)
    try:
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"r"
        os.chown(path, os.getuid(), os.getgid())
        with pytest.raises(PermissionError, match=f"uid {NOBODY}"):
            AgentConnection(path, timeout_s=2)
    finally:
        os.close(ready_r)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        shutil.rmtree(folder)


def test_stale_sockets_of_dead_agents_are_removed(xdg):
    run_dir = paths.runtime_dir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = run_dir / f"agent-{dead.pid}.sock"
    _listen(stale).close()  # the file stays; nothing listens
    live_path = run_dir / f"agent-{os.getpid()}.sock"
    live = _listen(live_path)
    try:
        removed = paths.remove_stale_sockets(run_dir)
        assert removed == [stale] and not stale.exists() and live_path.exists()
    finally:
        live.close()
