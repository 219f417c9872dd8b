"""`kvdiag attach` must observe the target, never itself, and never disturb the target: an
ancestor of kvdiag (a container's PID 1, the shell that launched it) as target leaves kvdiag's
own processes out of the tree, the RSS sums and the py-spy profiles; a bad PID is a one-line
error with a documented exit code; attach sends the target no signal, py-spy never stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from kvdiag.cli import main
from kvdiag.collectors import pyspy
from kvdiag.events.eventlog import read_log

# the ancestor: starts a busy Python sibling, then kvdiag attach on itself (its own parent)
# from a child that keeps a thread busy in a function whose name marks kvdiag's own stacks
ANCESTOR = textwrap.dedent("""
    import os, subprocess, sys
    folder = sys.argv[1]
    sib = subprocess.Popen([sys.executable, "-c", "import time\\ndef sibling_busy():\\n"
                            "    end = time.monotonic() + 60\\n    while time.monotonic() < end: sum(range(1000))\\n"
                            "sibling_busy()"])
    open(os.path.join(folder, "sibling.pid"), "w").write(str(sib.pid))
    try:
        code = subprocess.call([sys.executable, "-c", sys.argv[2], folder])
    finally:
        sib.kill()
        sib.wait()
    sys.exit(code)
""")
KVDIAG_CHILD = textwrap.dedent("""
    import os, sys, threading
    folder = sys.argv[1]
    open(os.path.join(folder, "kvdiag.pid"), "w").write(str(os.getpid()))
    stop = threading.Event()
    def kvdiag_self_busy():
        while not stop.is_set(): sum(range(1000))
    threading.Thread(target=kvdiag_self_busy, daemon=True).start()
    from kvdiag.cli import main
    code = main(["attach", str(os.getppid()), "--duration", "4", "--pyspy-window", "3",
                 "--pyspy-rate", "50", "--interval", "0.5", "--out", os.path.join(folder, "a.jsonl"), "--json",
                 "--any-process"])
    stop.set()
    sys.exit(code)
