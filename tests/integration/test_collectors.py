"""Collectors on this machine: no CUDA, no NVML driver, a real child process for procfs and
py-spy, a real prometheus_client exposition for the parser."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import psutil
import pytest

from kvdiag.collectors import allocator, metrics, nvml, procfs, pyspy
from kvdiag.events.sinks import ListSink


def test_allocator_without_cuda_reports_once_and_emits_nothing(tmp_path):
    sink = ListSink()
    col = allocator.AllocatorCollector(sink, snapshot_dir=tmp_path, history_entries=1000)
    st = col.start()
    assert st.available is False and "CUDA" in st.hint
    assert col.sample() == [] and col.snapshot() is None
    assert sink.events == [st] and list(tmp_path.iterdir()) == []


def test_allocator_sample_from_documented_stats_keys():
    stats = {"reserved_bytes.all.current": 10, "allocated_bytes.all.current": 6,
             "active_bytes.all.current": 7, "inactive_split_bytes.all.current": 3,
             "reserved_bytes.large_pool.current": 9, "num_alloc_retries": 2, "num_ooms": 1}
    ev = allocator.sample_from_stats(stats, 0, 5)
    assert (ev.reserved_bytes, ev.allocated_bytes, ev.active_bytes, ev.inactive_split_bytes,
            ev.alloc_retries, ev.num_ooms) == (10, 6, 7, 3, 2, 1)


def test_nvml_without_driver_is_na_with_one_hint():
    col = nvml.NvmlCollector()
    st = col.start()
    assert st.available is False and "N/A" in st.hint
    assert col.sample() == []


class FakeNvml:
    """An NVML module whose power query is unsupported, as on some boards."""

    NVML_TEMPERATURE_GPU = 0

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetMemoryInfo(self, h): return SimpleNamespace(used=5, total=10)
    def nvmlDeviceGetUtilizationRates(self, h): return SimpleNamespace(gpu=40, memory=25)
    def nvmlDeviceGetPowerUsage(self, h): raise RuntimeError("Not Supported")
    def nvmlDeviceGetTotalEnergyConsumption(self, h): return 1234
    def nvmlDeviceGetTemperature(self, h, kind): return 50
    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=1, usedGpuMemory=100), SimpleNamespace(pid=2, usedGpuMemory=7)]
    def nvmlDeviceGetGraphicsRunningProcesses(self, h): return []


def test_nvml_one_failing_field_does_not_stop_others():
    col = nvml.NvmlCollector(pids=lambda: [1], nvml=FakeNvml())
    assert col.start().available
    (s,) = col.sample()
    assert s.power_mw is None and "power" in col.field_errors
    assert (s.memory_used_bytes, s.energy_mj, s.temperature_c, s.process_memory_bytes) == (5, 1234, 50, 100)
    assert (s.gpu_util_pct, s.memory_util_pct) == (40, 25)  # SM and memory-controller utilisation


BALLAST_BYTES = 40_000_000


def _proc_status(pid: int) -> dict:
    """RSS (VmRSS), thread count and user+system CPU time read from /proc directly."""
    import os
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return {"rss_bytes": int(status["VmRSS"].split()[0]) * 1024, "threads": int(status["Threads"]),
            "cpu_time_ns": ticks * 10**9 // os.sysconf("SC_CLK_TCK")}


CHILD = textwrap.dedent(f"""
    import socket, subprocess, sys, threading, time
    ballast = b"x" * {BALLAST_BYTES}  # every page written: resident
    s = socket.socket(); s.bind(("127.0.0.1", 18431)); s.listen()
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # an idle thread
    def attention_kernel():
        x = 0
        for i in range(200000): x += i
        return x
    print("ready", flush=True)
    while True:
        attention_kernel()
