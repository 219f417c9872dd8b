"""Analyses on a log recorded from a real vLLM server (tests/data/vllm_demo), without a server:
vLLM's own counters, kvdiag's plugin events, the shadow cache, replay and the doctor agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.diagnosis import doctor
from kvdiag.diagnosis.frames import load
from kvdiag.simulation.sharing import simulate
from kvdiag.traces.kv_event_traces import kv_event_gaps
from kvdiag.traces.loaders import load_trace
from kvdiag.events.eventlog import iter_events, read_header
from kvdiag.pool.prefix_cache import prefix_cache_counts
from kvdiag.events.schema import (EngineMetrics, KVPoolInfo, PrefixCacheStored, RequestFinished,
                           ShadowSharing)

DATA = Path(__file__).parent.parent / "data" / "vllm_demo"
LOG = DATA / "demo_16req_seed1.kvlog.gz"
RAW = DATA / "demo_16req_seed1.kvevents.jsonl"


@pytest.fixture(scope="module")
def events():
    return list(iter_events(LOG))


def test_plugin_requests_add_up_to_vllms_counters(events):
    finished = [e for e in events if isinstance(e, RequestFinished)]
    last = [e for e in events if isinstance(e, EngineMetrics)][-1]
    assert len(finished) == 16
    assert sum(e.prompt_tokens for e in finished) == last.prefix_cache_queries_tokens == 6778
    assert sum(e.cached_prompt_tokens for e in finished) == last.prefix_cache_hits_tokens == 3968


def test_shadow_at_vllms_settings_equals_the_engine_and_replay(events):
    info = [e for e in events if isinstance(e, KVPoolInfo)][-1]
    assert (info.block_size_tokens, info.num_blocks) == (128, 181)
    final = [e for e in events if isinstance(e, ShadowSharing)
             and (e.block_size_tokens, e.capacity_blocks) == (128, 181)][-1]
    assert final.requests == 16
    assert final.token_hit_rate == pytest.approx(3968 / 6778, abs=1e-12) == final.engine_hit_rate
    # replaying the recorded prompts offline gives what the live check gave
    trace = load_trace(LOG, block_size_tokens=128)
    offline = simulate(trace, "lru", 181)
    assert offline.token_hit_rate == pytest.approx(final.token_hit_rate, abs=1e-12)


def test_doctor_on_real_vllm_data():
    logs, problems = load([LOG])
    assert problems == []
    findings = {f.rule: f for f in doctor.run_rules(logs)[0]}
    assert findings["sharing.consistency"].status == "pass"
    assert findings["sharing.consistency"].evidence["gap"] == pytest.approx(0.0, abs=1e-12)
    assert findings["kv_events.gaps"].status == "pass"
    assert findings["leak.release_paths"].status == "pass"
    assert not [f for f in findings.values() if f.status == "fail"]
    assert read_header(LOG).engine == "vllm"


def test_raw_kv_event_stream_replays_like_the_live_subscriber(events, tmp_path):
    """The raw stream and the PrefixCacheStored events the subscriber recorded live are the
    same stream: same counts, no gap; a batch cut out of the raw stream is found."""
    live = prefix_cache_counts(e for e in events if isinstance(e, PrefixCacheStored))
    trace = load_trace(RAW, format="vllm", block_size_tokens=128)
    assert kv_event_gaps(RAW) == []
    assert live.stored_blocks == sum(len(e.block_hashes) for e in events if isinstance(e, PrefixCacheStored)) == 17
    assert f"{live.stored_blocks} blocks stored, {live.duplicate_stores} of them already cached" in " ".join(trace.notes)
    lines = RAW.read_text().splitlines(True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:4] + lines[5:]))
    gaps = kv_event_gaps(cut)
    assert [(g.first_seq, g.last_seq, g.lost_batches) for g in gaps] == [(4, 4, 1)]
