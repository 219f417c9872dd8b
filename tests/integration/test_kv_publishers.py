"""KV-event streams of each publisher kvdiag reads, and their health.

The recorded streams under ``tests/data/kv_publishers/`` are the bytes that SGLang's and
vLLM's own ``ZmqEventPublisher`` classes sent (``record.py`` there, README): the subscriber
must decode every event, keep the tiers apart by ``medium``, and find gaps, duplicates and a
late join in them. :class:`kvdiag.pool.kv_stream_health.StreamHealth` is checked on constructed
streams against a plain list simulation, and the doctor's ``kv_events.health`` on a log."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from kvdiag.collectors import servers
from kvdiag.collectors.metrics import engine_metrics, parse_prometheus
from kvdiag.collectors.vllm_kv_events import KVEventSubscriber
from kvdiag.pool.kv_stream_health import STORM_CLEARS, StreamHealth
from kvdiag.pool.prefix_cache import MASK63, medium_tier
from kvdiag.events.schema import (CollectorError, CollectorGap, PrefixCacheCleared, PrefixCacheRemoved,
                           PrefixCacheStored)

DATA = Path(__file__).parent.parent / "data" / "kv_publishers"
STREAMS = {"sglang": DATA / "sglang_0.5.23.jsonl", "vllm": DATA / "vllm_0.32.0.jsonl"}
KV_TYPES = (PrefixCacheStored, PrefixCacheRemoved, PrefixCacheCleared)
HOST = {"sglang": "CPU_PINNED", "vllm": "CPU"}


class ListSink:
    def __init__(self) -> None:
        self.events: list = []

    def record(self, ev) -> None:
        self.events.append(ev)

    def flush(self) -> None:
        pass

    def of(self, *classes) -> list:
        return [e for e in self.events if isinstance(e, classes)]


def recorded(engine: str) -> list[list[bytes]]:
    return [[bytes.fromhex(f) for f in json.loads(line)["frames"]]
            for line in STREAMS[engine].read_text().splitlines()]


def feed(messages, **kw) -> tuple[KVEventSubscriber, ListSink]:
    """The subscriber's message handler over recorded messages, in order (no socket: the
    frames are what the publisher's PUB socket sent)."""
    sink = ListSink()
    sub = KVEventSubscriber("tcp://127.0.0.1:9", sink, **kw)
    for frames in messages:
        sub._on_message(frames)
    sub.stop()
    return sub, sink


@pytest.mark.parametrize("engine", sorted(STREAMS))
def test_each_publishers_own_stream_decodes_with_its_tiers(engine):
    msgs = recorded(engine)
    sub, sink = feed(msgs, publisher=engine)
    assert (sub.malformed, sub.errors, sub.gaps, sub.duplicate_batches) == (0, 0, 0, 0)
    evs = sink.of(*KV_TYPES)
    assert [type(e).__name__ for e in evs] == [
        "PrefixCacheStored"] * 3 + ["PrefixCacheRemoved"] + ["PrefixCacheStored"] + \
        ["PrefixCacheRemoved"] * 2 + ["PrefixCacheCleared"]
    first = evs[0]
    assert first.block_hashes == [(-5) & MASK63, 7] and first.parent_hash is None
    assert first.token_ids == list(range(8)) and first.block_size_tokens == 4
    assert evs[1].parent_hash == 7 and evs[4].block_hashes == [2 ** 62 + 3, 13]
    assert [e.medium for e in evs[:3]] == ["GPU", "GPU", HOST[engine]]
    assert [medium_tier(e.medium) for e in evs[:3]] == [0, 0, 1]
    seqs = [int.from_bytes(m[1], "big") for m in msgs]
    assert [e.seq for e in evs] == seqs[:5] + [seqs[5], seqs[5], seqs[6]]
    counts = sub.health.counts
    assert counts.late_join and counts.first_seq == seqs[0] > 0  # probes came before
    assert (counts.removed_before_stored, counts.duplicate_stores, counts.clears) == (0, 0, 1)
    assert counts.max_device_held_blocks == 4 and counts.device_held_blocks == 0


