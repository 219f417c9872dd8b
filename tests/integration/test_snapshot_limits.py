"""Untrusted allocator snapshots: a small pickle that shares one container many times, one
nested far too deep, and fields out of range are refused in one line and in time linear in the
file, at load, in the summaries and through `kvdiag doctor --snapshot`; random well-formed and
malformed snapshots give a summary or the documented errors, never another exception."""

from __future__ import annotations

import json
import pickle
import time

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from kvdiag.diagnosis import fragmentation as fr
from kvdiag.cli import main
from kvdiag.events.snapshot_check import MAX_DEPTH, SnapshotFormatError, check_depth, check_snapshot
from kvdiag.events.snapshot_io import SnapshotLoadError, load_snapshot, save_snapshot_json

DOCUMENTED = (SnapshotFormatError, fr.SnapshotInvariantError)
SHARED = 10_000


def crafted_shared() -> dict:
    """10^4 references to one segment whose list holds 10^4 references to one block: 40 KB
    pickled, 10^8 blocks for a summary that follows references."""
    block = {"size": 512, "requested_size": 500, "address": 0, "state": "inactive"}
    seg = {"address": 0, "total_size": 512, "is_expandable": True, "blocks": [block] * SHARED}
    return {"segments": [seg] * SHARED}


def deep_pickle(depth: int) -> bytes:
    """{"segments": [[[...]]]} nested ``depth`` lists deep, assembled opcode by opcode
    (pickle.dumps itself would recurse): EMPTY_LIST x depth, APPEND x depth-1."""
    return b"\x80\x04}\x8c\x08segments" + b"]" * depth + b"a" * (depth - 1) + b"s."


def test_crafted_shared_snapshot_is_small_and_refused_at_once(tmp_path, capsys):
    path = tmp_path / "crafted.pickle"
    path.write_bytes(pickle.dumps(crafted_shared(), protocol=4))
    assert path.stat().st_size < 64 << 10
    start = time.perf_counter()
    assert main(["doctor", "--snapshot", str(path)]) == 2  # summarising it took ~100 s before
    took_s = time.perf_counter() - start
    assert capsys.readouterr().err == (
        f"kvdiag doctor: {path}: segments[0].blocks[1]: expected an object of its own, found the same "
        "object as segments[0].blocks[0] (a shared reference; torch never writes one)\n")
    assert took_s < 5


def test_shared_segment_or_blocks_list_is_refused_in_memory_too():
    blocks = [{"size": 512, "address": 512 * i, "state": "inactive"} for i in range(SHARED)]
    seg = {"address": 0, "total_size": 512 * SHARED, "blocks": blocks}
    start = time.perf_counter()
    with pytest.raises(SnapshotFormatError, match=r"^snapshot: segments\[1\]: expected an object of its own"):
        fr.snapshot_summary({"segments": [seg] * SHARED})
    with pytest.raises(SnapshotFormatError, match=r"^snapshot: segments\[1\]\.blocks: expected an object of its own"):
        fr.snapshot_summary({"segments": [dict(seg) for _ in range(SHARED)]})
    assert time.perf_counter() - start < 5  # 10^8 blocks to walk before


def test_shared_frames_are_allowed_and_checked_once(monkeypatch):
    """torch may share frame lists between blocks and trace entries: accepted, each distinct
    list checked once (10^4 blocks x 10^3 frames would be 10^7 frame checks otherwise)."""
    from kvdiag.events import snapshot_check

    frames = [{"filename": "engine.py", "line": i, "name": "grow"} for i in range(1000)]
    blocks = [{"size": 512, "requested_size": 500, "address": 512 * i, "state": "active_allocated" if i % 2
               else "inactive", "frames": frames} for i in range(SHARED)]
    trace = [{"action": "alloc", "addr": 512 * i, "size": 500, "time_us": i, "frames": frames} for i in range(SHARED)]
    snap = {"segments": [{"address": 0, "total_size": 512 * SHARED, "blocks": blocks}], "device_traces": [trace]}
    checked = []
    real = snapshot_check._Checker.typed
    monkeypatch.setattr(snapshot_check._Checker, "typed", lambda self, d, key, *a, **k: (
        checked.append(key), real(self, d, key, *a, **k))[1])
    check_snapshot(snap)
    assert checked.count("filename") == len(frames)
    summary = fr.snapshot_summary(snap)
    assert summary["devices"][0]["num_blocks"] == SHARED and summary["fragmenting_allocations"] == SHARED // 2 - 1


