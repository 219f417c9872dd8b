"""Fragmentation of hand-built snapshots in torch's documented structure (torch/cuda/memory.py:
Snapshot -> segments -> blocks; device_traces), checked against known answers, a byte-level
brute-force oracle (property test) and torch's own ``_memory_viz.segsum`` accounting."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from kvdiag.diagnosis import fragmentation as fr
from kvdiag.diagnosis import pool_fragmentation as pf

MiB = 1 << 20


def make_segment(address: int, blocks: list[tuple[int, int, str]], *, segment_type="large",
                 stream=0, pool_id=(0, 0), device=0) -> dict:
    """A Segment dict; ``blocks`` are (size, requested_size, state) in address order."""
    out, cursor = [], address
    for size, requested, state in blocks:
        out.append({"size": size, "requested_size": requested, "address": cursor, "state": state,
                    "frames": []})
        cursor += size
    return {"address": address, "total_size": cursor - address, "stream": stream,
            "segment_type": segment_type, "segment_pool_id": pool_id, "device": device,
            "allocated_size": sum(b["size"] for b in out if b["state"] == fr.ALLOCATED),
            "active_size": sum(b["size"] for b in out if b["state"] != fr.INACTIVE),
            "requested_size": sum(b["requested_size"] for b in out if b["state"] == fr.ALLOCATED),
            "blocks": out}


A, F = fr.ALLOCATED, fr.INACTIVE
BASE = 0x7F0000000000


def known_snapshot() -> dict:
    """Large segment (20 MiB): alloc 2 | free 6 | alloc 2 | free 6 | alloc 4 (MiB): free 12 MiB
    in two 6 MiB runs -> external fragmentation 1 - 6/12 = 0.5; 8 MiB cannot be served.
    Small segment (2 MiB): alloc 0.5 | free 1.5 MiB, one free run -> 0."""
    large = make_segment(BASE, [(2 * MiB, 2 * MiB - 100, A), (6 * MiB, 6 * MiB, F),
                                (2 * MiB, 2 * MiB, A), (6 * MiB, 6 * MiB, F), (4 * MiB, 3 * MiB, A)])
    small = make_segment(BASE + 64 * MiB, [(MiB // 2, MiB // 2, A), (3 * MiB // 2, 0, F)],
                         segment_type="small")
    mid = BASE + 8 * MiB
    trace = [
        {"action": "segment_alloc", "addr": BASE, "size": 20 * MiB, "stream": 0, "frames": []},
        {"action": "alloc", "addr": mid, "size": 2 * MiB, "stream": 0, "time_us": 42,
         "frames": [{"filename": "engine.py", "line": 7, "name": "grow_cache"}]},
    ]
    return {"segments": [large, small], "device_traces": [trace]}


def test_known_answer_per_segment_pool_device():
    snap = known_snapshot()
    seg = fr.segment_frame(snap)
    large = seg[seg["pool"] == "large"].iloc[0]
    assert large["reserved_bytes"] == 20 * MiB
    assert large["allocated_bytes"] == 8 * MiB
    assert large["slack_bytes"] == 12 * MiB
    assert large["rounding_bytes"] == 100 + MiB
    assert large["free_bytes"] == 12 * MiB and large["largest_free_bytes"] == 6 * MiB
    assert large["external_fragmentation"] == pytest.approx(0.5)
    assert large["inactive_split_bytes"] == 12 * MiB
    small = seg[seg["pool"] == "small"].iloc[0]
    assert small["external_fragmentation"] == 0.0
    dev = fr.device_frame(snap).iloc[0]
    assert dev["reserved_bytes"] == 22 * MiB
    assert dev["free_bytes"] == 12 * MiB + 3 * MiB // 2
    assert dev["external_fragmentation"] == pytest.approx(1 - 6 / 13.5)


def test_unservable_size_classes_known_answer():
    un = fr.unservable_size_classes(known_snapshot())
    assert list(un["size_class_bytes"]) == [8 * MiB]
    assert list(un["pool"]) == ["large"]


def test_fragmenting_allocation_named_from_trace():
    frag = fr.fragmenting_allocations(known_snapshot())
    assert list(frag["block_address"]) == [BASE + 8 * MiB]
    row = frag.iloc[0]
    assert row["free_bytes_before"] == 6 * MiB and row["free_bytes_after"] == 6 * MiB
    assert row["trace_index"] == 1 and row["frame"] == "engine.py:7 grow_cache"
    trace = fr.trace_frame(known_snapshot())
    assert list(trace["action"]) == ["segment_alloc", "alloc"] and trace.loc[1, "size_bytes"] == 2 * MiB


def test_whole_free_segment_is_not_inactive_split():
    snap = {"segments": [make_segment(BASE, [(2 * MiB, 0, F)])]}
    row = fr.segment_frame(snap).iloc[0]
    assert row["inactive_split_bytes"] == 0 and row["external_fragmentation"] == 0.0


def test_pools_and_streams_are_separate():
    a = make_segment(BASE, [(4 * MiB, 0, F), (2 * MiB, 2 * MiB, A)])
    b = make_segment(BASE + 32 * MiB, [(4 * MiB, 0, F), (2 * MiB, 2 * MiB, A)], stream=7)
    pools = fr.pool_frame({"segments": [a, b]}).set_index("pool")
    assert set(pools.index) == {"large", "large@stream 7"}
    assert (pools["external_fragmentation"] == 0).all()
    # over the device the two free runs are apart
    assert fr.device_frame({"segments": [a, b]}).iloc[0]["external_fragmentation"] == pytest.approx(0.5)


def test_invariants_are_asserted():
    seg = make_segment(BASE, [(2 * MiB, 0, A), (2 * MiB, 0, F)])
    seg["total_size"] += 512
    with pytest.raises(fr.SnapshotInvariantError, match="reserves"):
        fr.segment_frame({"segments": [seg]})
    seg = make_segment(BASE, [(2 * MiB, 0, A), (2 * MiB, 0, F)])
    seg["allocated_size"] = 1
    with pytest.raises(fr.SnapshotInvariantError, match="allocated_size"):
        fr.segment_frame({"segments": [seg]})
    seg = make_segment(BASE, [(2 * MiB, 0, A), (2 * MiB, 0, F)])
    seg["blocks"][1]["address"] += 512
    with pytest.raises(fr.SnapshotInvariantError, match="does not follow"):
        fr.segment_frame({"segments": [seg]})


def test_torch_memory_viz_accepts_and_agrees():
    """torch's own segsum reads the hand-built snapshot and checks free + allocated == reserved."""
    from torch.cuda import _memory_viz
    text = _memory_viz.segsum(known_snapshot())
    assert "segments: 2" in text


