"""Host memory on the embedded default target: the in-process agent samples its own process
(RSS every interval, PSS and swap from smaps_rollup), checked against /proc read here
independently; the samples make ``leak.memory_growth`` evaluate, the Memory panel's view and
the report's "memory by source" show them."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

from kvdiag.events import schema as s
from kvdiag.collectors.procfs import ProcessSampler
from kvdiag.events.sinks import ListSink

MIB = 1 << 20


def _proc_kib(path: str, key: str) -> int:
    """``key:  N kB`` of a /proc file, in bytes: the reference the agent is checked against."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"{key} not in {path}")


def _touched(n_bytes: int) -> mmap.mmap:
    """``n_bytes`` of new resident memory: an anonymous mapping (fresh pages, whatever the
    process's allocator kept from earlier tests) with every page written."""
    buf = mmap.mmap(-1, n_bytes)
    buf[::mmap.PAGESIZE] = b"\x01" * len(range(0, n_bytes, mmap.PAGESIZE))
    return buf


def _rss_samples(events, pid: int) -> list[s.ProcessSample]:
    return [e for e in events if isinstance(e, s.ProcessSample) and e.pid == pid]


def test_agent_records_its_own_rss_and_growth(tmp_path):
    from kvdiag.agent import Agent
    from kvdiag.events.eventlog import read_log

    log_path = tmp_path / "agent.kvlog"
    agent = Agent(log_path=str(log_path), live=False, sample_interval_s=0.05,
                  shadow_sharing=False).start()
    try:
        sampler = agent.host_sampler
        assert sampler.wait_attempts(4, timeout_s=30)  # the start's sample and 3 more
        before_ns = time.time_ns()
        rss_before = _proc_kib("/proc/self/status", "VmRSS")
        leak = _touched(256 * MIB)
        rss_after = _proc_kib("/proc/self/status", "VmRSS")
        after_ns = time.time_ns()
        assert sampler.wait_attempts(4, timeout_s=30)  # one may have begun before after_ns
        rss_end = _proc_kib("/proc/self/status", "VmRSS")
        end_ns = time.time_ns()
    finally:
        agent.stop()
    assert agent.host_sampler is None
    ps = read_log(log_path, strict=True).frame(s.ProcessSample)
    ps = ps[ps["pid"] == os.getpid()].sort_values("ts_ns")
    early = ps[ps["ts_ns"] <= before_ns]["rss_bytes"].to_numpy()
    late = ps[(ps["ts_ns"] >= after_ns) & (ps["ts_ns"] <= end_ns)]["rss_bytes"].to_numpy()
    assert len(early) >= 3 and len(late) >= 3, "a sample every 50 ms"
    # each recorded RSS lies within what /proc/self/status said around it
    assert abs(float(np.median(early)) - rss_before) < 16 * MIB
    assert abs(float(np.median(late)) - (rss_after + rss_end) / 2) < 16 * MIB
    # the known allocation shows up as growth of the recorded RSS
    assert float(np.median(late) - np.median(early)) == pytest.approx(256 * MIB, rel=0.1)
    del leak


def test_pss_and_swap_against_smaps_rollup():
    sink = ListSink()
    sampler = ProcessSampler.of_self(sink, interval_s=0.05, pss_budget_frac=1.0)  # read every time
    keep = _touched(128 * MIB)
    pss_before = _proc_kib("/proc/self/smaps_rollup", "Pss")
    swap_before = _proc_kib("/proc/self/smaps_rollup", "Swap")
    sampler.sample_now()
    pss_after = _proc_kib("/proc/self/smaps_rollup", "Pss")
    (ev,) = sink.events
    assert ev.pid == os.getpid() and ev.pss_bytes is not None and ev.swap_bytes is not None
    assert min(pss_before, pss_after) - 8 * MIB <= ev.pss_bytes <= max(pss_before, pss_after) + 8 * MIB
    assert ev.swap_bytes == pytest.approx(swap_before, abs=8 * MIB)
    assert ev.pss_bytes >= 128 * MIB  # the private pages just written count in full
    del keep


class _Broken:
    pid = 0

    def sample(self):
        raise OSError("procfs went away")


class _RaisingSink(ListSink):
    def record(self, event):
        if isinstance(event, s.ProcessSample):
            raise RuntimeError("sink full")
        super().record(event)


def test_sampler_never_raises_and_reports_errors_once():
    sink = ListSink()
    sampler = ProcessSampler(_Broken(), sink, interval_s=0.01).start()
    assert sampler.wait_attempts(3, timeout_s=30)
    sampler.stop()
    assert sampler.error_count == sampler.attempts >= 4  # every sampling failed, none raised
    errors = [e for e in sink.events if isinstance(e, s.CollectorError)]
    assert len(errors) == 1 and errors[0].collector == "procfs" and "procfs went away" in errors[0].message
    # a sink that raises on a sample is counted too, and the sampler goes on
    bad = _RaisingSink()
    sampler = ProcessSampler.of_self(bad, interval_s=0.01)
    sampler.sample_now()
    sampler.sample_now()
    assert sampler.error_count == 2
    assert [e.collector for e in bad.events] == ["procfs"]


