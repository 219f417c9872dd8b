"""The block facts (kvdiag/pool/blockfacts.py) that top's rules read instead of raw block events:
the blocks held at each engine step's start, checked against a brute-force count, equal
whether the steps arrive late in a live stream (after block events of their own forward pass,
as engines report them) or in time order (the doctor's fold of a log); and top's rules keep no
block event."""

from __future__ import annotations

import random

from kvdiag.pool import blockfacts
from kvdiag.events import schema as s
from kvdiag.live.rules import LiveRules
from kvdiag.live.state import LiveState

T0 = 1_700_000_000_000_000_000


def _stream(seed: int = 0, n_requests: int = 60):
    """(events in delivery order, steps): requests allocate, hit and release blocks; every few
    block events an engine step starts, and it is delivered after the next 0-5 block events."""
    rng = random.Random(seed)
    ts = T0
    out = [s.KVPoolInfo(ts_ns=ts, num_blocks=10_000, block_size_tokens=16, block_bytes=1024, num_layers=1,
                        num_kv_heads=1, head_dim=8, dtype="float16")]
    held: dict[str, list[int]] = {}
    free = list(range(10_000))
    cached: list[int] = []
    pending: list[tuple[int, s.EngineStep]] = []  # (block events still to pass, step)
    step_id = 0

    def emit(ev):
        nonlocal pending
        out.append(ev)
        if isinstance(ev, blockfacts.BLOCK_EVENTS):
            due = [p for p in pending if p[0] <= 0]
            out.extend(st for _, st in due)
            pending = [(n - 1, st) for n, st in pending if n > 0]

    for i in range(n_requests):
        rid = f"r{i}"
        ts += 1000
        emit(s.RequestArrived(ts_ns=ts, request_id=rid, prompt_tokens=64))
        held[rid] = []
        for _ in range(rng.randint(1, 6)):
            ts += 1000
            if cached and rng.random() < 0.3:
                b = cached.pop()
                emit(s.PrefixHit(ts_ns=ts, request_id=rid, block_id=b))
            else:
                b = free.pop()
                emit(s.BlockAllocated(ts_ns=ts, request_id=rid, block_id=b))
            held[rid].append(b)
            if rng.random() < 0.4:
                step_id += 1
                pending.append((rng.randint(0, 5), s.EngineStep(ts_ns=ts + 500, step_id=step_id, phase="decode",
                                                                 batch_size=1, num_tokens=1, duration_ns=400)))
        if rng.random() < 0.7 and len(held) > 1:
            done = next(iter(held))
            ts += 1000
            emit(s.RequestFinished(ts_ns=ts, request_id=done, prompt_tokens=64, output_tokens=4))
            for b in held.pop(done):
                ts += 1000
                emit(s.BlockReleased(ts_ns=ts, request_id=done, block_id=b, cached=True))
                cached.append(b)
        if rng.random() < 0.2 and cached:
            ts += 1000
            emit(s.BlockEvicted(ts_ns=ts, block_id=cached.pop(0)))
    out.extend(st for _, st in pending)
    return out


def _brute_force_held(events, t_ns: int) -> int:
    """(request, block) pairs held after every block event at or before ``t_ns``."""
    pairs: set = set()
    for ev in sorted((e for e in events if isinstance(e, blockfacts.BLOCK_EVENTS)), key=lambda e: e.ts_ns):
        if ev.ts_ns > t_ns:
            break
        if isinstance(ev, (s.BlockAllocated, s.PrefixHit)):
            pairs.add((ev.request_id, ev.block_id))
        elif isinstance(ev, s.BlockReleased):
            pairs.discard((ev.request_id, ev.block_id))
    return len(pairs)


def _step_held(facts_frame):
    steps = facts_frame[facts_frame["kind"] == "step"].sort_values("ts_ns", kind="stable")
    return dict(zip(steps["ts_ns"].tolist(), steps["blocks_held"].tolist()))


def test_blocks_held_at_each_step_equal_a_brute_force_count_live_and_offline():
    events = _stream()
    steps = [e for e in events if isinstance(e, s.EngineStep)]
    late = sum(1 for i, e in enumerate(events) if isinstance(e, s.EngineStep)
               and any(isinstance(x, blockfacts.BLOCK_EVENTS) and x.ts_ns > e.ts_ns for x in events[:i]))
    assert len(steps) > 40 and late > 20  # the stream does deliver steps late
    expected = {st.ts_ns: _brute_force_held(events, st.ts_ns) for st in steps}
    assert len(set(expected.values())) > 5

    state = LiveState()
    state.feed_all(events)
    live = _step_held(state.facts.frames("n")[blockfacts.FACTS_TAG])
    offline = _step_held(blockfacts.fold(events).frames("n")[blockfacts.FACTS_TAG])
    assert live == expected
    assert offline == expected
    assert state.facts.late_rows == 0


