"""Every file kvdiag writes is created 0600 and every folder it creates 0700 (issue 28).

Each test sets a umask of 0o022, under which a plain ``open`` gives 0644 and ``mkdir`` 0755
(checked first: the control), runs one writer (command or API) into a folder that does not
exist yet, and reads the mode of every file and folder it left with ``os.lstat``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag import paths

DATA = Path(__file__).parent.parent / "data"
DEMO_LOG = DATA / "demo_small" / "demo_24req_seed1.kvlog.gz"
SNAPSHOT = DATA / "cuda_allocator" / "snapshot.json"


@pytest.fixture(autouse=True)
def umask022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture(autouse=True)
def home(request, tmp_path, monkeypatch):
    """A kvdiag cache folder of the test's own (the bandwidth probe writes there), except for
    the demo, which needs the fetched model."""
    if request.node.get_closest_marker("model"):
        return None
    path = tmp_path / "home" / "kvdiag"
    monkeypatch.setenv("KVDIAG_HOME", str(path))
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def modes_under(root: Path) -> dict[str, int]:
    """``relative path -> mode`` of ``root`` and everything under it (no symlinks followed)."""
    out = {".": mode(root)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = mode(p)
    return out


def assert_private_tree(root: Path) -> dict[str, int]:
    """Every folder under (and including) ``root`` is 0700, every file 0600 (sockets too)."""
    modes = modes_under(root)
    wrong = {k: f"{m:04o}" for k, m in modes.items()
             if m != (paths.PRIVATE_DIR_MODE if (root / k).is_dir() else paths.PRIVATE_FILE_MODE)}
    assert not wrong, wrong
    return modes


def kvdiag(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    run_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=run_env)


def test_control_the_umask_would_give_a_default_open_0644_and_mkdir_0755(tmp_path):
    (tmp_path / "plain").write_text("x")
    (tmp_path / "folder").mkdir()
    assert mode(tmp_path / "plain") == 0o644 and mode(tmp_path / "folder") == 0o755


# -- the helpers ---------------------------------------------------------------------------

def test_make_private_dirs_makes_missing_folders_0700_and_keeps_existing_ones(tmp_path):
    user = tmp_path / "user"
    user.mkdir(mode=0o755)
    paths.make_private_dirs(user / "a" / "b")
    assert mode(user) == 0o755  # not made by kvdiag: not changed
    assert_private_tree(user / "a")
    os.umask(0o277)  # a umask that takes the owner's bits too: the folder is still usable
    paths.make_private_dirs(user / "c")
    assert mode(user / "c") == 0o700


def test_write_private_atomic_replaces_a_world_readable_file_with_a_0600_one(tmp_path):
    target = tmp_path / "out.html"
    target.write_text("old")
    assert mode(target) == 0o644
    paths.write_private_atomic(target, "new")
    assert target.read_text() == "new" and mode(target) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["out.html"]


def test_an_existing_file_keeps_its_mode_when_appended_to(tmp_path):
    log = tmp_path / "mine.jsonl"
    log.write_text("")
    os.chmod(log, 0o640)
    with paths.open_private(log, "a") as f:
        f.write("x")
    assert mode(log) == 0o640


def test_cache_and_log_folders_are_0700(tmp_path):
    paths.log_dir()
    assert_private_tree(tmp_path / "home")


# -- every writer --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["run.jsonl", "run.jsonl.gz"])
def test_log_writer(tmp_path, name):
    from kvdiag.events.eventlog import make_header, read_log
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.events.schema import BlockAllocated

    path = tmp_path / "new" / "logs" / name
    with LogWriter(path, make_header(engine="test")) as w:
        w.record(BlockAllocated(ts_ns=1, request_id="r", block_id=0))
    assert_private_tree(tmp_path / "new")
    assert len(read_log(path).frame(BlockAllocated)) == 1


def test_export_parquet_is_private_whatever_the_log_mode(tmp_path):
    log = tmp_path / "in" / DEMO_LOG.name
    log.parent.mkdir()
    shutil.copy(DEMO_LOG, log)
    os.chmod(log, 0o644)
    out = tmp_path / "new" / "dataset"
    r = kvdiag("export", log, "--parquet", out)
    assert r.returncode == 0, r.stderr
    modes = assert_private_tree(tmp_path / "new")
    assert "dataset/_headers.parquet" in modes and sum(k.endswith("part-0.parquet") for k in modes) > 3


def test_report_html_and_markdown(tmp_path):
    (tmp_path / "new").mkdir(mode=0o700)
    for fmt in ("html", "md"):
        r = kvdiag("report", DEMO_LOG, "-o", tmp_path / "new" / f"r.{fmt}", "--format", fmt)
        assert r.returncode == 0, r.stderr
    assert set(assert_private_tree(tmp_path / "new")) == {".", "r.html", "r.md"}


def test_doctor_prometheus_rules_file(tmp_path):
    (tmp_path / "new").mkdir(mode=0o700)
    r = kvdiag("doctor", "--prometheus-rules", tmp_path / "new" / "rules.yml")
    assert r.returncode == 0, r.stderr
    assert set(assert_private_tree(tmp_path / "new")) == {".", "rules.yml"}


def test_raw_kv_event_capture(tmp_path):
    from kvdiag.collectors.vllm_kv_events import KVEventSubscriber
    from kvdiag.events.sinks import NullSink

    raw = tmp_path / "new" / "x.kvevents.jsonl"
    sub = KVEventSubscriber("tcp://127.0.0.1:9", NullSink(), raw_path=raw).start()  # nobody publishes
    sub.stop()
    assert set(assert_private_tree(tmp_path / "new")) == {".", "x.kvevents.jsonl"}


def test_allocator_snapshot(tmp_path, monkeypatch):
    """The collector's own path to a snapshot file, with torch's ``_snapshot`` returning a
    recorded CUDA snapshot (this machine may have no CUDA)."""
    import json

    import torch

    from kvdiag.collectors.allocator import AllocatorCollector

    recorded = json.loads(SNAPSHOT.read_text())
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: recorded, raising=False)
    coll = AllocatorCollector(snapshot_dir=tmp_path / "new" / "snaps")
    coll.available = True
    path = coll.snapshot("test")
    assert path is not None and json.loads(path.read_text()) == recorded
    assert_private_tree(tmp_path / "new")


def test_agent_log_and_socket(tmp_path, monkeypatch):
    """``kvdiag.agent.start`` (what ``python -m kvdiag.run`` and the vLLM plugin call): its log
    and its socket, in folders it creates; and the default runtime folder."""
    from kvdiag.agent import Agent

    class Idle:
        def sample_now(self) -> None:
            pass

        def uninstall(self) -> None:
            pass

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    agent = Agent(log_path=str(tmp_path / "new" / "logs" / "a.jsonl"),
                  socket_path=str(tmp_path / "new" / "sock" / "agent.sock"), shadow_sharing=False,
                  host_memory=False, hardware=False, adapter=lambda sink, **_: Idle()).start()
    try:
        assert stat.S_ISSOCK(os.lstat(tmp_path / "new" / "sock" / "agent.sock").st_mode)
        assert_private_tree(tmp_path / "new")
    finally:
        agent.stop()
    assert mode(paths.runtime_dir()) == 0o700


def test_kvdiag_run_log(tmp_path, home):
    """``python -m kvdiag.run --log`` around a script that serves nothing; and the cache
    folder it made, with the bandwidth probe's cached result."""
    script = tmp_path / "serve.py"
    script.write_text("print('served')\n")
    r = subprocess.run([sys.executable, "-m", "kvdiag.run", "--log", str(tmp_path / "new" / "r.jsonl"),
                        "--no-socket", "--", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(assert_private_tree(tmp_path / "new")) == {".", "r.jsonl"}
    assert mode(tmp_path / "home") == 0o700 and mode(home) == 0o700
    assert len(assert_private_tree(home / "bandwidth")) == 2  # the folder and one probe file


def test_attach_out_and_its_folder(tmp_path):
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        r = kvdiag("attach", target.pid, "--duration", "1", "--interval", "0.2", "--no-pyspy",
                   "--any-process", "--json", "--out", tmp_path / "new" / "a.jsonl")
    finally:
        target.kill()
        target.wait()
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(assert_private_tree(tmp_path / "new")) == {".", "a.jsonl"}


def test_server_output_file(tmp_path):
    """The file a demo's server (transformers or vLLM) writes its output to."""
    from kvdiag.demo.server_process import ServerProcess

    class Echo(ServerProcess):
        command = [sys.executable, "-c", "print('hello')"]
        env = dict(os.environ)
        server_log = tmp_path / "new" / "d.kvlog.server.txt"
        base_url = "http://127.0.0.1:9"

    server = Echo()
    server.start(preexec_fn=lambda: None)
    assert server.proc.wait(timeout=60) == 0
    assert server.server_log.read_text() == "hello\n"
    assert set(assert_private_tree(tmp_path / "new")) == {".", "d.kvlog.server.txt"}


def test_top_demo_output_file(tmp_path):
    from kvdiag.live.demo_source import DemoSource

    src = DemoSource([], log_dir=tmp_path / "new", command=[sys.executable, "-c", "print('x')"],
                     socket_wait_s=0.0)
    try:
        src.child.wait(timeout=60)
    finally:
        src.close()
    assert set(assert_private_tree(tmp_path / "new")) == {".", "kvdiag-top-demo.out"}


def test_top_screenshot_and_recording(tmp_path):
    from kvdiag.live.replay_source import ReplaySource
    from kvdiag.tui.app import KvTopApp

    out = tmp_path / "new" / "top"
    app = KvTopApp(ReplaySource(DEMO_LOG, clock=lambda: 0.0), interval_s=1.0, output_dir=out,
                   wall_clock=lambda: 1_790_000_000.0)

    async def drive():
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            app.action_screenshot()
            app.action_toggle_record()
            app.action_toggle_record()
            await pilot.pause()

    asyncio.run(drive())
    modes = assert_private_tree(tmp_path / "new")
    assert sorted(Path(k).suffix for k in modes if k.startswith("top/")) == [".jsonl", ".svg"]


@pytest.mark.model
@pytest.mark.slow
def test_one_short_demo_run(tmp_path):
    """``kvdiag demo`` on the real model: its log and its server's output file."""
    r = kvdiag("demo", "--requests", "2", "--max-tokens", "4", "--seed", "1",
               "--log", tmp_path / "new" / "d.kvlog", timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    modes = assert_private_tree(tmp_path / "new")
    assert {"d.kvlog", "d.kvlog.server.txt"} <= set(modes)


def test_numba_fallback_folder_is_private_and_a_foreign_one_is_not_used(tmp_path, monkeypatch):
    """Without a writable cache folder, numba's code goes to a 0700 folder in the temp dir;
    one there that is open to others is not loaded from."""
    import tempfile

    monkeypatch.setenv("KVDIAG_HOME", "/proc/no-such-home")  # not creatable: OSError
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"kvdiag-numba-{os.getuid()}"
    assert paths.numba_cache_dir() == str(shared) and mode(shared) == 0o700
    os.chmod(shared, 0o777)
    other = Path(paths.numba_cache_dir())
    assert other != shared and other.parent == tmp_path and mode(other) == 0o700
