"""vLLM's KV event stream under kvdiag: the ZMQ subscriber (schema events, gaps, replay,
restarts, malformed payloads), recorded streams (gap finder, replay loader), the tally of
stored/duplicate/removed blocks and the ``kv_events.gaps`` rule.

Frames are encoded with msgspec structs that mirror vLLM's (``vllm.distributed.kv_events``);
with vLLM's environment (``kvdiag fetch-engine vllm``), vLLM's own ``ZmqEventPublisher``
publishes in a subprocess and the subscriber must receive what that process printed."""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import subprocess
import textwrap
import threading
import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from kvdiag.collectors.vllm_kv_events import KVEventSubscriber
from kvdiag.pool.prefix_cache import (PrefixCacheTally, SeqGap, find_seq_gaps, prefix_cache_counts)
from kvdiag.events.schema import (CollectorError, CollectorGap, PrefixCacheCleared, PrefixCacheRemoved,
                           PrefixCacheStored)

MASK63 = 2 ** 63 - 1
KV_TYPES = (PrefixCacheStored, PrefixCacheRemoved, PrefixCacheCleared)


# ---------------------------------------------------------------- vLLM's wire format, mirrored


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


_ENCODER = msgspec.msgpack.Encoder()


def payload(events, ts: Optional[float] = None, rank: Optional[int] = 0) -> bytes:
    return _ENCODER.encode(KVEventBatch(ts=time.time() if ts is None else ts, events=events,
                                        data_parallel_rank=rank))


def fold(h) -> int:
    """The 63-bit key of a vLLM hash, computed here independently of kvdiag."""
    if isinstance(h, int):
        return h % 2 ** 63
    return int.from_bytes(bytes(h)[:8], "little") % 2 ** 63


def expected_events(batches: list[tuple[int, float, list]]) -> list:
    """The schema events a batch list (seq, ts, events as plain dicts) must give."""
    out = []
    for seq, ts, events in batches:
        ts_ns = int(ts * 1e9)
        for ev in events:
            if ev["type"] == "BlockStored":
                parent = ev["parent_block_hash"]
                out.append(PrefixCacheStored(
                    ts_ns=ts_ns, seq=seq, block_hashes=[fold(h) for h in ev["block_hashes"]],
                    parent_hash=None if parent is None else fold(parent), token_ids=ev["token_ids"],
                    block_size_tokens=ev["block_size"], medium=ev["medium"],
                    group_idx=ev.get("group_idx")))
            elif ev["type"] == "BlockRemoved":
                out.append(PrefixCacheRemoved(ts_ns=ts_ns, seq=seq,
                                              block_hashes=[fold(h) for h in ev["block_hashes"]],
                                              medium=ev["medium"], group_idx=ev.get("group_idx")))
            else:
                out.append(PrefixCacheCleared(ts_ns=ts_ns, seq=seq))
    return out


class WaitSink:
    """A sink that lets a test wait for what it recorded."""

    def __init__(self) -> None:
        self.events: list = []
        self._cond = threading.Condition()

    def record(self, event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def flush(self) -> None:
        pass

    def of(self, *classes) -> list:
        with self._cond:
            return [e for e in self.events if isinstance(e, classes)]

    def wait_for(self, predicate, timeout_s: float = 10.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self), timeout_s), \
                f"timed out; recorded: {self.events}"


class MiniPublisher:
    """vLLM's publisher protocol in a few lines: PUB (topic, seq, payload) and a ROUTER that
    answers a start seq with (client, "", topic, seq, payload)... then the end marker. Seqs
    are the test's to choose, so that one can be skipped."""

    def __init__(self, topic: str = "kv", replay: bool = False) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.buffer: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self.forget: set[int] = set()  # seqs the replay buffer no longer holds
        self.replay_endpoint = None
        self._stop = threading.Event()
        self._thread = None
        if replay:
            router = self.ctx.socket(zmq.ROUTER)
            router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    def send(self, seq: int, data: bytes, frames: Optional[list[bytes]] = None) -> None:
        with self._lock:
            self.buffer[seq] = data
        self.pub.send_multipart(frames or [self.topic, seq.to_bytes(8, "big"), data])

    def _serve(self, router) -> None:
        while not self._stop.is_set():
            if router.poll(20):
                client, _, start = router.recv_multipart()
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    buffered = sorted(self.buffer.items())
                for seq, data in buffered:
                    if seq >= start_seq and seq not in self.forget:
                        router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), data])
                router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        router.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(2)
        self.pub.close(0)
        self.ctx.term()


