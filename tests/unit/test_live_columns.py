"""The live rules' column store (kvdiag.live.columns) gives back exactly the rows it was given,
checked against the events themselves (brute force), whatever the chunking, value ranges,
missing values and malformed values."""

import math

import numpy as np
from hypothesis import given, settings, strategies as st

from kvdiag.events import schema as s
from kvdiag.live import columns
from kvdiag.live.rules import NOT_JUDGED

INT64 = st.integers(-2**63, 2**63 - 1)
SMALL = st.integers(0, 5_000)
TS = st.integers(0, 2**62)
opt = st.none().__or__
# a malformed value now and then (a struct is not validated when built in Python)
ODD = st.sampled_from([1.5, "x", None, 2**70, True])


def _finished():
    return st.builds(s.RequestFinished, ts_ns=TS, request_id=st.text(max_size=12),
                     prompt_tokens=SMALL | INT64, output_tokens=SMALL | ODD, cached_prompt_tokens=SMALL,
                     status=st.sampled_from(["finished", "aborted", "failed"]) | ODD,
                     e2e_ns=opt(INT64), ttft_ns=opt(SMALL))


def _step():
    return st.builds(s.EngineStep, ts_ns=TS | ODD, step_id=SMALL, phase=st.just("decode"), batch_size=SMALL,
                     num_tokens=SMALL, duration_ns=INT64, prefill_tokens=SMALL, decode_tokens=SMALL | ODD)


def _arrived():
    return st.builds(s.RequestArrived, ts_ns=TS, request_id=st.text(max_size=6), prompt_tokens=SMALL,
                     max_new_tokens=opt(SMALL), conversation_id=opt(st.text(max_size=3)),
                     partial_tokens=opt(SMALL), cache_domain=opt(st.text(max_size=5)) | ODD)


def _same(got, want) -> bool:
    def norm(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return None
        return v.item() if isinstance(v, np.generic) else v
    return all(norm(a) == norm(b) and type(norm(a)) in (type(norm(b)), int, float, bool)
               for a, b in zip(got, want, strict=True))


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.lists(_finished(), min_size=1, max_size=40), st.lists(_step(), min_size=1, max_size=40),
                 st.lists(_arrived(), min_size=1, max_size=40)),
       st.integers(1, 9), st.integers(0, 40))
def test_frame_gives_back_every_value(events, chunk_rows, copy_at):
    cls = type(events[0])
    old = columns.CHUNK_ROWS
    columns.CHUNK_ROWS = chunk_rows
    try:
        table = columns.Table(cls, NOT_JUDGED.get(cls, frozenset()))
        copy = None
        for i, ev in enumerate(events):
            if i == copy_at:
                copy = table.copy()
            table.append(ev)
        for t, evs in ((table, events), (copy, events[:copy_at])):
            if t is None:
                continue
            frame = t.frame("n")
            assert len(frame) == len(evs) == t.rows and (frame["node"] == "n").all()
            for name in s.fields_of(cls):
                want = [getattr(e, name) for e in evs]
                col = frame[name].tolist()
                if name in NOT_JUDGED.get(cls, ()):
                    assert all(v is None for v in col)
                    continue
                if frame[name].dtype == np.float64:  # numbers with None: float64 with NaN (documented)
                    want = [None if v is None else float(v) for v in want]
                assert _same(col, want), (name, col, want)
                if want and all(type(v) is int for v in want) and all(-2**63 <= v < 2**63 for v in want):
                    assert frame[name].dtype == np.int64  # a complete int column stays int64
    finally:
        columns.CHUNK_ROWS = old


def test_chunks_are_narrow():
    """A step's ts_ns (close in time) and small counts take 1-4 bytes, not 8."""
    table = columns.Table(s.EngineStep, NOT_JUDGED[s.EngineStep])
    n = 3 * columns.CHUNK_ROWS
    for i in range(n):
        table.append(s.EngineStep(ts_ns=10**18 + 6_400_000 * i, step_id=i, phase="decode", batch_size=64,
                                  num_tokens=64, duration_ns=20_000_000, decode_tokens=64))
    table.flush()
    # ts 4 + batch 1 + tokens 1 + duration 4 + prefill 1 + decode 1 bytes a row (+ a chunk's first ts)
    assert table.nbytes() <= n * 12 + 3 * 8
    assert table.frame("n")["ts_ns"].tolist() == [10**18 + 6_400_000 * i for i in range(n)]
