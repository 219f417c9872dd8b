"""Snapshot files are pickles: they must load through the restricted unpickler only."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from kvdiag.events.snapshot_io import SnapshotLoadError, load_snapshot, save_snapshot_json

SNAP = {"segments": [{"address": 1, "total_size": 512, "stream": 0, "segment_type": "small",
                      "segment_pool_id": (0, 0), "blocks": [{"size": 512, "requested_size": 500,
                                                              "address": 1, "state": "inactive"}]}],
        "device_traces": [[{"action": "alloc", "addr": 1, "size": 500, "frames": []}]]}


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_plain_pickle_loads(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(SNAP))
    assert load_snapshot(path) == SNAP


def test_malicious_pickle_refused_without_executing(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"segments": [], "x": Evil(str(marker))})
    path = tmp_path / "evil.pickle"
    path.write_bytes(payload)
    with pytest.raises(SnapshotLoadError, match="refused global"):
        load_snapshot(path)
    assert not marker.exists()
    # the payload is real: an unrestricted load (in a child process) does run it
    subprocess.run([sys.executable, "-c", "import pickle,sys; pickle.loads(open(sys.argv[1],'rb').read())",
                    str(path)], check=False)
    assert marker.exists()


@pytest.mark.parametrize("proto", [0, 2, 5])
def test_object_globals_refused_at_all_protocols(tmp_path, proto):
    import collections
    path = tmp_path / "od.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "o": collections.OrderedDict(a=1)}, protocol=proto))
    with pytest.raises(SnapshotLoadError, match="collections.OrderedDict"):
        load_snapshot(path)


def test_bad_files_give_one_line_errors(tmp_path):
    junk = tmp_path / "junk.pickle"
    junk.write_bytes(b"\x80\x05garbage")
    with pytest.raises(SnapshotLoadError, match="junk.pickle: expected"):
        load_snapshot(junk)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"segments": [\n oops')
    with pytest.raises(SnapshotLoadError, match=r"bad.json:2: expected"):
        load_snapshot(bad_json)
    wrong = tmp_path / "wrong.pickle"
    wrong.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(SnapshotLoadError, match="'segments' list"):
        load_snapshot(wrong)


def test_json_round_trip(tmp_path):
    out = save_snapshot_json(SNAP, tmp_path / "s.json")
    back = load_snapshot(out)
    assert back["segments"][0]["segment_pool_id"] == [0, 0]
    assert back["device_traces"] == SNAP["device_traces"]
