"""A client that joins a running engine compares shadow and engine over the same requests.

The engine served traffic before the client joined (here: a cold engine that reported no
prefix hits at all); after the join it reports exactly the hits the content allows. The shadow
results cover the engine's whole life, the joined client's engine view only what it saw: the
client must take the shadow's counters at join time (the agent's socket sends the latest
results first) and compare the requests that finished since. Checked against the offline
simulator's per-request hits over the same prompts.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvdiag.agent import LiveSocketSink
from kvdiag.diagnosis import rules, sharing_rules
from kvdiag.simulation.live_sharing import ShadowSharingSink
from kvdiag.simulation.sharing import simulate
from kvdiag.collectors.agent_client import AgentConnection
from kvdiag.events.eventlog import make_header
from kvdiag.events.log_frames import events_to_frames
from kvdiag.diagnosis.frames import Logs
from kvdiag.live.state import LiveState
from kvdiag.events.schema import KVPoolInfo, RequestArrived, RequestFinished, ShadowSharing
from kvdiag.events.sinks import FanoutSink, ListSink

from test_live_sharing import trace_from_tokens
from waiting import wait_for

BLOCK, CAPACITY = 64, 400
BEFORE, AFTER = 60, 50


def _prompts(n: int) -> list[list[int]]:
    """Chats sharing one of three system prompts (8 blocks), each with its own question."""
    rng = np.random.default_rng(7)
    systems = [list(rng.integers(0, 50_000, 8 * BLOCK)) for _ in range(3)]
    return [[int(t) for t in systems[i % 3]] + [int(t) for t in rng.integers(0, 50_000, 40 + i % 50)]
            for i in range(n)]


def _serve(record, prompts, first: int, cached_tokens) -> None:
    """Sequential requests (each finishes before the next arrives), engine reporting ``cached_tokens[i]``."""
    for i, tokens in enumerate(prompts, start=first):
        record(RequestArrived(ts_ns=i * 1_000_000, request_id=str(i), prompt_tokens=len(tokens), token_ids=tokens))
        record(RequestFinished(ts_ns=i * 1_000_000 + 500_000, request_id=str(i), prompt_tokens=len(tokens),
                               output_tokens=1, cached_prompt_tokens=int(cached_tokens[i - first])))


def test_a_late_client_compares_the_requests_since_it_joined(tmp_path):
    prompts = _prompts(BEFORE + AFTER)
    # what the content allows at the engine's settings, per request (independent of the sink)
    hits = simulate(trace_from_tokens(prompts, BLOCK), "lru", CAPACITY).request_hit_tokens
    header = make_header(engine="test")
    socket_sink = LiveSocketSink(tmp_path / "agent.sock", header)
    recorded = ListSink()
    out = FanoutSink([socket_sink, recorded])
    shadow = ShadowSharingSink([], out=out, interval_s=1e9, clock=time.time_ns)
    engine = FanoutSink([out, shadow])
    try:
        engine.record(KVPoolInfo(ts_ns=0, num_blocks=CAPACITY, block_size_tokens=BLOCK, block_bytes=BLOCK * 8,
                                 num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", prefix_sharing=True))
        _serve(engine.record, prompts[:BEFORE], 0, np.zeros(BEFORE))  # a cold engine: no hits
        conn = AgentConnection(socket_sink.path, timeout_s=10)
        conn.read_header()
        wait_for(lambda: socket_sink.num_clients == 1, 10, "the late client to join the socket")
        joined: list = []
        reader = threading.Thread(target=lambda: joined.extend(conn.events()), daemon=True)
        reader.start()
        _serve(engine.record, prompts[BEFORE:], BEFORE, hits[BEFORE:])  # then exactly the content's hits
    finally:
        socket_sink.close()
    reader.join(timeout=10)
    assert not reader.is_alive()

    # the shadow over the engine's whole life disagrees: the cold phase is in it
    whole = [e for e in recorded.events if isinstance(e, ShadowSharing)][-1]
    assert whole.token_hit_rate - whole.engine_hit_rate > rules.SHARING_GAP_LIMIT

    # the joined client: its first shadow result is the agent's latest before it joined
    first = next(e for e in joined if isinstance(e, ShadowSharing))
    assert first.finished_requests == BEFORE
    finished_after = [e for e in joined if isinstance(e, RequestFinished)]
    assert [e.request_id for e in finished_after] == [str(i) for i in range(BEFORE, BEFORE + AFTER)]
    prompt_after = sum(len(p) for p in prompts[BEFORE:])
    want = float(np.sum(hits[BEFORE:])) / prompt_after  # engine = shadow over those requests

    state = LiveState()
    state.set_header(header)
    state.feed_all(joined)
    view = state.snapshot(joined[-1].ts_ns).sharing
    assert view.window_requests == AFTER
    assert view.window_start_ns == first.ts_ns
    assert view.engine_hit_rate == pytest.approx(want, abs=1e-12)
    assert view.shadow_hit_rate == pytest.approx(want, abs=1e-12)
    assert view.gap == pytest.approx(0.0, abs=1e-12)
    assert view.gap_status == "pass"

    logs = Logs(headers={"n": header}, frames={t: f.assign(node="n") for t, f in events_to_frames(joined).items()})
    f = sharing_rules.sharing_consistency(logs)
    assert f.status == "pass", f.message
    assert f.evidence["requests"] == AFTER
    assert f.evidence["engine_hit_rate"] == pytest.approx(want, abs=1e-12)
    assert f.evidence["window_start_ns"] == first.ts_ns


def test_too_few_requests_in_the_window_is_not_a_verdict():
    """A window with fewer than MIN_SHARING_REQUESTS finished requests: n/a (N of M needed),
    however far apart the rates are."""
    prompts = _prompts(rules.MIN_SHARING_REQUESTS + 1)
    recorded = ListSink()
    shadow = ShadowSharingSink([], out=recorded, interval_s=1e9)
    engine = FanoutSink([recorded, shadow])
    engine.record(KVPoolInfo(ts_ns=0, num_blocks=CAPACITY, block_size_tokens=BLOCK, block_bytes=BLOCK * 8,
                             num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", prefix_sharing=True))
    header = make_header(engine="test")

    def verdict(n: int):
        events = list(recorded.events)
        logs = Logs(headers={"n": header}, frames={t: f.assign(node="n") for t, f in events_to_frames(events).items()})
        state = LiveState()
        state.feed_all(events)
        return sharing_rules.sharing_consistency(logs), state.snapshot(events[-1].ts_ns).sharing

    _serve(engine.record, prompts[:rules.MIN_SHARING_REQUESTS - 1], 0, np.zeros(rules.MIN_SHARING_REQUESTS - 1))
    f, view = verdict(rules.MIN_SHARING_REQUESTS - 1)
    assert f.status == "n/a"
    assert f.message.startswith(f"n/a ({rules.MIN_SHARING_REQUESTS - 1} of {rules.MIN_SHARING_REQUESTS} needed)")
    assert view.gap_status.startswith(f"n/a ({rules.MIN_SHARING_REQUESTS - 1} of")
    _serve(engine.record, prompts[rules.MIN_SHARING_REQUESTS - 1:], rules.MIN_SHARING_REQUESTS - 1, np.zeros(2))
    f, view = verdict(rules.MIN_SHARING_REQUESTS + 1)
    assert f.evidence["requests"] == rules.MIN_SHARING_REQUESTS + 1
    assert f.status == rules.sharing_gap_status(f.evidence["gap"]) == view.gap_status