@pytest.mark.parametrize("suffix,data", [
    (".pickle", deep_pickle(100_000)),
    (".json", b'{"segments": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
])
def test_deep_snapshot_is_a_clear_error_through_the_cli(tmp_path, capsys, suffix, data):
    path = tmp_path / f"deep{suffix}"
    path.write_bytes(data)
    assert main(["doctor", "--snapshot", str(path), "--json"]) == 2
    out = capsys.readouterr()
    assert out.err == f"kvdiag doctor: {path}: snapshot nested deeper than {MAX_DEPTH} levels\n" and not out.out


def test_depth_limit_is_exact_linear_on_shared_structure_and_refuses_cycles():
    nested: list = []
    for _ in range(MAX_DEPTH - 1):
        nested = [nested]
    check_depth(nested, "x")  # MAX_DEPTH lists
    with pytest.raises(SnapshotFormatError, match=f"^x: snapshot nested deeper than {MAX_DEPTH} levels$"):
        check_depth([nested], "x")
    diamond: list = []
    for _ in range(MAX_DEPTH - 1):
        diamond = [diamond, diamond, diamond]  # 3^63 paths, 64 distinct lists
    start = time.perf_counter()
    check_depth(diamond, "x")
    with pytest.raises(SnapshotFormatError, match="deeper than"):
        check_depth({"a": diamond}, "x")
    assert time.perf_counter() - start < 5
    loop: list = []
    loop.append([loop])
    with pytest.raises(SnapshotFormatError, match="contains itself"):
        check_depth({"segments": loop}, "x")


def _snap(**block_changes) -> dict:
    block = {"size": 512, "requested_size": 500, "address": 0, "state": "inactive", **block_changes}
    return {"segments": [{"address": 0, "total_size": 512, "blocks": [block]}]}


@pytest.mark.parametrize("snap,message", [
    (_snap(size=-1), "segments[0].blocks[0].size: expected an integer in [0, 2**63), found -1"),
    (_snap(address=1 << 63), "segments[0].blocks[0].address: expected an integer in [0, 2**63), "
                             "found 9223372036854775808"),
    (_snap(size=10 ** 5000), "segments[0].blocks[0].size: expected an integer in [0, 2**63), "
                             "found an integer of 16610 bits"),
    (_snap(size=True), "segments[0].blocks[0].size: expected an integer in [0, 2**63), found True"),
    (_snap(size=1.5), "segments[0].blocks[0].size: expected an integer in [0, 2**63), found 1.5"),
    (_snap(state=None), "segments[0].blocks[0].state: expected a string, found None"),
    (_snap(frames=[{"filename": ["x"]}]), "segments[0].blocks[0].frames[0].filename: expected a string, found list"),
    ({"segments": [{"address": 0, "blocks": []}]}, "segments[0]: expected key 'total_size'"),
    ({"segments": [{"total_size": 0}]}, "segments[0]: expected key 'blocks'"),
    ({"segments": [{"total_size": 0, "blocks": {}}]}, "segments[0].blocks: expected a list, found dict"),
    ({"segments": [{"total_size": 0, "blocks": [], "segment_pool_id": [1]}]},
     "segments[0].segment_pool_id: expected a pair of integers, found list"),
    ({"segments": [], "device_traces": [[{"addr": -3}]]}, "device_traces[0][0].addr: expected an integer"),
    ({"segments": [], "device_traces": [[7]]}, "device_traces[0][0]: expected a dict, found 7"),
])
def test_out_of_range_fields_name_their_path(tmp_path, snap, message):
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps(snap))
    with pytest.raises(SnapshotLoadError) as info:
        load_snapshot(path)
    assert str(info.value).startswith(f"{path}: {message}")
    with pytest.raises(SnapshotFormatError, match="^snapshot: "):
        fr.snapshot_summary(snap)


def test_save_refuses_depth_and_converts_shared_once(tmp_path):
    with pytest.raises(SnapshotFormatError, match="deeper than"):
        save_snapshot_json({"segments": [], "x": json.loads("[" * 100 + "]" * 100)}, tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists()
    frames = [{"filename": "a.py", "line": 1, "name": "f"}]
    snap = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 1, "frames": frames}] * 1]}
    back = load_snapshot(save_snapshot_json(snap, tmp_path / "s.json"))
    assert back == snap


# ------------------------------------------------------------------ property


KEYS = ["segments", "blocks", "size", "address", "state", "total_size", "requested_size", "device", "stream",
        "segment_type", "segment_pool_id", "is_expandable", "allocated_size", "active_size", "device_traces",
        "frames", "filename", "line", "name", "action", "addr", "time_us"]
JUNK = st.one_of(
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70), st.floats(), st.text(max_size=4), st.none(),
    st.booleans(), st.binary(max_size=4), st.sampled_from([fr.ALLOCATED, fr.INACTIVE, fr.AWAITING, "small", "large"]),
    st.lists(st.integers(min_value=0, max_value=2 ** 20), max_size=3),
    st.dictionaries(st.sampled_from(KEYS), st.integers(min_value=-1, max_value=2 ** 20), max_size=3),
)


