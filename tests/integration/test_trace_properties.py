"""Property tests (issue 14): hostile values in every field of every trace format, cut last
lines and junk lines; `kvdiag replay` either uses the good lines and names the skipped ones
(exit 0) or fails with a one-line ``file:line:`` error (exit 2), never a traceback. The live
KV event decoder and the Prometheus scrape turn the same kind of input into counted problems.

Examples are bounded for CI (hypothesis' default profile: 100 a test, seconds in all); run 20x
more with ``pytest tests/integration/test_trace_properties.py --hypothesis-profile=soak``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiag.cli import main

# the example count comes from the profile (hypothesis' default: 100; "soak": tests/conftest.py)
bounded = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

INT64_MAX = 2**63 - 1

# ---------------------------------------------------------------- hostile values

huge_ints = st.sampled_from([INT64_MAX + 1, 2**64, 10**30, -(2**63) - 1, -(10**30)])
non_finite = st.sampled_from([math.nan, math.inf, -math.inf, 1e400])
junk = st.one_of(st.booleans(), st.text(max_size=5), st.dictionaries(st.text(max_size=3),
                                                                    st.integers(), max_size=2),
                 st.lists(st.lists(st.none(), max_size=2), max_size=2))
# not a Count (0..2^63-1): negative, beyond int64, float, non-finite, other types
bad_count = st.one_of(huge_ints, st.integers(max_value=-1), non_finite,
                      st.floats(allow_nan=False, allow_infinity=False), junk, st.none())
bad_optional_count = bad_count.filter(lambda v: v is not None)
# not a timestamp (finite, 0..2^63-1 ns)
bad_time = st.one_of(non_finite, st.floats(max_value=-1e-3, allow_infinity=False),
                     st.just(1e13), st.just(1e19), huge_ints, junk)
bad_hash = st.one_of(st.just(2**64), st.just(10**30), st.just(-(2**63) - 1), non_finite,
                     st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
                     st.just([]), st.just([256]), st.just([1, "x"]), st.just(""), st.dictionaries(
                         st.text(max_size=2), st.integers(), max_size=1))
bad_list = st.one_of(st.integers(), st.text(max_size=4), st.dictionaries(st.text(max_size=2),
                                                                         st.integers(), max_size=1))


def _with_bad_item(good: list, bad):
    """``good`` with one element replaced by (or, when empty, set to) a bad value."""
    return st.tuples(st.integers(0, max(len(good) - 1, 0)), bad).map(
        lambda t: [*good[:t[0]], t[1], *good[t[0] + 1:]] if good else [t[1]])


# ---------------------------------------------------------------- formats


def good_mooncake(i: int) -> dict:
    n = 1 + (i * 97) % 1500
    return {"timestamp": i, "input_length": n, "output_length": 3,
            "hash_ids": [i * 10 + k for k in range(-(-n // 512))]}


def good_tokens(i: int) -> dict:
    return {"timestamp": i * 0.5, "token_ids": list(range(i, i + 20 + i % 7))}


def good_vllm(i: int) -> dict:
    return {"seq": i, "ts": 1000.0 + i,
            "events": [["BlockStored", [i * 2 + 1, i * 2 + 2], None, list(range(8 * i, 8 * i + 8)),
                        4, None, "GPU"]]}


def _missing(obj: dict, key: str) -> dict:
    return {k: v for k, v in obj.items() if k != key}


def bad_mooncake(i: int):
    g = good_mooncake(i)
    return st.one_of(
        *[bad_count.map(lambda v, k=k: {**g, k: v}) for k in ("input_length",)],
        bad_optional_count.map(lambda v: {**g, "output_length": v}),
        bad_time.map(lambda v: {**g, "timestamp": v}),
        st.one_of(bad_list, _with_bad_item(g["hash_ids"], bad_count),
                  st.just(g["hash_ids"] + [7])).map(lambda v: {**g, "hash_ids": v}),
        st.sampled_from(["timestamp", "input_length", "hash_ids"]).map(lambda k: _missing(g, k)),
    )


def bad_tokens(i: int):
    g = good_tokens(i)
    return st.one_of(
        st.one_of(bad_list, _with_bad_item(g["token_ids"], bad_count)).map(
            lambda v: {**g, "token_ids": v}),
        bad_time.map(lambda v: {**g, "timestamp": v}),
        st.one_of(st.integers(), st.text(max_size=3), st.just([math.nan])).map(
            lambda v: {**g, "extra_keys": v}),
        st.just(_missing(g, "token_ids")),
    )


def bad_vllm(i: int):
    g = good_vllm(i)
    ev = g["events"][0]

    def event(pos: int):  # the array form's field at pos replaced
        return lambda v: {**g, "events": [[*ev[:pos], v, *ev[pos + 1:]]]}

    block_size = st.one_of(bad_count, st.just(0), st.just(3))  # 3: len(token_ids) mismatch
    return st.one_of(
        bad_optional_count.map(lambda v: {**g, "seq": v}),
        bad_time.filter(lambda v: v is not None).map(lambda v: {**g, "ts": v}),
        bad_list.map(lambda v: {**g, "events": v}),
        st.one_of(bad_list, _with_bad_item(ev[1], bad_hash)).map(event(1)),
        bad_hash.map(event(2)),
        st.one_of(bad_list, _with_bad_item(ev[3], bad_count)).map(event(3)),
        block_size.map(event(4)),
        bad_optional_count.map(event(5)),
        st.one_of(st.integers(), st.booleans(), st.just([1])).map(event(6)),
        st.one_of(st.just("Stored"), st.integers(), st.none()).map(event(0)),
    )


FORMATS = {"mooncake": (good_mooncake, bad_mooncake), "tokens": (good_tokens, bad_tokens),
           "vllm": (good_vllm, bad_vllm)}
junk_line = st.one_of(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)
    .filter(lambda t: "\n" not in t and t.strip() and not t.lstrip().startswith(("{", "[")))
    .map(str.encode),
    st.binary(min_size=1, max_size=30).filter(  # gzip's magic first: read as gzip, not lines
        lambda b: b"\n" not in b and b.strip() and not b.lstrip().startswith((b"{", b"["))
        and not b.startswith(b"\x1f\x8b")),
    st.just(b"[" * 5000),  # deeper than any JSON reader recurses
)


@st.composite
def trace_files(draw):
    """(format, file bytes, line numbers of bad lines, good lines, cut last line or None)."""
    fmt = draw(st.sampled_from(sorted(FORMATS)))
    good, bad = FORMATS[fmt]
    kinds = draw(st.lists(st.sampled_from(["good", "good", "bad", "junk"]), min_size=1,
                          max_size=8))
    lines, bad_at, n_good = [], [], 0
    for i, kind in enumerate(kinds):
        if kind == "good":
            lines.append(json.dumps(good(i)).encode())
            n_good += 1
        else:
            lines.append(json.dumps(draw(bad(i))).encode() if kind == "bad" else draw(junk_line))
            bad_at.append(i + 1)
    data = b"".join(line + b"\n" for line in lines)
    cut = None
    if draw(st.booleans()):
        whole = json.dumps(good(len(lines))).encode()
        data += whole[:draw(st.integers(1, len(whole) - 1))]
        cut = len(lines) + 1
    return fmt, data, bad_at, n_good, cut


def _replay(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["replay", *argv])
    return code, out.getvalue(), err.getvalue()


@bounded
@given(trace_files(), st.sampled_from(["", "--strict", "--partial"]),
       st.sampled_from(["lru", "opt"]))
def test_replay_uses_the_good_lines_or_names_the_bad_one(case, mode, policy):
    fmt, data, bad_at, n_good, cut = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        path.write_bytes(data)
        argv = [str(path), "--format", fmt, "--json", "--policy", policy] + \
            ([mode] if mode else [])
        code, out, err = _replay(argv)
    assert "Traceback" not in err
    if mode == "--strict" and bad_at:
        assert code == 2 and err.startswith(f"{path}:{bad_at[0]}: "), err
        return
    if cut is not None and mode != "--partial":
        assert code == 2 and err.startswith(f"{path}:{cut}: ") and "--partial" in err, err
        return
    if not n_good:
        assert code == 2 and err.startswith(f"{path}:") and "unreadable" in err, err
        return
    assert code == 0, err
    got = json.loads(out)
    assert got["requests"] == n_good
    assert got["skipped_lines"]["count"] == len(bad_at)
    for lineno, message in zip(bad_at, got["skipped_lines"]["first"]):
        assert message.startswith(f"{path}:{lineno}: ") and "expected" in message, message
    assert (f"skipped {len(bad_at)} unreadable line(s)" in err) == bool(bad_at)


@bounded
@given(st.sampled_from(sorted(FORMATS)), st.data())
def test_detection_finds_the_format_past_bad_first_lines(fmt, data):
    good, bad = FORMATS[fmt]
    first = json.dumps(data.draw(bad(0))).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        path.write_bytes(first + b"\n" + json.dumps(good(1)).encode() + b"\n")
        code, out, err = _replay([str(path), "--json"])
    assert code == 0, err
    got = json.loads(out)
    assert got["format"] == fmt and got["requests"] == 1 and got["skipped_lines"]["count"] == 1


# ---------------------------------------------------------------- live decoders


@bounded
@given(bad_vllm(3), st.sampled_from(["batch", "ts", "rank"]), bad_time)
def test_live_kv_event_decoder_counts_bad_batches(line, where, ts):
    """A hostile batch is a MalformedBatch (counted by the subscriber), never another
    exception; what decodes carries only in-range ints."""
    from kvdiag.collectors.vllm_kv_events import KVEventSubscriber, MalformedBatch, decode_batch
    from kvdiag.events.sinks import NullSink

    batch = [line.get("ts"), line.get("events")] if where == "batch" else \
        [ts, good_vllm(1)["events"]] if where == "ts" else [1.0, good_vllm(1)["events"], ts]
    try:
        payload = msgspec.msgpack.encode(batch)
    except (OverflowError, TypeError):  # msgpack itself cannot carry it
        return
    try:
        _, _, events, _ = decode_batch(payload, 5)
    except MalformedBatch:
        pass
    else:
        for ev in events:
            msgspec.json.encode(ev)
            assert all(-(2**63) <= int(h) <= INT64_MAX for h in ev.block_hashes)
    sub = KVEventSubscriber("tcp://127.0.0.1:1", NullSink())
    sub._batch(5, payload)  # records or counts, never raises
    assert sub.batches + sub.malformed == 1


prom_line = st.one_of(
    st.text(max_size=40),
    st.tuples(st.sampled_from(["vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                               "vllm:prefix_cache_hits_total", "x"]),
              st.sampled_from(["NaN", "+Inf", "-Inf", "1e400", "nan", "1", "x", "", "0x1"]))
    .map(lambda t: f"{t[0]} {t[1]}"),
    st.sampled_from(["vllm:e2e_request_latency_seconds_bucket{le=\"NaN\"} 1",
                     "vllm:e2e_request_latency_seconds_bucket{le=\"+Inf\"} NaN",
                     "vllm:e2e_request_latency_seconds_bucket{le=\"1\"} +Inf",
                     "vllm:cache_config_info{block_size=\"99999999999999999999\","
                     "num_gpu_blocks=\"-3\"} 1",
                     "# TYPE x histogram", "# HELP", "{", "x{a=\"}"]),
)


@bounded
@given(st.lists(prom_line, max_size=6))
def test_prometheus_text_gives_finite_metrics_or_a_clear_error(lines):
    from kvdiag.collectors import metrics
    from kvdiag.events.schema import EngineMetrics

    text = "\n".join(lines) + "\n"
    try:
        samples = metrics.parse_prometheus(text)
    except metrics.PrometheusParseError as exc:
        assert str(exc).startswith(("line ", "expected"))
        samples = None
    if samples is not None:
        em = metrics.engine_metrics(samples, ts_ns=1)
        line = msgspec.json.encode(em)
        assert msgspec.json.decode(line, type=EngineMetrics) is not None  # no null in floats
        for name in ("kv_cache_usage", "num_requests_running", "prefix_cache_hits_tokens"):
            value = getattr(em, name)
            assert value is None or math.isfinite(value)
        for key in ("block_size_tokens", "num_blocks"):
            value = getattr(em, key)
            assert value is None or 0 <= value <= INT64_MAX

    class Sink:
        def __init__(self):
            self.events = []

        def record(self, ev):
            self.events.append(ev)

    sink = Sink()
    orig = metrics.fetch_metrics_text
    metrics.fetch_metrics_text = lambda url, timeout_s=2.0: text
    try:
        ok = metrics.scrape_into("http://127.0.0.1:1/metrics", sink)
    finally:
        metrics.fetch_metrics_text = orig
    assert ok == (samples is not None) and len(sink.events) == 1