def test_finding_against_the_15_percent_rule():
    f = fr.allocator_fragmentation_finding(known_snapshot())
    assert f.rule == "fragmentation.allocator" and f.status == "warn"
    assert f.evidence["value"] == pytest.approx(1 - 6 / 13.5)
    clean = {"segments": [make_segment(BASE, [(2 * MiB, 0, A), (2 * MiB, 0, F)])]}
    assert fr.allocator_fragmentation_finding(clean).status == "pass"
    assert fr.allocator_fragmentation_finding(None).status == "n/a"


# ------------------------------------------------------------ property test vs byte oracle

UNIT = 512
block_st = st.tuples(st.integers(1, 8), st.sampled_from([A, F, fr.AWAITING]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(block_st, min_size=1, max_size=8), min_size=1, max_size=4))
def test_property_matches_byte_level_oracle(segments):
    """Property test (synthetic segments): external fragmentation and unservable classes equal
    a brute force over a per-byte-unit bitmap of free memory."""
    segs, addr = [], BASE
    for blocks in segments:
        segs.append(make_segment(addr, [(n * UNIT, n * UNIT, s) for n, s in blocks]))
        addr += 1 << 30
    snap = {"segments": segs}
    # oracle: longest run of free units within each segment, total free units
    longest = total = 0
    for blocks in segments:
        bitmap = [s == F for n, s in blocks for _ in range(n)]
        run = 0
        for bit in bitmap:
            run = run + 1 if bit else 0
            longest = max(longest, run)
        total += sum(bitmap)
    dev = fr.device_frame(snap).iloc[0]
    assert dev["free_bytes"] == total * UNIT
    assert dev["largest_free_bytes"] == longest * UNIT
    expect = 0.0 if total == 0 else 1 - longest / total
    assert dev["external_fragmentation"] == pytest.approx(expect)
    want = [s for s in (UNIT << k for k in range(40)) if longest * UNIT < s <= total * UNIT]
    assert list(fr.unservable_size_classes(snap)["size_class_bytes"]) == want


# ------------------------------------------------------------ KV pool


def test_kv_pool_occupancy_and_rule():
    import pandas as pd
    samples = pd.DataFrame([
        {"ts_ns": 1, "num_blocks": 10, "blocks_used": 4, "blocks_cached": 1, "blocks_free": 5,
         "tokens_held": 100, "running_requests": 2},
        {"ts_ns": 2, "num_blocks": 10, "blocks_used": 0, "blocks_cached": 0, "blocks_free": 10,
         "tokens_held": 0, "running_requests": 0},
    ])
    pool = pf.kv_pool_frame(samples, block_size_tokens=32, bytes_per_token=10)
    assert pool.loc[0, "empty_slots_tokens"] == 28 and pool.loc[0, "empty_slots_bytes"] == 280
    assert pool.loc[0, "token_occupancy"] == pytest.approx(100 / 128)
    assert pool.loc[0, "block_occupancy"] == pytest.approx(0.4)
    f = pf.kv_pool_fragmentation_finding(pool)
    assert f.rule == "fragmentation.kv_pool" and f.status == "warn"
    assert f.evidence["value"] == pytest.approx(28 / 128)
    # more tokens than slots contradicts the definition: N/A, never a negative share
    over = pf.kv_pool_frame(samples.assign(tokens_held=[200, 0]), block_size_tokens=32)
    assert pd.isna(over.loc[0, "empty_slots_tokens"]) and pd.isna(over.loc[0, "token_occupancy"])
    assert pf.kv_pool_fragmentation_finding(over).status == "n/a"


