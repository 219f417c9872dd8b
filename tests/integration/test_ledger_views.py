"""Top's own numbers, the exporter's metrics and the doctor's verdicts on one stream of block
events, each compared with a brute-force count written here (not with each other only).

The stream has what live views meet: a client joined mid-way (releases of blocks allocated
before it started, some kept as cached), a double release, a release of a block nobody ever
allocated, prefix hits on cached blocks, evictions, and 260 finished requests with leaks among
the first (top's old list of the last 200 finished requests lost them).
"""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.exposition import generate_latest
from prometheus_client.core import CollectorRegistry

from kvdiag.events import schema as s
from kvdiag.diagnosis import doctor, leak_rules, leaks, pool_fragmentation
from kvdiag.diagnosis.frames import load, node_events
from kvdiag.diagnosis.rules import RELEASE_GRACE_NS
from kvdiag.pool.blockledger import ANOMALY_KINDS, EXAMPLES_KEPT
from kvdiag.events.log_writer import LogWriter
from kvdiag.prometheus.exporter import PrometheusSink
from kvdiag.live.state import LiveState

NUM_BLOCKS = 512
MS = 1_000_000
LEAKERS = {3: "some", 10: "all", 41: "all"}  # request index -> which blocks it never releases
HEADER = s.LogHeader(schema_version=s.SCHEMA_VERSION, host="n1", engine="test", block_size_tokens=16)


def stream(n_requests: int = 260, seed: int = 7) -> list[s.Event]:
    """The event stream (distinct, increasing timestamps: the doctor rebuilds the order from
    them)."""
    rng = random.Random(seed)
    t = [1_000 * MS]
    out: list[s.Event] = []

    def emit(cls, **kw):
        t[0] += rng.randint(1, 3) * MS
        out.append(cls(ts_ns=t[0], **kw))

    emit(s.KVPoolInfo, num_blocks=NUM_BLOCKS, block_size_tokens=16, block_bytes=4096, num_layers=2,
         num_kv_heads=1, head_dim=8, dtype="float32")
    # joined mid-way: blocks 400.. were allocated before the stream began
    for i in range(6):
        emit(s.BlockReleased, request_id=f"before-{i}", block_id=400 + i, cached=i % 2 == 0)
    free = list(range(150))  # small enough that the cache gets evicted
    rng.shuffle(free)
    cached: list[int] = [400, 402, 404]
    for i in range(n_requests):
        rid = f"r{i}"
        emit(s.RequestArrived, request_id=rid, prompt_tokens=64)
        mine = []
        if cached and rng.random() < 0.5:
            b = cached.pop(rng.randrange(len(cached)))
            emit(s.PrefixHit, request_id=rid, block_id=b, num_tokens=16)
            mine.append(b)
        for _ in range(rng.randint(2, 4)):
            if not free:
                b = cached.pop(0)
                emit(s.BlockEvicted, block_id=b)
                free.append(b)
            b = free.pop()
            emit(s.BlockAllocated, request_id=rid, block_id=b)
            mine.append(b)
        emit(s.RequestFinished, request_id=rid, prompt_tokens=64, output_tokens=8, e2e_ns=5 * MS)
        keep = {"some": mine[:1], "all": mine}.get(LEAKERS.get(i), [])
        for b in mine:
            if b in keep:
                continue
            to_cache = rng.random() < 0.4
            emit(s.BlockReleased, request_id=rid, block_id=b, cached=to_cache)
            (cached if to_cache else free).append(b)
        if i == 20:  # released twice
            emit(s.BlockReleased, request_id=rid, block_id=mine[-1])
        if i == 30:  # a block nobody allocated
            emit(s.BlockReleased, request_id=rid, block_id=499)
        if i == 41:
            leaked41 = mine
    emit(s.BlockEvicted, block_id=leaked41[0])  # evicts a held block: it stays held
    emit(s.BlockAllocated, request_id="thief", block_id=leaked41[1])  # reassigned: r41 loses it
    emit(s.BlockReleased, request_id="thief", block_id=leaked41[1])
    t[0] += RELEASE_GRACE_NS  # the last requests' grace is over too
    emit(s.EngineStep, step_id=1, phase="decode", batch_size=1, num_tokens=1, decode_tokens=1, duration_ns=MS)
    return out