@pytest.mark.parametrize("engine", sorted(STREAMS))
def test_a_lost_and_a_duplicated_batch_are_found_in_each_publishers_stream(engine):
    msgs = recorded(engine)
    mangled = msgs[:2] + [msgs[1]] + msgs[3:]  # batch 2 lost, batch 1 delivered twice
    sub, sink = feed(mangled, publisher=engine)
    assert (sub.gaps, sub.dropped_batches, sub.duplicate_batches, sub.restarts) == (1, 1, 1, 0)
    gaps = sink.of(CollectorGap)
    assert len(gaps) == 1 and gaps[0].dropped_events == 1
    dup = [e for e in sink.of(CollectorError) if e.message.startswith("duplicate KV event")]
    assert len(dup) == 1 and dup[0].count == 1
    # the duplicate's events were not recorded twice; the lost batch's are missing
    assert len(sink.of(*KV_TYPES)) == len(feed(msgs)[1].of(*KV_TYPES)) - 1
    h = sub.health.counts
    assert (h.gaps, h.lost_batches, h.duplicate_batches) == (1, 1, 1)
    # the lost batch held the host-tier store its removal names: explained, not a fault
    assert h.removed_unknown_explained == 1 and h.removed_before_stored == 0


def test_sglang_bigram_pages_decode_without_token_ids_and_a_map_batch():
    from kvdiag.collectors.vllm_kv_events import decode_batch
    ev = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
          "token_ids": [[1, 2], [2, 3]], "block_size": 2, "lora_id": None, "medium": "DISK",
          "lora_name": "adapter-a", "cache_salt": "s"}
    payload = msgspec.msgpack.encode({"ts": 1.0, "events": [ev], "attn_dp_rank": 3})
    _, _, events, rank = decode_batch(payload, 0)
    assert rank == 3 and events[0].token_ids == [] and events[0].block_hashes == [1, 2]
    assert medium_tier(events[0].medium) == 2


# ---------------------------------------------------------------- StreamHealth


def simulate(batches, pool_blocks):
    """The checks by brute force over the whole stream: a list of batches (seq, ts_ns, events)."""
    out = dict(dup_batches=0, removed_before=0, explained=0, dup_stores=0, over=0, gaps=0)
    held: list = []
    seen: list[int] = []
    complete = None
    for seq, ts, evs in batches:
        if seen and seq in seen:
            out["dup_batches"] += 1
            continue
        if not seen:
            complete = seq == 0
        elif seq > seen[-1] + 1:
            out["gaps"] += 1
            complete = False
        seen.append(seq)
        for kind, keys in evs:
            if kind == "s":
                for k in keys:
                    out["dup_stores"] += k in held
                    held.append(k)
            elif kind == "r":
                for k in keys:
                    if k in held:
                        held.remove(k)
                    else:
                        out["removed_before" if complete else "explained"] += 1
            else:
                held.clear()
                complete = True
        out["over"] += len(held) > pool_blocks
    return out


def to_events(seq, ts, evs):
    for kind, keys in evs:
        if kind == "s":
            yield PrefixCacheStored(ts_ns=ts, seq=seq, block_hashes=keys, medium="GPU")
        elif kind == "r":
            yield PrefixCacheRemoved(ts_ns=ts, seq=seq, block_hashes=keys, medium="GPU")
        else:
            yield PrefixCacheCleared(ts_ns=ts, seq=seq)


@pytest.mark.parametrize("seed", range(6))
def test_stream_health_matches_a_brute_force_simulation(seed):
    rng = random.Random(seed)
    batches, seq = [], rng.choice([0, 0, 5])
    for i in range(300):
        evs = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            kind = "s" if r < 0.55 else "r" if r < 0.98 else "c"
            evs.append((kind, [rng.randint(0, 40) for _ in range(rng.randint(1, 3))] if kind != "c" else []))
        batches.append((seq, 1000 * i, evs))
        if rng.random() < 0.05 and i:
            batches.append(batches[rng.randint(max(0, len(batches) - 5), len(batches) - 1)])  # duplicate
        seq += 1 + (rng.random() < 0.03)  # sometimes a lost batch
    want = simulate(batches, pool_blocks=25)
    h = StreamHealth(pool_blocks=25)
    for s_, ts, evs in batches:  # as the subscriber does: the batch, then its events
        if h.batch(s_, ts):
            for ev in to_events(s_, ts, evs):
                h.event(ev)
    c = h.counts
    got = dict(dup_batches=c.duplicate_batches, removed_before=c.removed_before_stored,
               explained=c.removed_unknown_explained, dup_stores=c.duplicate_stores,
               over=c.over_pool_batches, gaps=c.gaps)
    assert got == want