""")


# a container: the ancestor is PID 1 of a new PID namespace with its own /proc (needs root,
# as CI runs; a machine without it fails this test rather than skipping it)
NAMESPACE = ["unshare", "--fork", "--pid", "--mount-proc"]


@pytest.mark.parametrize("container", [[], NAMESPACE], ids=["ancestor", "pid-namespace-init"])
def test_attach_to_an_ancestor_leaves_kvdiag_itself_out(tmp_path, container):
    r = subprocess.run([*container, sys.executable, "-c", ANCESTOR, str(tmp_path), KVDIAG_CHILD],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    kvdiag_pid = int((tmp_path / "kvdiag.pid").read_text())
    sibling_pid = int((tmp_path / "sibling.pid").read_text())
    log = read_log(tmp_path / "a.jsonl")
    assert log.header.pid == 1 if container else log.header.pid != 1
    pids = set(log.frame("process_sample")["pid"])
    assert kvdiag_pid not in pids and log.header.pid in pids and sibling_pid in pids
    summary = json.loads(r.stdout)
    assert summary["memory"]["processes"] == 2  # the ancestor and its busy sibling
    hot = [fn for fns in log.frame("phase_profile")["top_functions"] for fn, _ in fns]
    assert any(fn.startswith("sibling_busy") for fn in hot), hot  # the tree is profiled...
    assert not any(fn.startswith("kvdiag_self_busy") for fn in hot), hot  # ...but not kvdiag


def test_pyspy_stacks_of_excluded_processes_are_dropped():
    raw = ('process 10:"bash -c x";process 11:"python\nkvdiag attach 10";thread (1);'
           'kvdiag_self_busy (<string>:4) 7\n'
           'process 10:"bash -c x";process 12:"python sib";thread (2);sibling_busy (<string>:3) 5\n'
           'process 10:"bash";main (x.py:1) 2\n')
    assert pyspy.parse_raw(raw, exclude_pids={11}) == {("sibling_busy (<string>:3)",): 5, ("main (x.py:1)",): 2}
    assert sum(pyspy.parse_raw(raw).values()) == 14


@pytest.mark.parametrize("pid,code,message", [
    ("-5", 2, "PID -5 is not a process id: expected an integer from 1 to "),
    ("0", 2, "PID 0 is not a process id: expected an integer from 1 to "),
    ("12abc", 2, "PID '12abc' is not a process id: expected an integer from 1 to "),
    (str(2**70), 2, f"PID {2**70} is not a process id: expected an integer from 1 to "),
])
def test_bad_pids_are_one_line_errors(tmp_path, capsys, pid, code, message):
    assert main(["attach", pid, "--duration", "1", "--out", str(tmp_path / "x.jsonl")]) == code
    err = capsys.readouterr().err
    assert err.startswith(f"kvdiag attach: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "x.jsonl").exists()


def test_missing_and_own_pid(tmp_path, capsys):
    from kvdiag.commands.attach import pid_max

    gone = next(p for p in range(pid_max(), 1, -1) if not psutil.pid_exists(p))
    assert main(["attach", str(gone), "--out", str(tmp_path / "x.jsonl")]) == 1
    assert capsys.readouterr().err == f"kvdiag attach: no process with PID {gone}\n"
    assert main(["attach", str(os.getpid()), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert capsys.readouterr().err == f"kvdiag attach: PID {os.getpid()} is kvdiag itself\n"
    assert not (tmp_path / "x.jsonl").exists()


def test_attach_never_signals_nor_stops_the_target(tmp_path, monkeypatch):
    """An in-process attach to a real Python child, with os.kill, killpg and pthread_kill
    recording their calls and Popen recording command lines; a thread watches the target's
    /proc status meanwhile: never traced (TracerPid 0), never stopped (state T or t)."""
    target = subprocess.Popen([sys.executable, "-c", "def work():\n    while True: sum(range(1000))\nwork()"])
    kills, argvs, states = [], [], []
    real_kill, real_killpg, real_popen = os.kill, os.killpg, subprocess.Popen
    monkeypatch.setattr(os, "kill", lambda pid, sig: (kills.append(pid), real_kill(pid, sig))[1])
    monkeypatch.setattr(os, "killpg", lambda pg, sig: (kills.append(-pg), real_killpg(pg, sig))[1])
    monkeypatch.setattr(signal, "pthread_kill", lambda *a: kills.append(a))

    class Recorded(real_popen):
        def __init__(self, args, *a, **k):
            argvs.append([str(x) for x in args])
            super().__init__(args, *a, **k)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    done = threading.Event()

    def watch():
        while not done.wait(0.005):
            try:
                status = open(f"/proc/{target.pid}/status").read()
            except OSError:
                return
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            states.append((fields["State"].split()[0], fields["TracerPid"].strip()))

    watcher = threading.Thread(target=watch)
    watcher.start()
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = main(["attach", str(target.pid), "--duration", "3", "--pyspy-window", "2", "--pyspy-rate", "50",
                     "--interval", "0.5", "--out", str(tmp_path / "x.jsonl"), "--json", "--any-process"])
    finally:
        done.set()
        watcher.join(timeout=10)
        monkeypatch.undo()  # what follows is the test's own clean-up
        alive = target.poll() is None
        target.kill()
        target.wait()
    assert code == 0 and alive
    assert signal.getsignal(signal.SIGTERM) is before  # attach restores the handler it set
    spies = [a for a in argvs if os.path.basename(a[0]) == "py-spy"]
    assert {a[1] for a in spies} == {"dump", "record"}, argvs
    assert all("--nonblocking" in a for a in spies), spies
    assert target.pid not in kills and all(isinstance(k, int) and k > 0 for k in kills), kills
    # Stopped is T (a signal) or t (a tracer). D is a short wait inside the kernel, e.g. the
    # target's own mmap or munmap queued behind the memory-map lock that py-spy's process_vm_readv
    # holds while it reads: the target runs on when the read ends. CI sampled it once (1 of 579).
    assert len(states) > 100 and {s for s, _ in states} <= {"R", "S", "D"} and {t for _, t in states} == {"0"}, \
        sorted(set(states))
    assert not read_log(tmp_path / "x.jsonl").frame("phase_profile").empty