def handshake(pub: MiniPublisher, sub: KVEventSubscriber, seq: int = 0) -> int:
    """ZMQ's slow joiner: publish empty batches until the subscriber has one, then wait for the
    last one sent (every probe after the first received one arrives too, in order); returns the
    next seq."""
    deadline = time.monotonic() + 10
    while sub.batches == 0:
        assert time.monotonic() < deadline, "the subscriber never received a probe"
        pub.send(seq, payload([]))
        seq += 1
        wait_start = time.monotonic()
        while sub.batches == 0 and time.monotonic() - wait_start < 0.1:
            time.sleep(0.005)
    # a probe slower than 0.1 s was followed by another: wait for the last one too, so that the
    # caller's count of batches starts after every probe
    while sub._seq.expected != seq:
        assert time.monotonic() < deadline, "the subscriber never received the last probe"
        time.sleep(0.005)
    return seq


def store(hashes, parent, tokens, block_size=4, medium="GPU", group=0):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=block_size, lora_id=None, medium=medium, lora_name=None,
                       group_idx=group)


def as_dicts(events) -> list[dict]:
    """Events as the subscriber decodes them: maps with ``type``, bytes kept."""
    return [msgspec.msgpack.decode(_ENCODER.encode(e)) for e in events]


class Dropping(KVEventSubscriber):
    """Loses the given seqs once, as a subscriber whose queue overflowed would."""

    def __init__(self, *args, drop=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drop = set(drop)

    def _on_message(self, frames) -> None:
        if len(frames) == 3 and int.from_bytes(frames[1], "big") in self.drop:
            self.drop.discard(int.from_bytes(frames[1], "big"))
            return
        super()._on_message(frames)


@pytest.fixture
def publisher():
    pub = MiniPublisher(replay=True)
    yield pub
    pub.close()


# ---------------------------------------------------------------- live subscriber


def test_subscriber_turns_batches_into_schema_events_and_reports_a_skipped_seq(publisher):
    sink = WaitSink()
    sub = KVEventSubscriber(publisher.endpoint, sink, topic="kv").start()
    try:
        seq = handshake(publisher, sub)
        probes = sub.batches
        sha = hashlib.sha256(b"block").digest()
        a = [store([2 ** 64 - 5, 7], None, list(range(8))),
             store([sha], 7, [8, 9, 10, 11], medium="CPU", group=1)]
        b = [BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0), AllBlocksCleared()]
        ts_a, ts_b = 1_700_000_000.25, 1_700_000_001.5
        publisher.send(seq, payload(a, ts_a))
        publisher.send(seq + 2, payload(b, ts_b))  # seq + 1 never comes
        sink.wait_for(lambda s: len(s.of(*KV_TYPES)) == 4)
    finally:
        sub.stop()
    want = expected_events([(seq, ts_a, as_dicts(a)), (seq + 2, ts_b, as_dicts(b))])
    assert sink.of(*KV_TYPES) == want
    assert want[1].block_hashes == [int.from_bytes(sha[:8], "little") % 2 ** 63]
    gaps = sink.of(CollectorGap)
    assert gaps == [CollectorGap(ts_ns=int(ts_b * 1e9), collector="vllm-kv-events",
                                 start_ns=int(ts_a * 1e9), end_ns=int(ts_b * 1e9), dropped_events=1)]
    assert (sub.batches, sub.events, sub.gaps, sub.dropped_batches, sub.errors) == (probes + 2, 4, 1, 1, 0)
    # the gap is recorded before the batch that revealed it
    kinds = [type(e) for e in sink.events]
    assert kinds.index(CollectorGap) == kinds.index(PrefixCacheRemoved) - 1


STOP_WITHIN_S = 1.5
"""A stopped subscriber ends within its poll interval (0.1 s); one that waited on the socket
instead would end only at ``stop()``'s 2 s join timeout, still running. Far below that, far
above a busy machine's scheduling delay."""


