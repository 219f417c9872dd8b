"""Hostile kvdiag logs: every command either answers or fails with its documented error.

Two properties over every event type of ``kvdiag/events/schema.py``, on a real recorded log (the
embedded demo, tests/data/demo_small) with generated lines inserted at random places:

1. **In-range extremes are analysed.** Values anywhere within the schema's documented ranges
   (int64 bounds, zero, huge sizes, the largest finite double, empty strings and lists) are
   accepted by the reader (no line skipped) and ``doctor``, ``report`` and ``top``'s state
   fold finish without a traceback.
2. **Out-of-range lines are skipped and counted.** Lines that break the contract of any schema
   (integers beyond int64, a negative or non-numeric timestamp, NaN and Infinity literals, a
   line cut in the middle) are skipped; ``doctor --json`` counts exactly those, names the first
   as ``file:line:``, still judges the rest; ``--strict`` exits 2 naming the first bad line.

Examples are bounded for CI; ``pytest --hypothesis-profile=soak tests/integration/test_hostile_logs.py``
runs 2,000 each (the profile is registered in conftest.py).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import re
import traceback
import warnings
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvdiag.events import schema
from kvdiag.cli import main
from kvdiag.events.eventlog import iter_events
from kvdiag.live.state import LiveState
from conftest import hypothesis_examples

BASE_LOG = Path(__file__).parent.parent / "data" / "demo_small" / "demo_24req_seed1.kvlog.gz"
BASE_LINES = gzip.decompress(BASE_LOG.read_bytes()).decode().splitlines()
HEADER, EVENTS = BASE_LINES[0], BASE_LINES[1:]
REQUEST_IDS = sorted({json.loads(line)["request_id"] for line in EVENTS if '"request_id"' in line})
FIRST_TS_NS = json.loads(EVENTS[0])["ts_ns"]
INT64_MAX = 2**63 - 1
SETTINGS = settings(max_examples=hypothesis_examples(25), deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _run(*argv: str) -> tuple[int, str, str]:
    """kvdiag in this process; a traceback from any command fails the test with its text."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            pytest.fail(f"kvdiag {' '.join(argv)} raised:\n{traceback.format_exc()}")
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------ values within the schema


def _ints(info) -> st.SearchStrategy[int]:
    lo = -(2**63) if info.ge is None else info.ge
    hi = INT64_MAX if info.le is None else info.le
    edges = [v for v in (lo, hi, 0, 1, 2, 16, FIRST_TS_NS, hi - 1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(max(lo, 0), min(hi, 64)), st.integers(lo, hi))


def _floats(info) -> st.SearchStrategy[float]:
    lo = -1.7976931348623157e308 if info.ge is None else info.ge
    hi = 1.7976931348623157e308 if info.le is None else info.le
    edges = [v for v in (lo, hi, 0.0, 5e-324, 0.5, 1.0, 1e300) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.floats(lo, hi, allow_nan=False, allow_infinity=False))


def _value(info, name: str) -> st.SearchStrategy:
    """Any value the schema's type ``info`` (msgspec.inspect) admits, biased to extremes."""
    mi = msgspec.inspect
    if isinstance(info, mi.IntType):
        return _ints(info)
    if isinstance(info, mi.FloatType):
        return _floats(info)
    if isinstance(info, mi.StrType):
        if name == "request_id":
            return st.one_of(st.sampled_from(REQUEST_IDS), st.text(max_size=8))
        return st.one_of(st.sampled_from(["", "prefill", "decode", "lru", "int8", "x" * 200]),
                         st.text(max_size=12))
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.LiteralType):
        return st.sampled_from(info.values)
    if isinstance(info, mi.UnionType):
        return st.one_of(*[_value(t, name) for t in info.types])
    if isinstance(info, mi.ListType):
        return st.lists(_value(info.item_type, name), max_size=5)
    if isinstance(info, mi.TupleType):
        return st.tuples(*[_value(t, name) for t in info.item_types])
    if isinstance(info, mi.DictType):
        return st.dictionaries(_value(info.key_type, name), _value(info.value_type, name), max_size=3)
    raise NotImplementedError(f"{name}: no strategy for {info}")


def _event(cls: type[schema.Event]) -> st.SearchStrategy[dict]:
    """A JSON object of event type ``cls`` whose every field is within the schema."""
    fields = msgspec.inspect.type_info(cls).fields
    return st.fixed_dictionaries(
        {"type": st.just(schema.event_tag(cls)), **{f.name: _value(f.type, f.name) for f in fields}})


ANY_EVENT = st.one_of(*[_event(cls) for cls in schema.EVENT_TYPES])
ANY_HEADER = st.fixed_dictionaries(
    {f.name: _value(f.type, f.name) for f in msgspec.inspect.type_info(schema.LogHeader).fields
     if f.name not in ("schema_version", "extra")}).map(lambda h: {**h, "schema_version": schema.SCHEMA_VERSION})


def _write(tmp_path: Path, header: str, lines: list[str], name: str = "hostile.kvlog") -> Path:
    path = tmp_path / name
    path.write_text("\n".join([header, *lines]) + "\n")
    return path


