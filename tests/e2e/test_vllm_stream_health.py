"""The KV-event stream health checks on a real vLLM server's stream: the subscriber joins late
(after traffic), one batch is lost and one delivered twice on the way; the live subscriber and
the doctor (over the log it wrote) find the same late join, gap and duplicate, and nothing
else (no removal before a store, the balance within vLLM's own pool size)."""

from __future__ import annotations

import threading
import time

import pytest

from kvdiag.diagnosis import doctor
from kvdiag.diagnosis.frames import load
from kvdiag.collectors import metrics, vllm
from kvdiag.collectors.vllm_kv_events import KVEventSubscriber
from kvdiag.events.eventlog import make_header
from kvdiag.events.log_writer import LogWriter
from vllm_harness import chat, metrics_text

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class Mangling(KVEventSubscriber):
    """Ignores every message until ``open`` is set (a late join), then loses the second
    message it would process and processes the third twice. ``received`` counts messages
    arriving, processed or not."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.open = False
        self.received = 0
        self.processed = 0
        self.cond = threading.Condition()

    def _on_message(self, frames) -> None:
        with self.cond:
            self.received += 1
            self.cond.notify_all()
        if not self.open:
            return
        self.processed += 1
        if self.processed == 2:
            return
        super()._on_message(frames)
        if self.processed == 3:
            super()._on_message(frames)

    def wait_received(self, above: int, timeout_s: float = 60.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.received > above, timeout_s), \
                "vLLM published nothing for the request"


def test_late_join_lost_and_duplicated_batch_on_a_real_vllm_stream(vllm_server, tmp_path):
    log = tmp_path / "stream.kvlog"
    writer = LogWriter(log, make_header(engine="attach"))
    mode, address = vllm.subscriber_side(vllm_server.events_endpoint)
    sub = Mangling(address, writer, topic="kv", bind=(mode == "bind"), publisher="vllm").start()
    try:
        assert metrics.scrape_into(f"{vllm_server.base_url}/metrics", writer)  # the pool's size
        # traffic before the join: until the publisher has reached the subscriber's socket
        deadline = time.monotonic() + 60
        i = 0
        while sub.received == 0:  # (vLLM connects to the subscriber's socket: it may miss some)
            assert time.monotonic() < deadline, "vLLM's KV events never reached the subscriber"
            chat(vllm_server, "Hello?", system=f"Before join {i}. " * 60, max_tokens=2)
            i += 1
        sub.open = True
        for k in range(5):  # distinct prompts (no shared prefix): each stores new blocks
            seen = sub.received
            chat(vllm_server, "Hello?", system=f"After join {k}. " * 60, max_tokens=2)
            sub.wait_received(seen)
    finally:
        sub.stop()
        writer.close()
    live = sub.health.counts
    assert live.late_join and live.first_seq > 0
    assert (live.gaps, live.lost_batches, live.duplicate_batches, live.restarts) == (1, 1, 1, 0)
    assert live.removed_before_stored == 0 and live.stored_blocks > 0
    assert (sub.gaps, sub.duplicate_batches) == (1, 1)

    findings = {f.rule: f for f in doctor.run_rules(load([str(log)])[0])[0]}
    health = findings["kv_events.health"]
    assert health.status == "warn" and health.evidence["duplicate_batches"] == 1
    assert f"joined at seq {live.first_seq}" in health.message
    assert findings["kv_events.gaps"].status == "warn"
    # one definition: the doctor's fold of the log equals the live fold (the duplicate's
    # events were never recorded, so the doctor counts it from the subscriber's report)
    for key in ("batches", "events", "first_seq", "gaps", "lost_batches", "stored_blocks",
                "duplicate_stores", "removed_blocks", "removed_before_stored", "clears",
                "max_device_held_blocks"):
        assert health.evidence[key] == getattr(live, key), key
    # the balance was checked against vLLM's own pool size (its cache_config_info label)
    assert health.evidence["pool_blocks"] == gpu_blocks(metrics_text(vllm_server))
    assert health.evidence["over_pool_batches"] == 0


def gpu_blocks(text: str) -> int:
    """num_gpu_blocks of vLLM's cache_config_info, read with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(int(s.labels["num_gpu_blocks"]) for fam in text_string_to_metric_families(text)
               for s in fam.samples if s.name == "vllm:cache_config_info")


def chat_full(server, system: str) -> dict:
    """A chat whose request asks vLLM to re-announce the blocks it reuses
    (``kv_cache_report_mode="full"``, through vLLM's ``vllm_xargs``)."""
    import json
    import urllib.request

    body = {"model": server.model, "temperature": 0, "max_tokens": 2,
            "vllm_xargs": {"kv_cache_report_mode": "full"},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hello?"}]}
    req = urllib.request.Request(f"{server.base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_full_report_mode_covers_every_reused_block(vllm_server, tmp_path):
    """Each prompt sent twice in ``full`` mode: the second's reused blocks come back as stores
    of held keys, as many as vLLM's own hit counter moved (coverage 1.0 in the doctor)."""
    log = tmp_path / "full.kvlog"
    writer = LogWriter(log, make_header(engine="attach"))
    mode, address = vllm.subscriber_side(vllm_server.events_endpoint)
    sub = Mangling(address, writer, topic="kv", bind=(mode == "bind"), publisher="vllm")
    sub.open = True
    sub.processed = 10  # mangle nothing
    sub.start()
    try:
        deadline = time.monotonic() + 60
        i = 0
        while sub.received == 0:  # until vLLM's publisher has reached the subscriber's socket
            assert time.monotonic() < deadline, "vLLM's KV events never reached the subscriber"
            chat(vllm_server, "Hello?", system=f"Handshake {i}. " * 60, max_tokens=2)
            i += 1
        assert metrics.scrape_into(f"{vllm_server.base_url}/metrics", writer)
        for k in range(3):
            system = f"Full mode prompt {k}. " * 60
            for _ in range(2):
                seen = sub.received
                chat_full(vllm_server, system)
                sub.wait_received(seen)
        assert metrics.scrape_into(f"{vllm_server.base_url}/metrics", writer)
    finally:
        sub.stop()
        writer.close()
    health = {f.rule: f for f in doctor.run_rules(load([str(log)])[0])[0]}["kv_events.health"]
    assert health.status == "pass", health.message
    assert health.evidence["engine_hit_blocks"] >= 3  # each repeat hit its prompt's full blocks
    assert health.evidence["duplicate_stores"] == health.evidence["engine_hit_blocks"]
    assert health.evidence["reuse_coverage"] == 1.0