def test_malformed_payloads_are_reported_once_and_the_subscriber_goes_on(publisher):
    sink = WaitSink()
    sub = KVEventSubscriber(publisher.endpoint, sink, topic="kv").start()
    try:
        seq = handshake(publisher, sub)
        publisher.send(seq, b"\xc1 not msgpack")
        publisher.send(seq + 1, _ENCODER.encode({"ts": 1.0}))  # msgpack, not a batch
        publisher.send(seq + 2, b"", frames=[b"kv", b"\x00\x01"])  # a 2-frame message
        publisher.send(seq + 2, payload([store([5], None, [1, 2, 3, 4])], 2.0))
        sink.wait_for(lambda s: s.of(PrefixCacheStored))
        assert sub.running
        # a seq that goes back: the publisher restarted
        publisher.send(0, payload([store([6], None, [5, 6, 7, 8])], 3.0))
        sink.wait_for(lambda s: len(s.of(PrefixCacheStored)) == 2)
        t0 = time.monotonic()
    finally:
        sub.stop()
    assert time.monotonic() - t0 < STOP_WITHIN_S
    assert not sub.running
    assert (sub.malformed, sub.errors, sub.restarts, sub.gaps) == (3, 3, 1, 0)
    errors = sink.of(CollectorError)
    assert "not msgpack" in errors[0].message and errors[0].count == 1
    assert "went back from" in errors[1].message and "restarted" in errors[1].message
    assert errors[-1].count == 2 and "3 undecodable" in errors[-1].message  # summary at stop
    assert len(errors) == 3 and not sink.of(CollectorGap)
    assert sub.tally.counts.restarts == 1


def test_stop_is_prompt_when_nothing_arrives():
    sink = WaitSink()
    sub = KVEventSubscriber("tcp://127.0.0.1:9", sink).start()  # nobody publishes there
    assert sub.running
    t0 = time.monotonic()
    sub.stop()
    assert time.monotonic() - t0 < STOP_WITHIN_S and not sub.running
    assert sink.events == []


def test_a_bad_endpoint_is_an_error_event_not_an_exception():
    sink = WaitSink()
    sub = KVEventSubscriber("no-such-transport://x", sink).start()
    sub.stop()
    assert [e.collector for e in sink.of(CollectorError)] == ["vllm-kv-events"]
    assert "cannot subscribe" in sink.of(CollectorError)[0].message


def test_replay_endpoint_fills_lost_batches_and_only_the_rest_is_a_gap(publisher):
    sink = WaitSink()
    sub = Dropping(publisher.endpoint, sink, topic="kv", replay_endpoint=publisher.replay_endpoint)
    sub.start()
    try:
        seq = handshake(publisher, sub)
        batches = [(seq + i, 100.0 + i, [store([1000 + i], None, [i] * 4)]) for i in range(6)]
        sub.drop = {seq + 1, seq + 3, seq + 4}
        publisher.forget = {seq + 4}  # the publisher's replay buffer no longer has it
        for s, ts, evs in batches:
            publisher.send(s, payload(evs, ts))
        sink.wait_for(lambda s: any(e.seq == seq + 5 for e in s.of(PrefixCacheStored)))
    finally:
        sub.stop()
    kept = [b for b in batches if b[0] != seq + 4]
    assert sink.of(*KV_TYPES) == expected_events([(s, ts, as_dicts(e)) for s, ts, e in kept])
    assert sub.replayed_batches == 2
    assert sink.of(CollectorGap) == [CollectorGap(ts_ns=int(105.0 * 1e9), collector="vllm-kv-events",
                                                  start_ns=int(102.0 * 1e9), end_ns=int(105.0 * 1e9),
                                                  dropped_events=1)]
    assert (sub.gaps, sub.dropped_batches) == (1, 1)


# ---------------------------------------------------------------- recorded streams


def test_recorded_stream_keeps_its_seqs_gaps_are_found_and_replay_reads_it(publisher, tmp_path):
    from kvdiag.traces.detect import detect_format
    from kvdiag.traces.kv_event_traces import kv_event_gaps
    from kvdiag.traces.loaders import load_trace

    raw = tmp_path / "kv_events.jsonl"
    sink = WaitSink()
    sub = KVEventSubscriber(publisher.endpoint, sink, topic="kv", raw_path=raw).start()
    prompts = []
    try:
        seq = handshake(publisher, sub)
        parent = None
        for i in range(5):  # a growing conversation: each batch stores one more block
            toks = list(range(4 * i, 4 * i + 4))
            h = hashlib.sha256(repr(toks).encode()).digest()  # bytes hashes: JSON lists of ints
            publisher.send(seq + i, payload([store([h], parent, toks)], 10.0 + i))
            parent = h
            prompts.append(list(range(4 * i + 4)))
        sink.wait_for(lambda s: len(s.of(PrefixCacheStored)) == 5)
    finally:
        sub.stop()
    lines = raw.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["seq"] for r in rows] == list(range(seq - sub.batches + 5, seq + 5))
    assert detect_format(raw) == "vllm"
    assert kv_event_gaps(raw) == []
    trace = load_trace(raw, format="vllm")
    assert trace.prompt_tokens.tolist() == [len(p) for p in prompts]
    assert any("5 blocks stored, 0 of them already cached" in n for n in trace.notes)

    cut = tmp_path / "cut.jsonl"
    lost = next(i for i, r in enumerate(rows) if r["seq"] == seq + 2)
    cut.write_text("\n".join(lines[:lost] + lines[lost + 1:]) + "\n")
    assert kv_event_gaps(cut) == [SeqGap(seq + 2, seq + 2, int(11.0 * 1e9), int(13.0 * 1e9))]
    assert load_trace(cut, format="vllm").rows == 4