def test_replay_free_list():
    from kvdiag.events.schema import BlockAllocated, BlockEvicted, BlockReleased, KVPoolInfo, PrefixHit
    evs = [KVPoolInfo(ts_ns=0, num_blocks=8, block_size_tokens=4, block_bytes=1, num_layers=1,
                      num_kv_heads=1, head_dim=1, dtype="f32")]
    evs += [BlockAllocated(ts_ns=1, request_id="a", block_id=b) for b in (0, 2, 4)]
    evs += [BlockReleased(ts_ns=2, request_id="a", block_id=0, cached=True),
            BlockReleased(ts_ns=2, request_id="a", block_id=2),
            PrefixHit(ts_ns=3, request_id="b", block_id=0), BlockAllocated(ts_ns=3, request_id="b", block_id=6)]
    s = pf.replay_free_list(evs)
    # busy: 0 (b), 4 (a), 6 (b) -> free 1,2,3,5,7: longest run 1..3 = 3
    assert (s.used_blocks, s.cached_blocks, s.free_blocks, s.longest_free_run_blocks) == (3, 0, 5, 3)
    assert s.free_list_fragmentation == pytest.approx(1 - 3 / 5)
    s2 = pf.replay_free_list(evs + [BlockReleased(ts_ns=4, request_id="b", block_id=0, cached=True),
                                    BlockEvicted(ts_ns=5, block_id=0)])
    assert s2.free_blocks == 6 and s2.cached_blocks == 0
    # ids offset by 2 (transformers' trash pages): same answer with every id shifted
    shifted = [e if not hasattr(e, "block_id") else msgspec.structs.replace(e, block_id=e.block_id + 2)
               for e in evs + [BlockAllocated(ts_ns=6, request_id="c", block_id=7)]]
    s3 = pf.replay_free_list(shifted)
    s4 = pf.replay_free_list(evs + [BlockAllocated(ts_ns=6, request_id="c", block_id=7)])
    assert s3 == s4


def _live_cuda_snapshot(tmp_path):
    """On a CUDA machine: a fragmenting allocation pattern (tensors of many sizes, every other
    one freed), then torch's memory_stats and snapshot of the same moment, the snapshot
    written as kvdiag writes fixtures and read back."""
    import torch
    from kvdiag.events.snapshot_io import load_snapshot, save_snapshot_json
    torch.cuda.synchronize()
    keep = [torch.empty(int(n), dtype=torch.uint8, device="cuda")
            for n in (700, 3 * 2**20 + 5, 100_000, 25 * 2**20, 511, 9 * 2**20 + 1, 4096, 2 * 2**20)]
    del keep[::2]
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats(0)
    path = save_snapshot_json(torch.cuda.memory._snapshot(), tmp_path / "snapshot.json")
    return load_snapshot(path), stats, keep


def test_cuda_snapshot_totals_equal_torchs_memory_stats(tmp_path):
    """A real CUDA allocator snapshot (taken here on a CUDA machine, else the one recorded by
    benchmarks/gpu_allocator.py when present): invariants hold and device totals equal
    torch's own memory_stats of the same moment."""
    import json
    from pathlib import Path
    import torch
    from kvdiag.events.snapshot_io import load_snapshot
    folder = Path(__file__).parent.parent / "data" / "cuda_allocator"
    if torch.cuda.is_available():
        snap, stats, _alive = _live_cuda_snapshot(tmp_path)
    elif (folder / "snapshot.json").exists():
        snap = load_snapshot(folder / "snapshot.json")
        stats = json.loads((folder / "memory_stats.json").read_text())
    else:
        pytest.skip("needs a GPU: no CUDA device here and no CUDA snapshot recorded "
                    "(benchmarks/gpu_allocator.py records one on a CUDA machine)")
    dev = fr.device_frame(snap).iloc[0]
    assert dev["reserved_bytes"] == stats["reserved_bytes.all.current"]
    assert dev["allocated_bytes"] == stats["allocated_bytes.all.current"]
    assert dev["allocated_bytes"] > 0


def test_free_list_replay_matches_the_engines_own_counters():
    """Replaying the recorded demo log's block events ends in the state the engine itself
    reported in its last KVPoolSample (free, cached and used blocks)."""
    from pathlib import Path
    from kvdiag.events.eventlog import iter_events
    from kvdiag.events.schema import KVPoolSample
    path = Path(__file__).parent.parent / "data" / "demo_small" / "demo_24req_seed1.kvlog.gz"
    events = list(iter_events(path))
    state = pf.replay_free_list(events)
    last = max((e for e in events if isinstance(e, KVPoolSample)), key=lambda e: e.ts_ns)
    assert (state.free_blocks, state.cached_blocks, state.used_blocks) == \
        (last.blocks_free, last.blocks_cached, last.blocks_used)
    assert state.cached_blocks > 0
