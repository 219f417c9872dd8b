"""The ledger's batch loop (``BlockLedger.apply_all``, which inlines the common cases of the
block events and keeps its counters in locals) against the per-event methods that define the
rules (``apply`` on each event), and the counters it adds (open requests' allocations and
hits, evictions, the holdings ring, top's per-bin event and eviction counts) against brute
force counts written here, on random streams with every anomaly."""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.events import schema as s
from kvdiag.live.state import LiveState
from kvdiag.pool.blockledger import BlockLedger

STATE = ("held", "holders", "cached", "holdings", "finished_holding", "finished_holding_blocks",
         "finished_requests", "block_events", "anomaly_counts", "anomalies", "double_release_requests",
         "released_by", "last_ts_ns", "evictions", "bad_events", "open", "open_allocated", "open_hits",
         "num_blocks", "held_blocks", "cached_blocks")


@st.composite
def streams(draw) -> list[s.Event]:
    """Random streams over 6 blocks and 5 requests: arrivals, allocations, hits, deduplications,
    releases (of held, unheld and released blocks), evictions (of held blocks too), finishes,
    steps; times mostly rising, some repeated or going back (late events)."""
    out: list[s.Event] = [s.KVPoolInfo(ts_ns=1, num_blocks=8, block_size_tokens=16, block_bytes=64,
                                       num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")]
    ts = 10
    for _ in range(draw(st.integers(0, 80))):
        ts += draw(st.sampled_from([0, 1, 1, 1, 7, 400_000_000, -3]))
        ts = max(ts, 2)
        kind = draw(st.sampled_from(["arrive", "alloc", "alloc", "hit", "dedup", "release", "release",
                                     "evict", "finish", "step"]))
        rid, block = f"r{draw(st.integers(0, 4))}", draw(st.integers(0, 5))
        if kind == "arrive":
            out.append(s.RequestArrived(ts_ns=ts, request_id=rid, prompt_tokens=32))
        elif kind == "alloc":
            out.append(s.BlockAllocated(ts_ns=ts, request_id=rid, block_id=block))
        elif kind == "hit":
            out.append(s.PrefixHit(ts_ns=ts, request_id=rid, block_id=block, num_tokens=16))
        elif kind == "dedup":
            out.append(s.BlockDeduplicated(ts_ns=ts, request_id=rid, block_id=block, duplicate_block_id=block + 6))
        elif kind == "release":
            out.append(s.BlockReleased(ts_ns=ts, request_id=rid, block_id=block, cached=draw(st.booleans())))
        elif kind == "evict":
            out.append(s.BlockEvicted(ts_ns=ts, block_id=block))
        elif kind == "finish":
            out.append(s.RequestFinished(ts_ns=ts, request_id=rid, prompt_tokens=32, output_tokens=2))
        else:
            out.append(s.EngineStep(ts_ns=ts, step_id=len(out), phase="decode", batch_size=1, num_tokens=1,
                                    duration_ns=5))
    return out


def _state(ledger: BlockLedger) -> dict:
    out = {k: getattr(ledger, k) for k in STATE}
    out["ring"] = (list(ledger.ring_ts), list(ledger.ring_held)) if ledger.ring_ts is not None else None
    out["dropped_log"] = ledger.dropped_log
    return out


def _brute_open(events) -> tuple[int, int, int]:
    """(allocations, prefix hits) of the requests arrived and not finished, evictions."""
    opened: dict[str, list[int]] = {}
    evictions = 0
    for ev in events:
        t = type(ev)
        if t is s.RequestArrived:
            opened.setdefault(ev.request_id, [0, 0])
        elif t is s.RequestFinished:
            opened.pop(ev.request_id, None)
        elif t is s.BlockAllocated and ev.request_id in opened:
            opened[ev.request_id][0] += 1
        elif t is s.PrefixHit and ev.request_id in opened:
            opened[ev.request_id][1] += 1
        elif t is s.BlockEvicted:
            evictions += 1
    return sum(c[0] for c in opened.values()), sum(c[1] for c in opened.values()), evictions


@settings(max_examples=400, deadline=None)
@given(streams(), st.integers(1, 7), st.sampled_from([0, 4]), st.booleans())
def test_batch_loop_is_the_per_event_methods(events, chunk, ring, log_dropped):
    """In batches of any size (the loop's locals written back at each end), with and without
    the holdings ring (a ring of 4 overflows) and the log of content dropped (the block id of
    every BlockEvicted and every BlockReleased not kept cached, in order)."""
    one, batch = BlockLedger(), BlockLedger()
    if ring:
        one.track_holdings(ring)
        batch.track_holdings(ring)
    if log_dropped:
        one.log_dropped()
        batch.log_dropped()
    for ev in events:
        one.apply(ev)
    for k in range(0, len(events), chunk):
        batch.apply_all(events[k:k + chunk])
    assert _state(batch) == _state(one)
    if log_dropped:
        dropped = [ev.block_id for ev in events if isinstance(ev, s.BlockEvicted)
                   or isinstance(ev, s.BlockReleased) and not ev.cached]
        assert batch.take_dropped() == dropped and batch.take_dropped() == []
    assert (batch.held_blocks, batch.cached_blocks) == (len(batch.holders), len(batch.cached))
    assert (batch.open_allocated, batch.open_hits, batch.evictions) == _brute_open(events)
    if ring:  # holdings after each of the last block events: brute force
        pairs: set = set()
        after = []
        for ev in events:
            if isinstance(ev, (s.BlockAllocated, s.PrefixHit, s.BlockDeduplicated)):
                if isinstance(ev, s.BlockAllocated):  # reassigned: the previous holders lose it
                    pairs = {p for p in pairs if p[1] != ev.block_id}
                pairs.add((ev.request_id, ev.block_id))
            elif isinstance(ev, s.BlockReleased):
                pairs.discard((ev.request_id, ev.block_id))
            if isinstance(ev, (s.BlockAllocated, s.PrefixHit, s.BlockDeduplicated, s.BlockReleased,
                               s.BlockEvicted)):
                after.append((ev.ts_ns, len(pairs)))
        assert list(zip(batch.ring_ts, batch.ring_held)) == after[-ring:]


@settings(max_examples=200, deadline=None)
@given(streams(), st.integers(1, 9))
def test_top_bins_count_events_and_evictions_as_the_brute_force(events, chunk):
    state = LiveState(bin_s=0.5)
    for k in range(0, len(events), chunk):
        state.feed_all(events[k:k + chunk])
    bin_ns = state.bin_ns
    want_events = Counter(ev.ts_ns // bin_ns for ev in events)
    want_evictions = Counter(ev.ts_ns // bin_ns for ev in events if isinstance(ev, s.BlockEvicted))
    assert {i: b.events for i, b in state.bins.items() if b.events} == dict(want_events)
    assert {i: b.evictions for i, b in state.bins.items() if b.evictions} == dict(want_evictions)
    assert state.events == len(events) and state.bad_events == 0


def test_a_malformed_event_is_counted_and_the_rest_folded():
    ledger = BlockLedger()
    good = [s.BlockAllocated(ts_ns=5, request_id="a", block_id=1),
            s.BlockAllocated(ts_ns=6, request_id="a", block_id=2)]
    bad = s.BlockReleased(ts_ns=7, request_id="a", block_id=[1], cached=True)  # unhashable block id
    ledger.apply_all([good[0], bad, good[1]])
    assert ledger.bad_events == 1
    assert ledger.held == {"a": {1, 2}} and ledger.holdings == 2 and ledger.block_events == 2


FAR = {b: (1 << 40) + 7 * b for b in range(12)}  # ids no pool index is: the ledger maps them


def _relabelled(ledger: BlockLedger, back: dict) -> dict:
    """The ledger's state with block ids mapped through ``back``."""
    def ids(blocks):
        return {back[b] for b in blocks}
    return {
        "held": {r: ids(bs) for r, bs in ledger.held.items()},
        "holders": {back[b]: h for b, h in ledger.holders.items()},
        "cached": ids(ledger.cached),
        "released_by": {back[b]: r for b, r in ledger.released_by.items()},
        "anomalies": [(a.kind, a.ts_ns, back[a.block_id], a.request_id) for a in ledger.anomalies],
        **{k: getattr(ledger, k) for k in ("holdings", "finished_holding", "finished_holding_blocks",
                                           "block_events", "anomaly_counts", "evictions", "bad_events",
                                           "open_allocated", "open_hits", "held_blocks", "cached_blocks")}}


@settings(max_examples=200, deadline=None)
@given(streams(), st.integers(1, 7), st.sets(st.integers(0, 11)))
def test_block_ids_that_are_no_pool_index_fold_as_the_same_stream_with_pool_indices(events, chunk, near):
    """Block ids beyond the lists' range (here 2^40 + 7b for the blocks not in ``near``, which
    keep their pool index) switch the ledger to ids mapped to list slots when the first comes,
    at any point of a stream: the state equals that of the same stream with the pool's own
    indices, relabelled."""
    label = {b: b if b in near else FAR[b] for b in range(12)}

    def relabel(ev):
        if not hasattr(ev, "block_id"):
            return ev
        fields = {"block_id": label[ev.block_id]}
        if isinstance(ev, s.BlockDeduplicated):
            fields["duplicate_block_id"] = label[ev.duplicate_block_id]
        return msgspec.structs.replace(ev, **fields)
    dense, mapped = BlockLedger(), BlockLedger()
    renamed = [relabel(ev) for ev in events]
    for k in range(0, len(events), chunk):
        dense.apply_all(events[k:k + chunk])
        mapped.apply_all(renamed[k:k + chunk])
    assert _relabelled(mapped, {v: k for k, v in label.items()}) == _relabelled(dense, {b: b for b in range(12)})
    assert (mapped._ids is not None) == any(label[getattr(ev, "block_id", 0)] >= 1 << 40 for ev in events
                                            if hasattr(ev, "block_id"))


def test_a_numpy_block_id_is_its_index_and_an_unhashable_one_a_bad_event():
    ledger = BlockLedger()
    ledger.apply_all([s.BlockAllocated(ts_ns=5, request_id="a", block_id=np.int64(3)),
                      s.BlockReleased(ts_ns=6, request_id="a", block_id=3, cached=True),
                      s.BlockReleased(ts_ns=7, request_id="a", block_id={3: 1}, cached=True)])
    assert (ledger.holdings, ledger.held_blocks, ledger.cached, ledger.bad_events) == (0, 0, {3: None}, 1)
    assert ledger._ids is None  # still indexed by the ids themselves