def test_gap_finder_on_a_kvdiag_log(tmp_path):
    from kvdiag.traces.kv_event_traces import kv_event_gaps
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter

    path = tmp_path / "kv.kvlog"
    with LogWriter(path, make_header(engine="vllm")) as w:
        for seq in (0, 1, 2, 5, 6, 0, 1, 3):  # 3-4 lost, a restart, then 2 lost
            for k in range(2):  # two events a batch
                w.record(PrefixCacheStored(ts_ns=1000 * seq + 7, seq=seq, block_hashes=[seq * 10 + k]))
    assert kv_event_gaps(path) == [SeqGap(3, 4, 2007, 5007), SeqGap(2, 2, 1007, 3007)]


def test_find_seq_gaps_matches_a_brute_force_scan():
    rng = random.Random(3)
    for _ in range(200):
        seqs, s = [], rng.randrange(5)
        for _ in range(rng.randrange(30)):
            seqs.append(s)
            s = rng.choice([s + 1, s + 1, s + 2, s + 4, 0])  # next, lost, restart
        want, prev = [], None
        for s in seqs:
            if prev is not None and s > prev + 1:
                want.append((prev + 1, s - 1))
            prev = s
        got = find_seq_gaps([(s, None) for s in seqs])
        assert [(g.first_seq, g.last_seq) for g in got] == want
        assert sum(g.lost_batches for g in got) == sum(b - a + 1 for a, b in want)


# ---------------------------------------------------------------- stored / duplicate / removed


def test_tally_matches_a_list_simulation():
    """Duplicates, removals of unknown keys and clears against a plain list of held keys."""
    rng = random.Random(7)
    for _ in range(100):
        tally, held = PrefixCacheTally(), []
        stored = dup = removed = unknown = clears = 0
        for _ in range(rng.randrange(60)):
            op = rng.random()
            keys = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            medium = rng.choice(["GPU", "CPU"])
            if op < 0.55:
                tally.stored(keys, medium)
                for k in keys:
                    stored += 1
                    dup += (medium, k) in held
                    held.append((medium, k))
            elif op < 0.95:
                tally.removed(keys, medium)
                for k in keys:
                    removed += 1
                    if (medium, k) in held:
                        held.remove((medium, k))
                    else:
                        unknown += 1
            else:
                tally.cleared()
                held.clear()
                clears += 1
        c = tally.counts
        assert (c.stored_blocks, c.duplicate_stores, c.removed_blocks, c.removed_unknown, c.clears,
                c.held_blocks) == (stored, dup, removed, unknown, clears, len(held))
        assert c.duplicate_share == (dup / stored if stored else None)