def test_active_requests_blocks_and_evictions_equal_live_and_offline():
    events = _stream(seed=3)
    events.extend(s.KVPoolSample(ts_ns=e.ts_ns + 1, num_blocks=10_000, blocks_used=0)
                  for e in list(events) if isinstance(e, s.RequestArrived))
    events.sort(key=lambda e: e.ts_ns)  # time order: the samples at their place
    state = LiveState()
    state.feed_all(events)
    live = state.facts.frames("n")[blockfacts.FACTS_TAG]
    offline = blockfacts.fold(events).frames("n")[blockfacts.FACTS_TAG]
    cols = ["ts_ns", "kind", "blocks_held", "active_allocated", "active_hits", "evictions"]
    assert live[cols].fillna(-1).to_dict("list") == offline[cols].fillna(-1).to_dict("list")
    evicted = sum(isinstance(e, s.BlockEvicted) for e in events)
    assert evicted > 0 and int(live["evictions"].sum()) == evicted
    pool = live[live["kind"] == "pool"]
    assert pool["active_allocated"].max() > 0 and pool["active_hits"].max() > 0


def test_kv_event_batches_count_every_event_once_per_batch():
    events = [s.PrefixCacheStored(ts_ns=T0 + b, seq=b, block_hashes=[i]) for b in range(5) for i in range(3)]
    events.append(s.PrefixCacheStored(ts_ns=T0 + 2, seq=2, block_hashes=[99]))  # a replayed batch
    batches = blockfacts.fold(events).frames("n")[blockfacts.KV_BATCHES_TAG]
    assert int(batches["events"].sum()) == len(events)
    assert len(batches[["seq", "ts_ns"]].drop_duplicates()) == 5


def test_top_rules_keep_no_block_event():
    events = _stream(seed=1)
    rules = LiveRules()
    rules.record(events)
    kept = {cls for cls in rules.tables}
    assert kept and not kept & set(blockfacts.BLOCK_EVENTS)
    assert sum(t.rows for t in rules.tables.values()) == sum(
        not isinstance(e, blockfacts.BLOCK_EVENTS) for e in events)


def test_top_rules_read_the_events_the_fold_sorted_out_as_they_read_the_whole_stream():
    """top hands the rules the events its fold passed on (``feed_all(events, others)``, as
    ``LiveRules.fold`` does), not every event: the kept tables, the latency series and the
    event count are the same."""
    from kvdiag.live.state import LiveState

    events = _stream(seed=2)
    whole, sorted_out = LiveRules(), LiveRules()
    state = LiveState()
    for i in range(0, len(events), 97):
        chunk = events[i:i + 97]
        others: list = []
        state.feed_all(chunk, others)
        assert len(others) == sum(type(e) not in (s.BlockAllocated, s.BlockReleased, s.BlockEvicted) for e in chunk)
        sorted_out.record(others, len(chunk))
        whole.record(chunk)
    a, b = whole.take(state), sorted_out.take(state)
    assert a.events == b.events == len(events)
    assert sorted(a.tables) == sorted(b.tables) and a.tables
    for tag in a.tables:
        assert a.tables[tag].frame("n").equals(b.tables[tag].frame("n")), tag
    assert a.latency and a.latency == b.latency


def test_top_rules_keep_no_prompt_content():
    """A prompt's chunk hashes (or token ids) are the shadow's business, not the rules': not kept."""
    rules = LiveRules()
    rules.record([s.RequestArrived(ts_ns=T0 + i, request_id=f"r{i}", prompt_tokens=4096,
                                   chunk_hashes=list(range(256))) for i in range(50)])
    table = rules.tables[s.RequestArrived]
    kept = dict(zip(table.fields, table.cols))
    assert kept["chunk_hashes"] is None and kept["token_ids"] is None and len(kept["request_id"]) == 50
    frame = table.frame("n")
    assert frame["chunk_hashes"].isna().all() and frame["prompt_tokens"].tolist() == [4096] * 50