def _insert(draw, lines: list[str]) -> tuple[list[str], list[int]]:
    """The base events with ``lines`` inserted at drawn places; returns the file's lines and
    the 1-based file line numbers of the inserted ones."""
    out = list(EVENTS)
    places = sorted(draw(st.lists(st.integers(0, len(EVENTS)), min_size=len(lines), max_size=len(lines))))
    for offset, (place, line) in enumerate(zip(places, lines)):
        out.insert(place + offset, line)
    inserted = [place + offset + 2 for offset, place in enumerate(places)]  # +1 header, +1 base 1
    return out, inserted


def _fold_like_top(path: Path) -> None:
    """What `kvdiag top --log` computes: every event folded into the live state, one snapshot."""
    state = LiveState()
    last = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped lines, counted by the other checks
        for ev in iter_events(path):
            state.feed(ev)
            last = max(last, ev.ts_ns)
    state.snapshot(last)


@SETTINGS
@given(data=st.data())
def test_values_within_the_schema_are_analysed(tmp_path_factory, data):
    events = data.draw(st.lists(ANY_EVENT, min_size=1, max_size=6), label="events")
    header = data.draw(st.one_of(st.just(json.loads(HEADER)), ANY_HEADER), label="header")
    lines, _ = _insert(data.draw, [json.dumps(e) for e in events])
    path = _write(tmp_path_factory.mktemp("inrange"), json.dumps(header), lines)

    code, out, err = _run("doctor", str(path), "--json")
    assert code in (0, 1), err
    assert json.loads(out)["skipped_lines"]["count"] == 0, out
    code, _, err = _run("report", str(path), "-o", str(path.with_suffix(".md")))
    assert code == 0, err
    _fold_like_top(path)


# ------------------------------------------------------------------ values outside every schema

BEYOND_INT64 = [2**63, 2**64 + 5, -(2**63) - 1, 10**30]
BAD_TIMESTAMPS = ["-1", "18446744073709551616", "1e999", "NaN", "Infinity", "-Infinity",
                  '"2026-12-03"', "null", "[]", "{}", "true", "1.5"]


@st.composite
def broken_line(draw) -> str:
    """An event line that no schema version accepts."""
    event = draw(ANY_EVENT)
    how = draw(st.sampled_from(["timestamp", "int64", "literal", "cut"]))
    if how == "timestamp":
        text = json.dumps({**event, "ts_ns": "@@"}).replace('"@@"', draw(st.sampled_from(BAD_TIMESTAMPS)))
    elif how == "int64":
        ints = [k for k, v in event.items() if type(v) is int]
        event[draw(st.sampled_from(ints))] = draw(st.sampled_from(BEYOND_INT64))
        text = json.dumps(event)
    elif how == "literal":
        key = draw(st.sampled_from([k for k in event if k != "type"]))
        text = json.dumps({**event, key: "@@"}).replace('"@@"', draw(st.sampled_from(["NaN", "Infinity", "-Infinity"])))
    else:
        text = json.dumps(event)
        text = text[: draw(st.integers(1, len(text) - 1))]
    return text


@SETTINGS
@given(data=st.data())
def test_lines_outside_every_schema_are_skipped_and_counted(tmp_path_factory, data):
    bad = data.draw(st.lists(broken_line(), min_size=1, max_size=5), label="bad lines")
    lines, where = _insert(data.draw, bad)
    path = _write(tmp_path_factory.mktemp("broken"), HEADER, lines)

    code, out, err = _run("doctor", str(path), "--json")
    assert code in (0, 1), err
    skipped = json.loads(out)["skipped_lines"]
    assert skipped["count"] == len(bad)
    first = re.match(r".*:(\d+): ", skipped["first"][0])
    assert first and int(first.group(1)) == where[0], (skipped, where)
    assert f"skipped {len(bad)} unreadable line(s)" in err

    code, _, err = _run("doctor", str(path), "--strict")
    assert code == 2
    assert f"{path}:{where[0]}: " in err, err
    code, _, err = _run("report", str(path), "-o", str(path.with_suffix(".md")))
    assert code == 0, err
    _fold_like_top(path)


def test_a_log_of_only_broken_lines_is_an_input_error(tmp_path):
    path = _write(tmp_path, HEADER, ['{"type": "request_arrived", "ts_ns": -1, "request_id": "a", '
                                     '"prompt_tokens": 3}', '{"type": "engine_step", "ts_ns": NaN}'])
    code, _, err = _run("doctor", str(path))
    assert code == 2
    assert f"{path}:2: request_arrived.ts_ns: expected int >= 0, got -1" in err, err


def test_field_errors_name_the_field_and_the_value(tmp_path):
    """The reader's message for a value out of range: ``file:line: type.field: expected ...``."""
    lines = list(EVENTS[:5]) + ['{"type": "kv_pool_sample", "ts_ns": 1, "num_blocks": 4, '
                                '"blocks_used": 99999999999999999999}',
                                '{"type": "engine_step", "ts_ns": 5, "step_id": Infinity}',
                                '{"type": "request_finished", "ts_ns": 5, "request_id": "a"}']
    path = _write(tmp_path, HEADER, lines)
    code, out, err = _run("doctor", str(path), "--json")
    assert code in (0, 1)
    assert json.loads(out)["skipped_lines"]["first"] == [
        f"{path}:7: kv_pool_sample.blocks_used: expected int <= {INT64_MAX}, got 99999999999999999999",
        f"{path}:8: engine_step.step_id: expected a finite number, found Infinity",
        f"{path}:9: request_finished.prompt_tokens: expected a value, found the field missing"]