def test_clear_storms_and_bounded_memory():
    h = StreamHealth()
    for i in range(2 * STORM_CLEARS):  # one storm, however many clears it has
        h.event(PrefixCacheCleared(ts_ns=i * 10 ** 9, seq=i))
    h.event(PrefixCacheCleared(ts_ns=10 ** 12, seq=99))
    assert (h.counts.clears, h.counts.clear_storms) == (2 * STORM_CLEARS + 1, 1)
    h = StreamHealth(pool_blocks=10)
    h.max_keys = 100
    for i in range(50):
        h.event(PrefixCacheStored(ts_ns=i, seq=i, block_hashes=list(range(i * 10, i * 10 + 10))))
    assert len(h._held) <= 100 and h.counts.forgotten_keys == 500 - len(h._held)
    assert h.counts.over_pool_batches == 49  # from the second batch on, above 10 blocks


def test_a_restart_is_not_a_duplicate():
    h = StreamHealth()
    for i in range(5):
        h.event(PrefixCacheStored(ts_ns=i, seq=i, block_hashes=[i]))
    assert not h.batch(3, 3)  # seq 3 again, same timestamp: a duplicate
    assert h.batch(3, 99) and h.counts.restarts == 1  # a new timestamp: the publisher restarted
    h2 = StreamHealth()
    for i in range(5):
        h2.event(PrefixCacheStored(ts_ns=i, seq=i + 100, block_hashes=[i]))
    assert h2.batch(0, 200) and h2.counts.restarts == 1  # seq 0 never seen: the publisher restarted


# ---------------------------------------------------------------- the doctor's rule


def test_doctor_kv_events_health_warns_on_a_store_missing_from_a_complete_stream(tmp_path):
    from kvdiag.diagnosis import doctor
    from kvdiag.diagnosis.frames import load
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter

    def log(events, name):
        path = tmp_path / name
        w = LogWriter(path, make_header(engine="attach"))
        for ev in events:
            w.record(ev)
        w.close()
        return doctor.run_rules(load([str(path)])[0])[0]

    ok = [PrefixCacheStored(ts_ns=1, seq=0, block_hashes=[1, 2]),
          PrefixCacheRemoved(ts_ns=2, seq=1, block_hashes=[1])]
    bad = ok + [PrefixCacheRemoved(ts_ns=3, seq=2, block_hashes=[77])]
    late = [PrefixCacheRemoved(ts_ns=3, seq=5, block_hashes=[77])]
    got = {name: [f for f in log(evs, name + ".jsonl") if f.rule == "kv_events.health"][0]
           for name, evs in (("ok", ok), ("bad", bad), ("late", late))}
    assert got["ok"].status == "pass" and got["bad"].status == "warn"
    assert got["bad"].evidence["removed_before_stored"] == 1
    assert got["late"].status == "pass" and got["late"].evidence["removed_unknown_explained"] == 1
    assert "joined at seq 5" in got["late"].message


# ---------------------------------------------------------------- engines besides vLLM


def test_sglang_and_tensorrt_llm_servers_are_recognised():
    assert servers.engine_of_cmdline(["python3", "-m", "sglang.launch_server", "--model", "m"]) == "sglang"
    assert servers.engine_of_cmdline(["/usr/bin/trtllm-serve", "m"]) == "trtllm"
    assert servers.engine_of_cmdline(["python", "-m", "tensorrt_llm.commands.serve", "m"]) == "trtllm"
    assert servers.engine_of_cmdline(["python", "-m", "http.server"]) is None
    assert servers.engine_of_metrics(["sglang:token_usage", "sglang:num_running_reqs", "python_info"]) == "sglang"
    assert servers.engine_of_metrics(["trtllm_kv_cache_utilization"]) == "trtllm"


def test_sglang_and_tensorrt_llm_metrics_map_onto_engine_metrics():
    sglang = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 3
sglang:num_queue_reqs{model_name="m"} 2
sglang:token_usage{model_name="m"} 0.25
sglang:page_size{model_name="m"} 16
sglang:max_total_num_tokens{model_name="m"} 4096
# TYPE sglang:prompt_tokens counter
sglang:prompt_tokens_total{model_name="m"} 1000
# TYPE sglang:cached_tokens counter
sglang:cached_tokens_total{model_name="m"} 400
# TYPE sglang:num_retracted_requests counter
sglang:num_retracted_requests_total{model_name="m"} 1
"""
    m = engine_metrics(parse_prometheus(sglang))
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (3, 2, 0.25)
    assert (m.prefix_cache_queries_tokens, m.prefix_cache_hits_tokens, m.num_preemptions) == (1000, 400, 1)
    assert (m.block_size_tokens, m.num_blocks) == (16, 256)
    trt = """trtllm_num_requests_running{model_name="m",engine_type="trtllm"} 4