def test_pss_reads_stay_within_budget():
    sampler = ProcessSampler.of_self(ListSink(), interval_s=0.0, pss_budget_frac=0.01)
    keep = _touched(128 * MIB)
    start = time.perf_counter()
    n = 0
    reads = 0
    while time.perf_counter() - start < 0.5:
        (ev,) = sampler.collector.sample()
        n += 1
        reads += ev.pss_bytes is not None
    del keep
    # smaps_rollup walks the page tables: far fewer reads than RSS samples
    assert reads >= 1 and reads < n / 5, (reads, n)


ENGINE_WITH_LEAK = """
import mmap, os, sys

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvdiag.agent import Agent

model_dir, log_path = sys.argv[1:3]
torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained(model_dir)
model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                ["input_ids"]) for q in ("What is the capital of France?", "Name a prime number.")]
cfg = ContinuousBatchingConfig(page_size=32, num_blocks=64, allow_block_sharing=True)
gen = GenerationConfig(max_new_tokens=4, do_sample=False)
agent = Agent(log_path=log_path, live=False, sample_interval_s=0.05, shadow_sharing=False,
              model=model_dir).start()
try:
    model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cfg,
                         persistent_manager=True)
    assert agent.host_sampler.wait_attempts(3, timeout_s=60)  # samples before the leak
    leak = mmap.mmap(-1, 400 << 20)  # a host leak while serving, after the first engine step
    leak[::mmap.PAGESIZE] = b"\\x01" * len(range(0, 400 << 20, mmap.PAGESIZE))
    model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cfg,
                         persistent_manager=True)
    assert agent.host_sampler.wait_attempts(3, timeout_s=60)  # and after it
finally:
    agent.stop()
print(os.getpid())
"""
"""The embedded engine with the agent in its own process, which plants a 400 MiB host leak
between two batches: a process of its own, so that memory a pytest process frees from earlier
tests meanwhile (seen: -555 MB) is not in the growth the rule measures."""


@pytest.mark.model
@pytest.mark.slow
def test_in_process_engine_log_feeds_doctor_top_and_report(tmp_path, model_dir):
    import subprocess
    import sys

    from kvdiag.diagnosis import leak_rules
    from kvdiag.diagnosis.frames import load
    from kvdiag.events.eventlog import iter_events
    from kvdiag.live.state import LiveState
    from kvdiag.reports import section_memory

    log_path = tmp_path / "engine.kvlog"
    child = subprocess.run([sys.executable, "-c", ENGINE_WITH_LEAK, str(model_dir), str(log_path)],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    pid = int(child.stdout.split()[-1])

    logs = load([log_path])[0]
    f = leak_rules.memory_growth(logs)
    assert f.status != "n/a", f.message
    assert f.evidence["source"] == "host RSS"
    # the rule sees the 400 MiB the test held (the KV pool's growth is small beside it)
    assert f.evidence["memory_growth_bytes"] == pytest.approx(400 * MIB, rel=0.2)
    assert f.status == "fail", f.message

    events = list(iter_events(log_path))
    last_ps = _rss_samples(events, pid)[-1]
    info = next(e for e in events if isinstance(e, s.KVPoolInfo))
    pool = [e for e in events if isinstance(e, s.KVPoolSample)][-1]
    state = LiveState()
    state.set_header(logs.headers[logs.nodes[0]])
    state.feed_all(events)
    m = state.snapshot(max(e.ts_ns for e in events)).memory
    assert m.host_rss_bytes == last_ps.rss_bytes
    assert m.nvml_used_bytes is None and m.allocator_reserved_bytes is None  # a CPU target
    held = (pool.blocks_used + pool.blocks_cached) * info.block_bytes
    assert m.kv_pool_rss_share == pytest.approx(held / last_ps.rss_bytes)
    assert m.kv_pool_total_rss_share == pytest.approx(info.num_blocks * info.block_bytes / last_ps.rss_bytes)
    assert m.host_pss_bytes is not None and 0 < m.host_pss_bytes <= 1.05 * m.host_rss_bytes

    sec = section_memory.memory(logs, int(logs.frame(s.ProcessSample)["ts_ns"].min()))
    chart = next(b for b in sec.blocks if getattr(b, "title", "") == "Memory by source")
    names = set(chart.data["series"])
    assert any(n.startswith(f"host rss pid {pid}") for n in names), names
    assert any(n.startswith(f"host pss pid {pid}") for n in names), names