""")


@pytest.fixture
def target():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    kids = psutil.Process(p.pid).children(recursive=True)
    yield p
    for c in kids:
        c.kill()
    p.kill()
    p.wait()


def test_procfs_tree_ports_and_exit(target):
    col = procfs.ProcessCollector(target.pid)
    samples = col.sample()
    pids = {s.pid for s in samples}
    kids = {c.pid for c in psutil.Process(target.pid).children(recursive=True)}
    assert pids == {target.pid} | kids and len(kids) == 1
    # independent of psutil (which the collector uses): /proc read just before and just after
    before = _proc_status(target.pid)
    root = next(s for s in col.sample() if s.pid == target.pid)
    after = _proc_status(target.pid)
    assert root.rss_bytes >= BALLAST_BYTES  # the child wrote every page of its ballast
    lo, hi = sorted((before["rss_bytes"], after["rss_bytes"]))
    assert lo - (1 << 20) <= root.rss_bytes <= hi + (1 << 20)  # a steady process: within 1 MiB
    assert root.num_threads == before["threads"] == after["threads"] == 2  # main + the idle thread
    # clock ticks, bracketed (1 us of slack for the float seconds psutil goes through)
    assert before["cpu_time_ns"] - 1000 <= root.cpu_time_ns <= after["cpu_time_ns"] + 1000
    assert after["cpu_time_ns"] > 0  # it spins in attention_kernel
    assert (target.pid, "127.0.0.1", 18431) in col.listening_ports()
    target.kill()
    target.wait()
    with pytest.raises(procfs.TargetGone):
        col.sample()


def test_procfs_bad_pid():
    with pytest.raises(procfs.TargetGone, match="no process with PID"):
        procfs.open_target(2 ** 22 + 12345)


def test_pyspy_phases_of_a_real_process(target):
    rec = pyspy.PySpyRecorder(target.pid, duration_s=1, rate_hz=50)
    raw = rec.result(timeout_s=20)
    prof = pyspy.phase_profile(raw)
    assert prof.num_samples > 20
    assert math.isclose(sum(prof.shares.values()), 1.0)
    # the busy main thread is in attention_kernel; one thread waits on an Event (idle)
    assert prof.shares.get("attention", 0) > 0.3
    assert prof.shares.get("idle", 0) > 0.2
    assert any("attention_kernel" in f for f, _ in prof.top_functions)


def test_pyspy_non_python_and_gone():
    p = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(pyspy.PySpyError, match="not a Python process"):
            pyspy.dump(p.pid)
    finally:
        p.kill()
        p.wait()
    with pytest.raises(pyspy.PySpyError, match="has exited"):
        pyspy.dump(p.pid)


def test_pyspy_permission_message_is_actionable():
    msg = pyspy.explain_failure(7, "Error: Permission Denied: Try running again with elevated permissions")
    assert "root" in msg and "CAP_SYS_PTRACE" in msg and "ptrace_scope" in msg


def test_classify_known_stacks():
    c = pyspy.classify
    assert c(("run (threading.py:1)", "select (selectors.py:468)")) == "idle"
    assert c(("generate (x.py:1)", "forward (modeling_llama.py:2)",
              "eager_attention_forward (modeling_llama.py:3)")) == "attention"
    assert c(("_generation_step (continuous_api.py:1)", "free_blocks (cache.py:2)")) == "kv_cache"
    assert c(("handle (h11_impl.py:1)", "build (app.py:2)")) == "http"
    assert c(("f (a.py:1)",)) == "other"
    raw = ('process 5:"python -c x = 1\nf(a;b)";a (a.py:1);wait (threading.py:2) 3\n'
           'process 5:"python -c x = 1\nf(a;b)";process 6:"py";b (b.py:1) 2\n')
    assert dict(pyspy.parse_raw(raw)) == {("a (a.py:1)", "wait (threading.py:2)"): 3, ("b (b.py:1)",): 2}


def test_prometheus_parser_reads_what_prometheus_client_wrote():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    reg = CollectorRegistry()
    Counter("vllm:prefix_cache_queries", "q", ["model_name"], registry=reg).labels("m").inc(300)
    Counter("vllm:prefix_cache_hits", "h", ["model_name"], registry=reg).labels("m").inc(120)
    Gauge("vllm:kv_cache_usage_perc", "u", registry=reg).set(0.25)
    Gauge("weird", "w", ["path"], registry=reg).labels('a"b\\c\nd').set(2)
    Histogram("vllm:time_to_first_token_seconds", "t", buckets=(0.1, 1.0), registry=reg).observe(0.3)
    samples = metrics.parse_prometheus(generate_latest(reg).decode())
    got = {(s.name, s.labels): s.value for s in samples if not s.name.endswith("_created")}
    ttft = "vllm:time_to_first_token_seconds"
    assert got == {
        ("vllm:prefix_cache_queries_total", (("model_name", "m"),)): 300,
        ("vllm:prefix_cache_hits_total", (("model_name", "m"),)): 120,
        ("vllm:kv_cache_usage_perc", ()): 0.25,
        ("weird", (("path", 'a"b\\c\nd'),)): 2,  # escapes undone
        (f"{ttft}_bucket", (("le", "0.1"),)): 0, (f"{ttft}_bucket", (("le", "1.0"),)): 1,
        (f"{ttft}_bucket", (("le", "+Inf"),)): 1, (f"{ttft}_count", ()): 1, (f"{ttft}_sum", ()): 0.3}
    em = metrics.engine_metrics(samples)
    assert (em.prefix_cache_queries_tokens, em.prefix_cache_hits_tokens, em.kv_cache_usage) == (300, 120, 0.25)
    assert not any(k.endswith("_bucket") for k in em.raw)


def test_prometheus_parse_error_names_line():
    with pytest.raises(metrics.PrometheusParseError, match="line 2: expected"):
        metrics.parse_prometheus("ok 1\nbroken{ 2\n")
    with pytest.raises(ValueError, match="line 3: expected .*'# TYPE x bogus'"):
        metrics.parse_prometheus("# HELP x a metric\nx 1\n# TYPE x bogus\n")
