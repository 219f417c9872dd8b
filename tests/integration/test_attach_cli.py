"""`kvdiag attach` against real processes without an agent: bad PID, a target that exits
while attached (log kept, exit 3), an existing --out, and a plain Python target."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from waiting import wait_for
from kvdiag.events.eventlog import read_log


def attach(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvdiag", "attach", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def test_bad_pid_is_a_clear_error(tmp_path):
    from kvdiag.commands.attach import pid_max

    pid = next(p for p in range(pid_max(), 1, -1) if not psutil.pid_exists(p))  # valid, unused
    r = attach(pid, "--duration", 1, "--out", tmp_path / "x.jsonl")
    assert r.returncode == 1
    assert r.stderr.strip() == f"kvdiag attach: no process with PID {pid}"
    assert not (tmp_path / "x.jsonl").exists()


def test_target_exiting_while_attached_keeps_the_log(tmp_path):
    import time

    # the target exits when its stdin closes: after attach has recorded a first sample
    target = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    out = tmp_path / "x.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvdiag", "attach", str(target.pid), "--duration", "120",
                             "--out", str(out), "--json", "--no-pyspy", "--any-process"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not (out.exists() and "process_sample" in out.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "attach recorded no process sample"
        time.sleep(0.2)
    status = open(f"/proc/{target.pid}/status").read()  # the target's RSS, read here from /proc
    rss = int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) * 1024
    target.stdin.close()
    target.wait()
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 3, stderr
    assert f"process {target.pid} has exited while attached" in stderr and "Traceback" not in stderr
    log = read_log(out)
    procs = log.frame("process_sample")
    assert len(procs) >= 1 and set(procs["pid"]) == {target.pid}
    assert (abs(procs["rss_bytes"] - rss) <= 1 << 20).all()  # an idle target: within 1 MiB
    summary = json.loads(stdout)
    assert summary["memory"]["process_rss_bytes"] == int(procs[procs["ts_ns"] == procs["ts_ns"].max()]["rss_bytes"].sum())


def test_existing_out_is_refused(tmp_path):
    out = tmp_path / "x.jsonl"
    out.write_text("keep me")
    r = attach(psutil.Process().pid, "--duration", 1, "--out", out)
    assert r.returncode == 2 and "already exists" in r.stderr
    assert out.read_text() == "keep me"


def test_python_target_without_agent(tmp_path):
    code = "import threading\nthreading.Thread(target=threading.Event().wait).start()\n" \
           "def sampling_loop():\n    while True: sum(range(1000))\nsampling_loop()\n"
    target = subprocess.Popen([sys.executable, "-c", code])
    try:
        out = tmp_path / "x.jsonl"
        r = attach(target.pid, "--duration", 3, "--out", out, "--json", "--pyspy-rate", 50, "--any-process")
        assert r.returncode == 0, r.stderr
        s = json.loads(r.stdout)
        status = {c["collector"]: c["available"] for c in s["collectors"]}
        rapl = status.pop("rapl")  # host energy: readable on some machines (root, no VM), not here
        assert status == {"agent": False, "py-spy": True, "nvml": False}
        assert rapl == (read_log(out).frame("host_energy_sample").shape[0] > 0)
        assert s["phases"]["samples"] > 20
        assert s["phases"]["shares"]["sampling"] > 0.3 and s["phases"]["shares"]["idle"] > 0.3
        assert read_log(out).frame("phase_profile")["num_samples"].sum() == s["phases"]["samples"]
    finally:
        target.kill()
        target.wait()


def test_sigterm_ends_attach_early_with_its_summary(tmp_path):
    """Started in the background (SIGINT ignored, as a non-interactive shell leaves it),
    attach still ends on SIGTERM: exit 0, the summary printed, the log kept."""
    import signal
    import time

    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    out = tmp_path / "x.kvlog"
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvdiag", "attach", str(target.pid), "--duration", "120",
                                 "--no-pyspy", "--json", "--any-process", "--out", str(out)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        deadline = time.monotonic() + 30
        while not (out.exists() and "process_sample" in out.read_text()):  # attached and sampling
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        summary = json.loads(stdout)
        assert summary["window"]["duration_s"] < 60 and summary["memory"]["processes"] == 1
    finally:
        target.kill()
        target.wait()


def test_agent_stream_reads_the_live_socket(tmp_path):
    """AgentStream against the agent's real LiveSocketSink: header, then every event in order;
    the socket is found from the process's own listening Unix sockets."""
    import os

    from kvdiag import agent
    from kvdiag.collectors.agent_client import AgentStream, candidate_sockets
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.schema import BlockAllocated, BlockReleased
    from kvdiag.events.sinks import ListSink

    path = tmp_path / "agent-77.sock"
    live = agent.LiveSocketSink(path, make_header(engine="transformers-cb", block_size_tokens=16))
    try:
        assert path in candidate_sockets([os.getpid()])
        got = ListSink()
        stream = AgentStream(path, got).start()
        # (the sink keeps no event while nobody listens)
        wait_for(lambda: live.num_clients > 0, timeout_s=30, what="the stream's connection accepted")
        sent = [BlockAllocated(ts_ns=i, request_id=f"r{i % 7}", block_id=i) for i in range(500)]
        sent += [BlockReleased(ts_ns=1000 + i, request_id=f"r{i % 7}", block_id=i, cached=i % 2 == 0)
                 for i in range(500)]
        for ev in sent:
            live.record(ev)
        live.flush()
        wait_for(lambda: len(got.events) >= len(sent), timeout_s=30,  # all, however slow the machine
                 what=f"all {len(sent)} events")
        stream.close(drain_s=0.0)
    finally:
        live.close()
    assert stream.header.engine == "transformers-cb" and stream.header.block_size_tokens == 16
    assert got.events == sent and stream.bad_lines == 0


def test_pyspy_is_found_beside_the_interpreter_without_an_activated_environment():
    """pipx and service managers run kvdiag from a virtual environment that is not on PATH:
    py-spy, installed beside it as a dependency, must still be found."""
    import os

    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    assert os.access(beside, os.X_OK), "py-spy is a dependency: pip puts it beside the interpreter"
    code = "from kvdiag.collectors.pyspy import pyspy_binary; print(pyspy_binary())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == beside, out.stderr


def test_missing_pyspy_makes_phases_na_without_a_traceback(tmp_path):
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    out = tmp_path / "x.jsonl"
    code = ("import sys, kvdiag.collectors.pyspy as p; p.pyspy_binary = lambda: None\n"
            "from kvdiag.cli import main\n"
            f"sys.exit(main(['attach', '{target.pid}', '--duration', '3', '--out', {str(out)!r}, '--json', '--any-process']))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    finally:
        target.kill()
        target.wait()
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    statuses = [e for e in read_log(out).frame("collector_status").itertuples() if e.collector == "py-spy"]
    assert statuses and not statuses[0].available and "py-spy not found" in statuses[0].hint
    assert read_log(out).frame("phase_profile").empty