def test_the_replay_loader_and_the_live_subscriber_count_the_same(publisher, tmp_path):
    """Two requests compute one prefix at once (a duplicate store), one copy is evicted, the
    prefix is stored again (a duplicate: the other copy is still cached), then everything is
    cleared: the live tally, the counts of the recorded schema events and the replay loader's
    notes agree."""
    from kvdiag.traces.loaders import load_trace

    raw = tmp_path / "kv.jsonl"
    sink = WaitSink()
    sub = KVEventSubscriber(publisher.endpoint, sink, topic="kv", raw_path=raw).start()
    try:
        seq = handshake(publisher, sub)
        script = [[store([1, 2], None, list(range(8)))], [store([1, 2], None, list(range(8)))],
                  [BlockRemoved(block_hashes=[2], medium="GPU", group_idx=0)],
                  [store([2, 3], 1, list(range(4, 12)))], [AllBlocksCleared()],
                  [BlockRemoved(block_hashes=[9], medium="GPU", group_idx=0)]]
        for i, evs in enumerate(script):
            publisher.send(seq + i, payload(evs, 50.0 + i))
        sink.wait_for(lambda s: len(s.of(*KV_TYPES)) == 6)
    finally:
        sub.stop()
    live = sub.tally.counts
    assert (live.stored_blocks, live.duplicate_stores, live.removed_blocks, live.removed_unknown,
            live.clears, live.held_blocks) == (6, 3, 2, 1, 1, 0)
    assert prefix_cache_counts(sink.events) == live
    notes = load_trace(raw, format="vllm").notes
    assert "vLLM KV events: 6 blocks stored, 3 of them already cached (duplicate stores), " \
           "2 removed, 1 clears" in notes


# ---------------------------------------------------------------- the doctor rule


def _log(path, events):
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.events.schema import EngineStep

    with LogWriter(path, make_header(engine="vllm", node="n1")) as w:
        w.record(EngineStep(ts_ns=1, step_id=0, phase="prefill", batch_size=1, num_tokens=4,
                            duration_ns=10))
        for ev in events:
            w.record(ev)
    return path


def test_kv_events_gaps_rule_live_and_offline(tmp_path):
    from test_rules_live_offline import live_findings, offline_findings

    stored = [PrefixCacheStored(ts_ns=10 + s, seq=s, block_hashes=[s]) for s in (0, 1, 3, 4)]
    gap = CollectorGap(ts_ns=13, collector="vllm-kv-events", start_ns=11, end_ns=13, dropped_events=1)
    other_gap = CollectorGap(ts_ns=13, collector="eventlog", start_ns=11, end_ns=13, dropped_events=9)
    cases = {"gap": (stored[:2] + [gap] + stored[2:] + [other_gap], "warn"),
             "complete": ([*stored, PrefixCacheCleared(ts_ns=20, seq=5), other_gap], "pass"),
             "none": ([other_gap], "n/a")}
    for name, (events, status) in cases.items():
        path = _log(tmp_path / f"{name}.kvlog", events)
        offline = offline_findings(path)["kv_events.gaps"]
        assert offline.status == status, (name, offline)
        live = live_findings(path)["kv_events.gaps"]
        assert (live.status, live.message, live.evidence) == (offline.status, offline.message,
                                                             offline.evidence)
    path = tmp_path / "gap.kvlog"
    f = offline_findings(path)["kv_events.gaps"]
    assert f.evidence == {"batches_received": 4, "kv_events": 4, "gaps": 1, "lost_batches": 1,
                          "first_gap_ns": [11, 13]}
    f = offline_findings(tmp_path / "complete.kvlog")["kv_events.gaps"]
    assert f.evidence["batches_received"] == 5 and f.evidence["gaps"] == 0


# ---------------------------------------------------------------- vLLM's own publisher


