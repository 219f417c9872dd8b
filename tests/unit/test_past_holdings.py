"""The holdings at an instant already passed (kvdiag.pool.past_holdings) on long streams folded
in batches of every size: equal to a brute-force count over the latest block events, with the
batches kept bounded (short ones merged, old ones let go)."""

from __future__ import annotations

import random

import pytest

from kvdiag.events import schema as s
from kvdiag.pool import past_holdings
from kvdiag.pool.blockledger import BlockLedger


def _stream(n: int, seed: int) -> list[s.Event]:
    """Requests allocating, sharing (hits) and releasing blocks of a 64-block pool, with
    evictions, steps and finishes; times rise and sometimes repeat or go back."""
    rng = random.Random(seed)
    out: list[s.Event] = [s.KVPoolInfo(ts_ns=1, num_blocks=64, block_size_tokens=16, block_bytes=64,
                                       num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")]
    ts = 10
    while len(out) < n:
        ts = max(2, ts + rng.choice([0, 1, 1, 3, 50, -2]))
        rid, block = f"r{rng.randrange(12)}", rng.randrange(64)
        kind = rng.choice(["alloc"] * 4 + ["release"] * 4 + ["evict", "hit", "step", "finish", "arrive"])
        if kind == "alloc":
            out.append(s.BlockAllocated(ts_ns=ts, request_id=rid, block_id=block))
        elif kind == "release":
            out.append(s.BlockReleased(ts_ns=ts, request_id=rid, block_id=block, cached=rng.random() < 0.5))
        elif kind == "evict":
            out.append(s.BlockEvicted(ts_ns=ts, block_id=block))
        elif kind == "hit":
            out.append(s.PrefixHit(ts_ns=ts, request_id=rid, block_id=block, num_tokens=16))
        elif kind == "step":
            out.append(s.EngineStep(ts_ns=ts - rng.randrange(40), step_id=len(out), phase="decode",
                                    batch_size=1, num_tokens=1, duration_ns=5))
        elif kind == "finish":
            out.append(s.RequestFinished(ts_ns=ts, request_id=rid, prompt_tokens=32, output_tokens=2))
        else:
            out.append(s.RequestArrived(ts_ns=ts, request_id=rid, prompt_tokens=32))
    return out


def _after_each_block_event(events: list[s.Event]) -> list[tuple[int, int]]:
    """(ts_ns, holdings after it) of every block event, by brute force: the (request, block)
    pairs held."""
    pairs: set = set()
    out = []
    for ev in events:
        if isinstance(ev, (s.BlockAllocated, s.PrefixHit)):
            if isinstance(ev, s.BlockAllocated):  # reassigned: the previous holders lose it
                pairs = {p for p in pairs if p[1] != ev.block_id}
            pairs.add((ev.request_id, ev.block_id))
        elif isinstance(ev, s.BlockReleased):
            pairs.discard((ev.request_id, ev.block_id))
        if isinstance(ev, past_holdings.BLOCK_EVENTS):
            out.append((ev.ts_ns, len(pairs)))
    return out


@pytest.mark.parametrize("chunk", [1, 7, 5_000, 30_000])
def test_lookups_equal_a_brute_force_count_and_the_batches_stay_bounded(chunk):
    capacity = 3_000
    events = _stream(30_000, seed=chunk)
    ledger = BlockLedger()
    ledger.track_holdings(capacity)
    past = ledger.past_holdings
    most_batches = 0
    for k in range(0, len(events), chunk):
        ledger.apply_all(events[k:k + chunk])
        most_batches = max(most_batches, len(past._batches))
    after = _after_each_block_event(events)
    assert len(after) > 3 * capacity and ledger.holdings == after[-1][1]
    kept = after[-capacity:]
    assert past.entries(ledger.holdings) == kept
    rng = random.Random(0)
    for ts in [kept[0][0] - 1, kept[-1][0], *rng.sample([t for t, _ in kept], 200)]:
        found = next((held for t, held in reversed(kept) if t <= ts), None)
        expected = (kept[0][1], True) if found is None else (found, False)
        assert past.at(ts, ledger.holdings) == expected, ts
    # what is kept: the batches that reach the latest block events, each up to _BATCH_EVENTS
    # events (one-event batches merged), and no event that is not a block event
    assert most_batches <= 4
    assert all(ev is None or isinstance(ev, past_holdings.BLOCK_EVENTS) for b in past._batches for ev in b.events)


def test_before_the_first_block_event_there_is_nothing_to_look_up():
    ledger = BlockLedger()
    ledger.track_holdings(8)
    assert ledger.past_holdings.at(5, 0) == (None, False)
    ledger.apply_all([s.RequestArrived(ts_ns=10, request_id="a", prompt_tokens=16),
                      s.BlockAllocated(ts_ns=20, request_id="a", block_id=1),
                      s.EngineStep(ts_ns=15, step_id=1, phase="prefill", batch_size=1, num_tokens=16,
                                   duration_ns=5)])
    assert ledger.past_holdings.newest_block_ts() == 20
    assert ledger.past_holdings.at(15, ledger.holdings) == (None, False)
    assert ledger.past_holdings.at(20, ledger.holdings) == (1, False)


def test_bad_events_are_passed_over():
    """An event the ledger cannot fold (no time, not an event at all) is counted in
    ``bad_events`` and no lookup counts it."""
    events = _stream(400, seed=5)
    bad = [s.BlockAllocated(ts_ns=None, request_id="r1", block_id=3), {"type": "block_allocated"},
           s.BlockReleased(ts_ns=None, request_id="r2", block_id=4, cached=True)]
    mixed = events[:100] + bad[:2] + events[100:250] + bad[2:] + events[250:]
    ledger = BlockLedger()
    ledger.track_holdings(10_000)
    for k in range(0, len(mixed), 37):
        ledger.apply_all(mixed[k:k + 37])
    assert ledger.bad_events == 3
    after = _after_each_block_event(events)
    assert ledger.past_holdings.entries(ledger.holdings) == after
    for ts in sorted({ev.ts_ns for ev in events}):
        expected = next((held for t, held in reversed(after) if t <= ts), None)
        assert ledger.past_holdings.at(ts, ledger.holdings) == (expected, False)
