"""Out-of-range and mistyped trace values (issue 14): every reader checks them where it decodes
and names ``file:line: field: expected ...``; `kvdiag replay` skips such lines and says so
(``--strict``: exit 2 at the first; a cut last line: exit 2 unless ``--partial``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvdiag.traces.lines import ReadOptions, TraceFormatError
from kvdiag.traces.loaders import load_trace
from kvdiag.cli import main

GOOD_MOONCAKE = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
GOOD_TOKENS = '{"timestamp": 1.5, "token_ids": ' + str(list(range(1, 18))) + '}'
GOOD_VLLM = '{"seq": 0, "ts": 1.0, "events": [["BlockStored", [7], null, [1, 2], 2, null, "GPU"]]}'

# (format, hostile line, the field its message names)
HOSTILE = [
    ("mooncake", '{"timestamp": 1, "input_length": Infinity, "output_length": 1, "hash_ids": [1]}',
     "input_length"),
    ("mooncake", '{"timestamp": 1, "input_length": 10, "output_length": 1, '
                 '"hash_ids": [99999999999999999999999]}', "hash_ids[0]"),
    ("mooncake", '{"timestamp": 1e400, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "timestamp"),
    ("mooncake", '{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "timestamp"),
    ("mooncake", '{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": []}',
     "input_length"),
    ("mooncake", '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [-1]}',
     "hash_ids[0]"),
    ("tokens", '{"timestamp": 1, "token_ids": [1, 2, 99999999999999999999999]}', "token_ids[2]"),
    ("tokens", '{"timestamp": NaN, "token_ids": [1, 2, 3]}', "timestamp"),
    ("tokens", '{"timestamp": 1, "token_ids": [1, 2, -3]}', "token_ids[2]"),
    ("vllm", '{"seq": 1, "ts": Infinity, "events": []}', "ts"),
    ("vllm", '{"seq": 1, "ts": 2.0, "events": [["BlockStored", [8], null, '
             '[1, 99999999999999999999999], 2, null, "GPU"]]}', "BlockStored.token_ids[1]"),
    ("vllm", '{"seq": 1, "ts": 2.0, "events": [["BlockStored", [99999999999999999999999], null, '
             '[1, 2], 2, null, "GPU"]]}', "BlockStored.block_hashes[0]"),
    ("vllm", '{"seq": 99999999999999999999999, "ts": 2.0, "events": []}', "seq"),
]
GOOD = {"mooncake": GOOD_MOONCAKE, "tokens": GOOD_TOKENS, "vllm": GOOD_VLLM}


def _write(tmp_path, fmt, lines, end="\n"):
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("\n".join(lines) + end)
    return path


def _replay_json(capsys, path, *argv):
    code = main(["replay", str(path), "--json", *argv])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if code == 0 else None), captured.err


@pytest.mark.parametrize("fmt,line,field", HOSTILE)
def test_a_hostile_line_is_skipped_and_named(tmp_path, capsys, fmt, line, field):
    path = _write(tmp_path, fmt, [GOOD[fmt], line, GOOD[fmt]])
    code, out, err = _replay_json(capsys, path, "--format", fmt)
    assert code == 0, err
    assert "Traceback" not in err
    assert out["skipped_lines"]["count"] == 1
    first = out["skipped_lines"]["first"][0]
    assert first.startswith(f"{path}:2: {field}") and "expected" in first, first
    assert f"kvdiag replay: skipped 1 unreadable line(s); {path}:2: {field}" in err
    assert out["requests"] == 2


@pytest.mark.parametrize("fmt,line,field", HOSTILE)
def test_strict_fails_at_the_hostile_line(tmp_path, capsys, fmt, line, field):
    path = _write(tmp_path, fmt, [GOOD[fmt], line, GOOD[fmt]])
    code, _, err = _replay_json(capsys, path, "--format", fmt, "--strict")
    assert code == 2
    assert err.startswith(f"{path}:2: {field}") and "expected" in err, err
    with pytest.raises(TraceFormatError, match=f"^{path}:2: "):
        load_trace(path, fmt)  # the library reads strictly by default


def test_the_issue_example_exits_cleanly_in_a_subprocess(tmp_path):
    path = _write(tmp_path, "mooncake", [GOOD_MOONCAKE, HOSTILE[0][1]])
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "replay", str(path), "--strict"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"{path}:2: input_length: expected")
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "replay", str(path), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["skipped_lines"]["count"] == 1


@pytest.mark.parametrize("fmt", ["mooncake", "tokens", "vllm"])
def test_a_cut_last_line_needs_partial(tmp_path, capsys, fmt):
    good = GOOD[fmt]
    path = _write(tmp_path, fmt, [good, good, good[:len(good) // 2]], end="")
    code, _, err = _replay_json(capsys, path, "--format", fmt)
    assert code == 2 and err.startswith(f"{path}:3: ") and "--partial" in err
    code, out, err = _replay_json(capsys, path, "--format", fmt, "--partial")
    assert code == 0, err
    assert out["requests"] == 2 and out["skipped_lines"]["count"] == 0


def test_only_unreadable_lines_is_an_error(tmp_path, capsys):
    path = _write(tmp_path, "mooncake", [HOSTILE[0][1], HOSTILE[1][1]])
    code, _, err = _replay_json(capsys, path, "--format", "mooncake")
    assert code == 2 and err.startswith(f"{path}:") and "unreadable" in err


def test_read_options_collect_problems_instead_of_raising(tmp_path):
    path = _write(tmp_path, "tokens", [GOOD_TOKENS, HOSTILE[6][1], "{oops", GOOD_TOKENS])
    opts = ReadOptions(strict=False)
    trace = load_trace(path, read=opts)
    assert trace.requests == 2
    assert [p.split(": ")[0] for p in opts.problems] == [f"{path}:2", f"{path}:3"]


def _kvdiag_log(tmp_path, extra: bytes, name: str = "run.kvlog"):
    """A kvdiag log of three requests with token ids, ``extra`` inserted as its third line."""
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.events.schema import RequestArrived

    path = tmp_path / name
    with LogWriter(path, make_header(engine="test", block_size_tokens=4)) as w:
        for i in range(3):
            w.record(RequestArrived(ts_ns=i + 1, request_id=str(i), prompt_tokens=8,
                                    token_ids=list(range(i, i + 8))))
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:2] + [extra] + lines[2:]))
    return path


def test_kvdiag_log_lines_follow_the_same_convention(tmp_path, capsys):
    path = _kvdiag_log(tmp_path, b'{"type": "request_arrived", "oops')
    code, out, err = _replay_json(capsys, path)
    assert code == 0, err
    assert out["requests"] == 3 and out["skipped_lines"]["count"] == 1
    assert out["skipped_lines"]["first"][0].startswith(f"{path}:3: ")
    code, _, err = _replay_json(capsys, path, "--strict")
    assert code == 2 and err.startswith(f"{path}:3: ")
    cut = tmp_path / "cut.kvlog"
    whole = _kvdiag_log(tmp_path, b"", "whole.kvlog").read_bytes()
    cut.write_bytes(whole.rstrip(b"\n") + b'\n{"type": "req')
    code, _, err = _replay_json(capsys, cut)
    assert code == 2 and "--partial" in err
    code, out, err = _replay_json(capsys, cut, "--partial")
    assert code == 0 and out["requests"] == 3 and out["skipped_lines"]["count"] == 0


def test_live_subscriber_counts_a_seq_beyond_int64_as_malformed():
    """A seq vLLM never sends (>= 2^63: only the end-of-replay marker is all ones) is a counted
    malformed message, not a gap of 2^64 batches."""
    import msgspec

    from kvdiag.collectors.vllm_kv_events import KVEventSubscriber
    from kvdiag.events.sinks import ListSink

    sink = ListSink()
    sub = KVEventSubscriber("tcp://127.0.0.1:1", sink)
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU"]]])
    sub._on_message([b"kv", (0).to_bytes(8, "big"), payload])
    sub._on_message([b"kv", (2**64 - 1).to_bytes(8, "big"), payload])
    sub._on_message([b"kv", (1).to_bytes(8, "big"), payload])
    assert (sub.batches, sub.malformed, sub.gaps, sub.dropped_batches) == (2, 1, 0, 0)