trtllm_num_requests_waiting{model_name="m",engine_type="trtllm"} 0
trtllm_kv_cache_utilization{model_name="m",engine_type="trtllm"} 0.5
trtllm_kv_cache_max_blocks{model_name="m",engine_type="trtllm"} 1024
trtllm_kv_cache_tokens_per_block{model_name="m",engine_type="trtllm"} 32
# TYPE trtllm_prompt_tokens counter
trtllm_prompt_tokens_total{model_name="m",engine_type="trtllm"} 900
# TYPE trtllm_prompt_cached_tokens counter
trtllm_prompt_cached_tokens_total{model_name="m",engine_type="trtllm"} 300
"""
    m = engine_metrics(parse_prometheus(trt))
    assert (m.num_requests_running, m.kv_cache_usage, m.num_blocks, m.block_size_tokens) == (4, 0.5, 1024, 32)
    assert (m.prefix_cache_queries_tokens, m.prefix_cache_hits_tokens) == (900, 300)


# ---------------------------------------------------------------- attach --kv-events


def test_attach_kv_events_reads_sglangs_stream_and_names_the_publisher(tmp_path):
    """``kvdiag attach PID --kv-events tcp://*:PORT`` on a process that is no recognised
    engine: it connects to the endpoint (a wildcard: the publisher binds), and the SGLang
    publisher's recorded bytes, sent once the subscription is seen (XPUB), arrive whole."""
    import signal
    import subprocess
    import sys
    import time

    import zmq

    from kvdiag.events.eventlog import iter_events
    from kvdiag.events.schema import CollectorStatus

    ctx = zmq.Context()
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    target = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    out = tmp_path / "attach.kvlog"
    proc = subprocess.Popen([sys.executable, "-m", "kvdiag", "attach", str(target.pid), "--duration", "120",
                             "--no-pyspy", "--json", "--out", str(out), "--kv-events", f"tcp://*:{port}",
                             "--kv-events-publisher", "sglang"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert xpub.poll(60_000), "attach never subscribed"
        assert xpub.recv()[:1] == b"\x01"  # the subscription message
        msgs = recorded("sglang")
        for frames in msgs:
            xpub.send_multipart(frames)
        raw = out.with_name(out.name + ".kvevents.jsonl")
        deadline = time.monotonic() + 60
        while not (raw.exists() and len(raw.read_text().splitlines()) == len(msgs)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        target.stdin.close()
        target.wait(10)
        ctx.destroy(0)
    assert proc.returncode == 0, stderr
    events = list(iter_events(out))
    status = [e for e in events if isinstance(e, CollectorStatus) and e.collector == "vllm-kv-events"]
    assert status and status[0].available and status[0].hint.startswith("publisher sglang: connect")
    kv = [e for e in events if isinstance(e, KV_TYPES)]
    assert len(kv) == 8 and {e.medium for e in kv if not isinstance(e, PrefixCacheCleared)} == {"GPU", "CPU_PINNED"}
    summary = json.loads(stdout)  # the collectors' lines name the publisher
    assert any(c["hint"].startswith("publisher sglang") for c in summary["collectors"])
    from kvdiag.diagnosis import doctor
    from kvdiag.diagnosis.frames import load
    findings = {f.rule: f for f in doctor.run_rules(load([str(out)])[0])[0]}
    assert findings["kv_events.health"].status == "pass"
    assert findings["kv_events.health"].evidence["first_seq"] == int.from_bytes(msgs[0][1], "big")
    assert findings["kv_events.gaps"].status == "pass"


def test_exporter_serves_the_stream_health_the_doctor_judges():
    """The exporter's counters are the live fold's: a lost batch, a duplicate batch (dropped by
    the fold) and a key removed before any store on a complete stream."""
    from kvdiag.events.eventlog import make_header
    from kvdiag.prometheus.exporter import PrometheusSink

    sink = PrometheusSink(make_header(engine="e", model="m", node="n"))
    for ev in (PrefixCacheStored(ts_ns=1, seq=0, block_hashes=[1]),
               PrefixCacheRemoved(ts_ns=2, seq=1, block_hashes=[9]),  # never stored
               PrefixCacheStored(ts_ns=1, seq=0, block_hashes=[1]),  # batch 0 again
               PrefixCacheStored(ts_ns=4, seq=3, block_hashes=[2])):  # batch 2 lost
        sink.record(ev)
    fams = {f.name: f for f in sink.collect()}
    problems = {s.labels["check"]: s.value for s in fams["kvdiag_kv_event_stream_problems"].samples
                if s.name.endswith("_total")}
    assert problems == {"lost_batches": 1, "duplicate_batches": 1, "removed_before_stored": 1,
                        "clear_storms": 0, "over_pool_batches": 0}
    assert [s.value for s in fams["kvdiag_kv_event_batches"].samples if s.name.endswith("_total")] == [3]


def test_tensorrt_llm_serialized_events_map_into_the_schema_by_cache_level():
    """TensorRT-LLM's events in the shape its ``KVCacheEventSerializer`` writes (written out here
    from that serializer's fields: TensorRT-LLM needs CUDA and publishes no ZMQ stream of its
    own, so no recording of it exists), inside a batch as a relay would forward them."""
    from kvdiag.collectors.vllm_kv_events import decode_batch

    def block(h, toks, level):
        return {"type": "stored_block", "block_hash": h, "cache_level": level, "priority": 35,
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in toks]}

    events = [
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [64, 128]}, "window_size": 32},
        {"event_id": 1, "window_size": 32, "data": {"type": "stored", "parent_hash": None, "blocks": [
            block(10, [1, 2, 3, 4], 0), block(11, [5, 6, 7, 8], 0), block(12, [9, 10, 11, 12], 1)]}},
        {"event_id": 2, "window_size": 32, "data": {
            "type": "updated", "block_hash": 10, "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
            "priority": {"type": "event_diff", "new_value": 35, "old_value": 35}}},
        {"event_id": 3, "window_size": 32, "attention_dp_rank": 0,
         "data": {"type": "removed", "block_hashes": [11]}},
    ]
    _, _, evs, _ = decode_batch(msgspec.msgpack.encode([1.5, events]), 7)
    assert [type(e).__name__ for e in evs] == ["PrefixCacheStored", "PrefixCacheStored", "PrefixCacheRemoved"]
    gpu, cpu, removed = evs
    assert (gpu.block_hashes, gpu.parent_hash, gpu.token_ids, gpu.medium) == ([10, 11], None, list(range(1, 9)), "GPU")
    assert (cpu.block_hashes, cpu.parent_hash, cpu.medium, cpu.block_size_tokens) == ([12], 11, "CPU", 4)
    assert removed.block_hashes == [11] and removed.medium == "GPU"
    h = StreamHealth()
    for ev in evs:
        h.event(ev)
    assert (h.counts.device_held_blocks, h.counts.removed_before_stored) == (1, 0)