def brute_force(events: list[s.Event], now_ns: int) -> dict:
    """The pool by definition (kvdiag/pool/blockledger.py's docstring), recomputed from scratch with
    plain sets: holders per block, releasers per block since its allocation."""
    holders: dict[int, set] = {}
    released: dict[int, set] = {}
    cached: set[int] = set()
    finished: dict[str, int] = {}
    anomalies = dict.fromkeys(ANOMALY_KINDS, 0)
    for ev in events:
        if isinstance(ev, s.BlockAllocated):
            if holders.get(ev.block_id):
                anomalies["alloc_in_use"] += 1
            holders[ev.block_id] = {ev.request_id}
            released[ev.block_id] = set()
            cached.discard(ev.block_id)
        elif isinstance(ev, s.PrefixHit):
            holders.setdefault(ev.block_id, set()).add(ev.request_id)
            released.setdefault(ev.block_id, set()).discard(ev.request_id)
            cached.discard(ev.block_id)
        elif isinstance(ev, s.BlockReleased):
            h = holders.setdefault(ev.block_id, set())
            if ev.request_id in h:
                h.discard(ev.request_id)
                released.setdefault(ev.block_id, set()).add(ev.request_id)
                if not h and ev.cached:
                    cached.add(ev.block_id)
            elif ev.request_id in released.get(ev.block_id, ()):
                anomalies["double_release"] += 1
            else:
                anomalies["release_unheld"] += 1
                if not h and ev.cached:
                    cached.add(ev.block_id)
        elif isinstance(ev, s.BlockEvicted):
            if holders.get(ev.block_id):
                anomalies["evict_held"] += 1
            cached.discard(ev.block_id)
        elif isinstance(ev, s.RequestFinished):
            finished[ev.request_id] = ev.ts_ns
    held = {b for b, h in holders.items() if h}
    by_request: dict[str, set] = {}
    for b, h in holders.items():
        for r in h:
            by_request.setdefault(r, set()).add(b)
    leaking = {r: sorted(by_request[r]) for r, t in finished.items()
               if r in by_request and t <= now_ns - RELEASE_GRACE_NS}
    return {"held": len(held), "cached": len(cached), "free": NUM_BLOCKS - len(held) - len(cached),
            "leaking": leaking, "leaking_blocks": sum(len(v) for v in leaking.values()),
            "anomalies": anomalies}


@pytest.fixture(scope="module")
def events():
    return stream()


@pytest.fixture(scope="module")
def truth(events):
    return brute_force(events, events[-1].ts_ns)


def test_the_stream_has_what_it_claims(truth):
    assert set(truth["leaking"]) == {f"r{i}" for i in LEAKERS}
    assert truth["anomalies"]["double_release"] == 1
    assert truth["anomalies"]["release_unheld"] == 7  # 6 joined-mid-way + 1 never allocated
    assert truth["anomalies"]["evict_held"] == 1 and truth["anomalies"]["alloc_in_use"] == 1
    assert truth["cached"] > 0 and truth["free"] > 0


def test_top_snapshot_counts_the_pool_as_the_brute_force(events, truth):
    state = LiveState()
    state.set_header(HEADER)
    state.feed_all(events)
    snap = state.snapshot(events[-1].ts_ns)
    pool = snap.pool
    assert (pool.blocks_used, pool.blocks_cached) == (truth["held"], truth["cached"])
    assert (pool.ledger_held_blocks, pool.ledger_cached_blocks, pool.ledger_free_blocks) == \
        (truth["held"], truth["cached"], truth["free"])
    assert (pool.finished_holding_requests, pool.finished_holding_blocks) == \
        (len(truth["leaking"]), truth["leaking_blocks"])
    assert dict(pool.block_anomalies) == truth["anomalies"]
    alerts = {f.rule: f for f in snap.alerts}
    assert alerts["leak.release_paths"].status == "fail"
    assert alerts["leak.release_paths"].evidence["requests"] == truth["leaking"]
    assert alerts["leak.double_release"].status == "fail"
    assert alerts["leak.double_release"].evidence["count"] == truth["anomalies"]["double_release"]
    # top's request rows show the ledger's blocks
    rows = {r.request_id: r for r in snap.requests.rows}
    for rid in set(rows) & set(truth["leaking"]):
        assert list(rows[rid].block_ids) == truth["leaking"][rid]


def test_exporter_metrics_equal_the_brute_force(events, truth):
    sink = PrometheusSink(HEADER)
    try:
        for ev in events:
            sink.record(ev)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(sink)
        text = generate_latest(registry).decode()
    finally:
        sink.close()
    got: dict = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            got[(smp.name, smp.labels.get("state") or smp.labels.get("kind"))] = smp.value
    assert got[("kvdiag_kv_blocks", "requests")] == truth["held"]
    assert got[("kvdiag_kv_blocks", "prefix_cache")] == truth["cached"]
    assert got[("kvdiag_kv_blocks", "free")] == truth["free"]
    assert got[("kvdiag_finished_requests_holding_blocks", None)] == len(truth["leaking"])
    assert got[("kvdiag_finished_requests_held_blocks", None)] == truth["leaking_blocks"]
    for kind, count in truth["anomalies"].items():
        assert got[("kvdiag_kv_block_anomalies_total", kind)] == count, kind


