"""The attach summary over the recorded demo log (checked against direct counts of its events)
and over constructed NVML/phase events with a known answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.diagnosis.attach_summary import summarize
from kvdiag.events.eventlog import iter_events, read_header
from kvdiag.events.schema import NvmlSample, PhaseProfile, RequestFinished

DEMO = Path(__file__).parent.parent / "data" / "demo_small" / "demo_24req_seed1.kvlog.gz"


def test_summary_of_the_recorded_demo_log():
    events = list(iter_events(DEMO))
    s = summarize(events, read_header(DEMO))
    tags = [e.__struct_config__.tag for e in events]
    kv = s["kv"]
    assert kv["blocks_allocated"] == tags.count("block_allocated")
    assert kv["prefix_hits"] == tags.count("prefix_hit")
    assert kv["requests_finished"] == tags.count("request_finished")
    fin = [e for e in events if isinstance(e, RequestFinished)]
    assert s["hit_rate"]["token_hit_rate"] == pytest.approx(
        sum(e.cached_prompt_tokens for e in fin) / sum(e.prompt_tokens for e in fin))
    info = next(e for e in events if e.__struct_config__.tag == "kv_pool_info")
    last = max((e for e in events if e.__struct_config__.tag == "kv_pool_sample"), key=lambda e: e.ts_ns)
    assert s["memory"]["kv_pool_bytes"] == info.num_blocks * info.block_bytes
    assert s["memory"]["kv_cached_bytes"] == last.blocks_cached * info.block_bytes
    assert {f["rule"] for f in s["findings"]} == {"leak.finished_holding", "leak.double_release", "leak.pool_growth",
                                                  "fragmentation.kv_pool", "fragmentation.allocator",
                                                  "sharing.consistency"}


def test_tokens_per_joule_and_pooled_phases():
    events = [NvmlSample(ts_ns=1, device=0, energy_mj=1000), NvmlSample(ts_ns=9, device=0, energy_mj=3000),
              NvmlSample(ts_ns=1, device=1, energy_mj=0), NvmlSample(ts_ns=9, device=1, energy_mj=2000),
              RequestFinished(ts_ns=5, request_id="a", prompt_tokens=10, output_tokens=200),
              PhaseProfile(ts_ns=2, pid=1, window_ns=1, num_samples=100, shares={"attention": 0.5, "idle": 0.5},
                           top_functions=[("f", 0.5)]),
              PhaseProfile(ts_ns=3, pid=1, window_ns=1, num_samples=300, shares={"idle": 1.0})]
    s = summarize(events)
    assert s["efficiency"]["tokens_per_joule"] == pytest.approx(200 / 4.0)
    assert s["phases"]["samples"] == 400
    assert s["phases"]["shares"] == pytest.approx({"idle": 350 / 400, "attention": 50 / 400})
    assert s["phases"]["top_functions"] == [["f", pytest.approx(50 / 400)]]