@st.composite
def snapshots(draw) -> dict:
    """Well-formed segments (blocks tiling them, states, pools, streams, traces) ..."""
    segments, address = [], 0x1000
    for _ in range(draw(st.integers(0, 4))):
        blocks, cursor = [], address
        for size in draw(st.lists(st.integers(1, 1 << 24), min_size=1, max_size=6)):
            blocks.append({"size": size, "requested_size": draw(st.integers(0, size)), "address": cursor,
                           "state": draw(st.sampled_from([fr.ALLOCATED, fr.INACTIVE, fr.AWAITING])),
                           "frames": [{"filename": "f.py", "line": 1, "name": "g"}]})
            cursor += size
        segments.append({"address": address, "total_size": cursor - address, "device": draw(st.integers(0, 1)),
                         "stream": draw(st.sampled_from([0, 7])),
                         "segment_type": draw(st.sampled_from(["large", "small"])),
                         "segment_pool_id": draw(st.sampled_from([(0, 0), (1, 2)])), "blocks": blocks})
        address = cursor + draw(st.integers(0, 1 << 20))
    traces = [[{"action": "alloc", "addr": b["address"], "size": b["size"], "time_us": 1, "frames": []}
               for s in segments for b in s["blocks"]]]
    return {"segments": segments, "device_traces": traces}


def _containers(obj) -> list:
    """Every distinct dict and list reachable from ``obj`` (mutations may make cycles)."""
    out, stack, seen = [], [obj], set()
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list)) and id(node) not in seen:
            seen.add(id(node))
            out.append(node)
            stack.extend(node.values() if isinstance(node, dict) else node)
    return out


@st.composite
def mutated(draw) -> dict:
    """... then 0-3 mutations: a field set to junk, to a plausible but inconsistent number or
    to a container elsewhere (a shared reference, possibly a cycle), a key deleted, or a value
    replaced by deep nesting."""
    snap = draw(snapshots())
    for _ in range(draw(st.integers(0, 3))):
        target = draw(st.sampled_from(_containers(snap)))
        kind = draw(st.sampled_from(["junk", "number", "share", "delete", "deep"]))
        if isinstance(target, dict):
            key = draw(st.sampled_from(sorted(set(target) | set(KEYS))))
        elif target:
            key = draw(st.integers(0, len(target) - 1))
        else:
            continue
        if kind == "delete":
            target.pop(key, None) if isinstance(target, dict) else target.pop(key)
            continue
        if kind == "junk":
            target[key] = draw(JUNK)
        elif kind == "number":
            target[key] = draw(st.integers(0, 1 << 24))
        elif kind == "share":
            target[key] = draw(st.sampled_from(_containers(snap)))
        else:
            target[key] = json.loads("[" * (MAX_DEPTH + 2) + "]" * (MAX_DEPTH + 2))
    return snap


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snap=mutated(), as_json=st.booleans(), protocol=st.integers(0, 5))
def test_random_snapshots_give_a_summary_or_the_documented_error(tmp_path_factory, snap, as_json, protocol):
    path = tmp_path_factory.mktemp("snap") / ("s.json" if as_json else "s.pickle")
    try:
        path.write_text(json.dumps(snap)) if as_json else path.write_bytes(pickle.dumps(snap, protocol=protocol))
    except (ValueError, TypeError, RecursionError):  # not JSON-able (a cycle, bytes, tuple keys)
        path = path.with_suffix(".pickle")
        path.write_bytes(pickle.dumps(snap, protocol=protocol))
    try:
        loaded = load_snapshot(path)
        summary = fr.snapshot_summary(loaded)
        finding = fr.allocator_fragmentation_finding(loaded)
    except DOCUMENTED as exc:
        assert "\n" not in str(exc) and str(exc)
        event(f"{type(exc).__name__}: {str(exc).partition(': ')[2].partition(':')[0][:40]}")
        return
    event("summarised")
    assert len(summary["devices"]) == len({s.get("device", 0) for s in loaded["segments"]})
    assert finding.status in ("pass", "warn", "fail", "n/a")


def test_doctor_reads_a_well_formed_snapshot(tmp_path, capsys):
    """A two-segment snapshot with a 6 MiB free run among 12 MiB free (pickled as torch's
    _dump_snapshot does): the fragmentation rule reads it; warn is not a failure (exit 0)."""
    MiB = 1 << 20
    sizes = [(2 * MiB, fr.ALLOCATED), (6 * MiB, fr.INACTIVE), (2 * MiB, fr.ALLOCATED), (6 * MiB, fr.INACTIVE)]
    blocks, cursor = [], 0x10000
    for size, state in sizes:
        blocks.append({"size": size, "requested_size": size, "address": cursor, "state": state, "frames": []})
        cursor += size
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [{"address": 0x10000, "total_size": 16 * MiB, "blocks": blocks}]}))
    assert main(["doctor", "--snapshot", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(f["rule"], f["status"]) for f in out["findings"]] == [("fragmentation.allocator", "warn")]
    assert out["findings"][0]["evidence"]["value"] == pytest.approx(0.5)
    assert out["snapshot"]["devices"][0]["free_bytes"] == 12 * MiB and out["logs"] == []