DRIVER = textwrap.dedent('''
    import hashlib, json, sys, time
    import zmq
    from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                            KVEventBatch, ZmqEventPublisher)

    # "*" makes vLLM bind (an address without it is connected to); the OS picks the port
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint="tcp://127.0.0.1:*",
                            replay_endpoint=sys.argv[1], topic="kv")
    endpoint = pub._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # before any publish: idle socket
    print(json.dumps({"endpoint": endpoint}), flush=True)
    seq, n_blocks, parent = 0, 0, None

    def show(h):
        return {"hex": h.hex()} if isinstance(h, bytes) else h

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        events = []
        if cmd["op"] == "publish":
            for _ in range(cmd.get("stores", 1)):
                toks = list(range(n_blocks * 8, n_blocks * 8 + 16))
                hashes = [hashlib.sha256(f"{n_blocks}-{j}".encode()).digest() for j in range(2)]
                if n_blocks % 4 == 0:  # vLLM's default: ints of the sha256's 8 top bytes
                    hashes = [int.from_bytes(h, "big") & (2 ** 64 - 1) for h in hashes]
                events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                          token_ids=toks, block_size=8, lora_id=None,
                                          medium="GPU", lora_name=None, group_idx=0))
                parent, n_blocks = hashes[-1], n_blocks + 2
            if cmd.get("remove"):
                events.append(BlockRemoved(block_hashes=[parent], medium="GPU", group_idx=0))
            if cmd.get("clear"):
                events.append(AllBlocksCleared())
        batch = KVEventBatch(ts=time.time(), events=events)
        pub.publish(batch)
        shown = []
        for ev in events:
            d = {"type": type(ev).__name__}
            for f in ev.__struct_fields__:
                v = getattr(ev, f)
                d[f] = [show(h) for h in v] if f == "block_hashes" else show(v) if f == "parent_block_hash" else v
            shown.append(d)
        print(json.dumps({"seq": seq, "ts": batch.ts, "events": shown}), flush=True)
        seq += 1
    pub.shutdown()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unhex(obj):
    if isinstance(obj, dict) and set(obj) == {"hex"}:
        return bytes.fromhex(obj["hex"])
    if isinstance(obj, list):
        return [_unhex(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _unhex(v) for k, v in obj.items()}
    return obj


class VllmDriver:
    """vLLM's ZmqEventPublisher in a subprocess with vLLM's Python; every batch it publishes
    it also prints (seq, ts, events), which the tests compare the subscriber's events with."""

    def __init__(self, python) -> None:
        self.replay_endpoint = f"tcp://127.0.0.1:{_free_port()}"
        env = dict(os.environ, VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="ERROR")
        self.proc = subprocess.Popen([str(python), "-c", DRIVER, self.replay_endpoint],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
        ready = self.proc.stdout.readline()
        assert ready, "vLLM's publisher did not start"
        self.endpoint = json.loads(ready)["endpoint"]
        self.published: list[tuple[int, float, list]] = []  # content batches, in seq order

    def send(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        if out["events"]:
            self.published.append((out["seq"], out["ts"], _unhex(out["events"])))
        return out

    def handshake(self, sub: KVEventSubscriber) -> None:
        deadline = time.monotonic() + 20
        while sub.batches == 0:
            assert time.monotonic() < deadline, "the subscriber never received vLLM's batches"
            self.send(op="probe")
            t0 = time.monotonic()
            while sub.batches == 0 and time.monotonic() - t0 < 0.2:
                time.sleep(0.01)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def vllm_publisher(vllm_python):
    driver = VllmDriver(vllm_python)
    yield driver
    driver.close()


@pytest.mark.vllm
def test_vllm_publisher_batches_arrive_as_published(vllm_publisher):
    sink = WaitSink()
    sub = KVEventSubscriber(vllm_publisher.endpoint, sink, topic="kv",
                            replay_endpoint=vllm_publisher.replay_endpoint).start()
    try:
        vllm_publisher.handshake(sub)
        first = len(vllm_publisher.published)
        for i in range(5):
            vllm_publisher.send(op="publish", stores=1 + i % 2, remove=i == 3, clear=i == 4)
        want = expected_events(vllm_publisher.published[first:])
        sink.wait_for(lambda s: len(s.of(*KV_TYPES)) == len(want))
    finally:
        sub.stop()
    assert sink.of(*KV_TYPES) == want
    assert any(isinstance(h, bytes) for _, _, evs in vllm_publisher.published[first:]
               for ev in evs for h in ev.get("block_hashes", []))  # both hash kinds were seen
    assert (sub.gaps, sub.errors, sub.malformed) == (0, 0, 0)
    assert not sink.of(CollectorGap, CollectorError)


@pytest.mark.vllm
def test_vllm_replay_endpoint_fills_a_late_join_and_a_dropped_batch(vllm_publisher):
    for _ in range(3):  # published before the subscriber exists
        vllm_publisher.send(op="publish")
    sink = WaitSink()
    sub = Dropping(vllm_publisher.endpoint, sink, topic="kv",
                   replay_endpoint=vllm_publisher.replay_endpoint, replay_history=True).start()
    try:
        vllm_publisher.handshake(sub)
        nxt = vllm_publisher.send(op="publish")["seq"]
        sub.drop = {nxt + 1}
        for _ in range(3):
            vllm_publisher.send(op="publish")
        want = expected_events(vllm_publisher.published)  # everything since seq 0
        sink.wait_for(lambda s: len(s.of(*KV_TYPES)) == len(want))
    finally:
        sub.stop()
    assert sink.of(*KV_TYPES) == want
    assert not sub.drop and sub.replayed_batches >= 4  # the history and the dropped batch
    assert (sub.gaps, sub.dropped_batches, sub.errors) == (0, 0, 0)
    assert not sink.of(CollectorGap, CollectorError)