def test_doctor_on_the_recorded_log_equals_the_brute_force(events, truth, tmp_path):
    path = tmp_path / "stream.kvlog"
    writer = LogWriter(path, HEADER)
    for ev in events:
        writer.record(ev)
    writer.close()
    logs = load([path])[0]
    findings, _ = doctor.run_rules(logs)
    by_rule = {f.rule: f for f in findings}
    held = by_rule["leak.release_paths"]
    assert held.status == "fail"
    assert held.evidence["requests"] == truth["leaking"]
    assert (held.evidence["num_requests"], held.evidence["num_blocks"]) == \
        (len(truth["leaking"]), truth["leaking_blocks"])
    assert by_rule["leak.double_release"].evidence["count"] == truth["anomalies"]["double_release"]
    replayed = node_events(logs, "n1", leak_rules.LEDGER_EVENTS)
    free_list = pool_fragmentation.replay_free_list(replayed)
    assert (free_list.used_blocks, free_list.cached_blocks, free_list.free_blocks) == \
        (truth["held"], truth["cached"], truth["free"])
    counts = leaks.anomaly_frame(leaks.ledger_from_events(replayed))["kind"].value_counts().to_dict()
    assert {k: counts.get(k, 0) for k in ANOMALY_KINDS} == truth["anomalies"]


def test_live_ledger_memory_collapses_finished_requests(events, truth):
    """Requests that finished and released everything leave nothing behind in a live ledger."""
    state = LiveState()
    state.feed_all(events)
    ledger = state.ledger
    assert ledger.history is None
    assert set(ledger.held) == set(truth["leaking"])
    assert len(ledger.anomalies) <= len(ANOMALY_KINDS) * EXAMPLES_KEPT


# ---------------------------------------------------------------------- any stream

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def block_streams(draw) -> list[s.Event]:
    """Random streams over 6 blocks and 4 requests, anomalies included; as engines do, a
    request only releases blocks once it has finished."""
    out: list[s.Event] = [s.KVPoolInfo(ts_ns=1, num_blocks=8, block_size_tokens=16, block_bytes=64,
                                       num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")]
    done: set[str] = set()
    for i in range(draw(st.integers(0, 60))):
        ts = 2 + i * RELEASE_GRACE_NS // 8
        kind = draw(st.sampled_from(["alloc", "hit", "release", "evict", "finish"]))
        rid, block = f"r{draw(st.integers(0, 3))}", draw(st.integers(0, 5))
        if kind in ("alloc", "hit") and rid in done:
            kind = "release"
        if kind == "alloc":
            out.append(s.BlockAllocated(ts_ns=ts, request_id=rid, block_id=block))
        elif kind == "hit":
            out.append(s.PrefixHit(ts_ns=ts, request_id=rid, block_id=block, num_tokens=16))
        elif kind == "release":
            out.append(s.BlockReleased(ts_ns=ts, request_id=rid, block_id=block, cached=draw(st.booleans())))
        elif kind == "evict":
            out.append(s.BlockEvicted(ts_ns=ts, block_id=block))
        elif rid not in done:
            done.add(rid)
            out.append(s.RequestFinished(ts_ns=ts, request_id=rid, prompt_tokens=16, output_tokens=1))
    return out


@settings(max_examples=300, deadline=None)
@given(block_streams())
def test_any_stream_ledger_top_and_exporter_count_as_the_brute_force(events):
    now = events[-1].ts_ns
    truth = brute_force(events, now)
    one, batch = LiveState(), LiveState()
    for ev in events:
        one.feed(ev)
    batch.feed_all(events)
    for state in (one, batch):
        pool = state.snapshot(now).pool
        ledger = state.ledger
        assert (ledger.held_blocks, ledger.cached_blocks, ledger.free_blocks) == \
            (truth["held"], truth["cached"], 8 - truth["held"] - truth["cached"])
        assert ledger.anomaly_counts == truth["anomalies"]
        assert ledger.held_by_finished(now, RELEASE_GRACE_NS) == truth["leaking"]
        assert ledger.holdings == sum(len(b) for b in ledger.held.values())
        if pool.finished_holding_requests is not None:
            assert (pool.finished_holding_requests, pool.finished_holding_blocks) == \
                (len(truth["leaking"]), truth["leaking_blocks"])
    history = leaks.ledger_from_events(events)  # the doctor's, with request records and episodes
    assert (history.held_blocks, history.cached_blocks, history.anomaly_counts) == \
        (truth["held"], truth["cached"], truth["anomalies"])


@pytest.mark.parametrize("name", ["demo_small/demo_24req_seed1.kvlog.gz", "vllm_demo/demo_16req_seed1.kvlog.gz"])
def test_batch_fold_is_the_event_by_event_fold(name):
    """``LiveState.feed_all`` (top's and the exporter's fold) gives the snapshot of ``feed``
    on each event, on recorded logs with every kind of event."""
    from pathlib import Path

    from kvdiag.events.eventlog import iter_events, read_header

    path = Path(__file__).parent.parent / "data" / name
    events = list(iter_events(path))
    one, batch = LiveState(), LiveState()
    for state in (one, batch):
        state.set_header(read_header(path))
    for ev in events:
        one.feed(ev)
    for k in range(0, len(events), 97):  # in uneven batches, as a source's polls deliver them
        batch.feed_all(events[k:k + 97])
    now = max(e.ts_ns for e in events)
    assert one.snapshot(now) == batch.snapshot(now)
    assert one.events == batch.events == len(events) and batch.bad_events == 0