def test_attach_recognises_an_engine_by_its_metric_names(tmp_path):
    """A process whose command line names no engine, serving SGLang's metric names: attach
    records it as SGLang and maps those metrics."""
    import subprocess
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from kvdiag.events.eventlog import iter_events
    from kvdiag.events.schema import CollectorStatus, EngineMetrics

    body = (b"sglang:num_running_reqs{model_name=\"m\"} 2\nsglang:page_size{model_name=\"m\"} 16\n"
            b"sglang:max_total_num_tokens{model_name=\"m\"} 1024\n")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    target = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    out = tmp_path / "a.kvlog"
    try:
        r = subprocess.run([sys.executable, "-m", "kvdiag", "attach", str(target.pid), "--duration", "1.5",
                            "--interval", "0.5", "--no-pyspy", "--json", "--out", str(out),
                            "--metrics-url", f"http://127.0.0.1:{httpd.server_port}/metrics"],
                           capture_output=True, text=True, timeout=120)
    finally:
        httpd.shutdown()
        target.stdin.close()
        target.wait(10)
    assert r.returncode == 0, r.stderr
    events = list(iter_events(out))
    sg = [e for e in events if isinstance(e, CollectorStatus) and e.collector == "sglang"]
    assert len(sg) == 1 and "metric names" in sg[0].hint
    m = [e for e in events if isinstance(e, EngineMetrics)][-1]
    assert (m.num_requests_running, m.block_size_tokens, m.num_blocks) == (2, 16, 64)
