"""`kvdiag top --pid` on a real vLLM server started WITHOUT kvdiag's plugin: top reads it from
outside with attach's collectors (its /metrics found on its ports, its KV events subscribed to
from its --kv-events-config), driven headless here as the TUI drives it.

Joined mid-stream: the server served chats before top joined. What top shows is checked
against vLLM's own /metrics read here with prometheus_client's parser: the prefix hit rate is
the counters' increase over the window (the server idle at both reads), the pool usage is the
``vllm:kv_cache_usage_perc`` gauge (bracketed by two reads of it while one long request
decodes, when the gauge can only grow), the TTFT is PromQL's interpolation of the histogram's
increase over the window.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdiag.diagnosis.engine_latency import histogram_quantile
from kvdiag.live.outside_sources import OutsideSource
from kvdiag.live.pid_source import attach
from kvdiag.live.state import LiveState
from kvdiag.events.schema import EngineMetrics, PrefixCacheStored
from kvdiag.demo.traffic import CHAT_ROUTE
from vllm_harness import QUESTIONS, SYSTEM, chat, counter, metrics_text

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WARM = 2  # chats before top joins
WINDOW = 4  # chats after, sharing one system prompt
LONG_TOKENS = 512  # the request that decodes while the gauge is read


def _buckets(text: str, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets summed over label sets, by prometheus_client's parser."""
    by_le: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                by_le[le] = by_le.get(le, 0.0) + s.value
    return sorted(by_le.items())


def _num_gpu_blocks(text: str) -> int:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                return int(s.labels["num_gpu_blocks"])
    raise AssertionError("no vllm:cache_config_info")


def _long_request(server) -> None:
    body = {"model": server.model, "temperature": 0, "max_tokens": LONG_TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count from one to one thousand in words."}]}
    req = urllib.request.Request(f"{server.base_url}/{CHAT_ROUTE}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


def _usage(server) -> float:
    return counter(metrics_text(server), "vllm:kv_cache_usage_perc")


def _growing_usage(server, timeout_s: float) -> float:
    """A read of the usage gauge once two reads show it growing from above zero: the long
    request decoding (seen here: as the request starts, the gauge can still show an earlier
    figure, or zero, before it grows with the request's blocks)."""
    deadline = time.monotonic() + timeout_s
    prev = _usage(server)
    while True:
        now = _usage(server)
        if 0 < prev < now:
            return now
        assert time.monotonic() < deadline, "the long request's blocks never grew in the gauge"
        prev = now
        time.sleep(0.1)


class Drive:
    """Polls the source into a LiveState, as top's worker does."""

    def __init__(self, source) -> None:
        self.source = source
        self.state = LiveState(source=source.description)
        self.state.set_header(source.header)
        self.events: list = []

    def until(self, cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.source.poll()
            self.state.feed_all(got)
            self.state.source = self.source.description
            self.events += got
            if cond():
                return
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def scrapes(self) -> list[EngineMetrics]:
        return [e for e in self.events if isinstance(e, EngineMetrics)]


def test_top_without_the_plugin_reads_metrics_and_kv_events_since_it_joined(plain_vllm):
    server = plain_vllm
    tag = uuid.uuid4().hex
    for i in range(WARM):  # traffic nobody watches: its counters must not count
        chat(server, QUESTIONS[i], system=f"[{tag} warm {i}] {SYSTEM}")

    source = attach(server.proc.pid)
    assert isinstance(source, OutsideSource)
    drive = Drive(source)
    try:
        drive.until(lambda: "/metrics + KV events" in source.description and drive.scrapes(), 60,
                    "the /metrics scrape and the KV-event subscription")
        before = metrics_text(server)  # idle since the first scrape: the same counters

        system = f"[{tag} window] {SYSTEM}"
        for i in range(WINDOW):
            chat(server, QUESTIONS[i % len(QUESTIONS)], system=system)

        # the pool: while one long request decodes the gauge only grows; a scrape that started
        # after read r1 and was taken before read r2 lies between them
        long = threading.Thread(target=_long_request, args=(server,))
        long.start()
        try:
            r1 = _growing_usage(server, 120)
            t1 = time.time_ns()
            drive.until(lambda: sum(e.ts_ns > t1 for e in drive.scrapes()) >= 2, 30, "two scrapes after r1")
            shown = drive.state.snapshot(time.time_ns()).pool
            r2 = counter(metrics_text(server), "vllm:kv_cache_usage_perc")
        finally:
            long.join(timeout=600)
        assert 0 < r1 <= shown.block_occupancy <= r2, (r1, shown.block_occupancy, r2)
        assert shown.block_occupancy == drive.scrapes()[-1].kv_cache_usage

        after = metrics_text(server)  # idle again
        t_after = time.time_ns()
        queries_after = counter(after, "vllm:prefix_cache_queries_total")
        # a scrape that started after that read (the second one taken after it)
        drive.until(lambda: sum(e.ts_ns > t_after for e in drive.scrapes()) >= 2, 30,
                    "two scrapes of the idle server")
        assert drive.scrapes()[-1].prefix_cache_queries_tokens == queries_after
        snap = drive.state.snapshot(time.time_ns())
    finally:
        source.close()

    # the UI names the source: the outside collectors, since the join
    assert snap.source.startswith(f"pid {server.proc.pid} outside: /metrics + KV events (since join ")
    assert source.header.engine == "vllm"
    # prefix hits: vLLM's counters' increase over the window, not their totals since it started
    queries = queries_after - counter(before, "vllm:prefix_cache_queries_total")
    hits = counter(after, "vllm:prefix_cache_hits_total") - counter(before, "vllm:prefix_cache_hits_total")
    assert queries > 0 and hits > 0
    assert snap.sharing.engine_hit_rate == hits / queries
    assert snap.sharing.engine_hit_rate != counter(after, "vllm:prefix_cache_hits_total") / queries_after
    # the pool: the idle gauge, over vLLM's own block count
    assert snap.pool.block_occupancy == counter(after, "vllm:kv_cache_usage_perc")
    assert snap.pool.num_blocks == _num_gpu_blocks(after)
    assert snap.pool.source and snap.pool.reason == ""
    # latency: the TTFT histogram's increase over the window (WINDOW chats and the long request)
    name = "vllm:time_to_first_token_seconds"
    inc = [(le, c1 - c0) for (le, c0), (_, c1) in zip(_buckets(before, name), _buckets(after, name))]
    assert max(c for _, c in inc) == WINDOW + 1
    assert snap.latency.ttft_p50_ms == pytest.approx(histogram_quantile(0.5, inc) * 1e3)
    assert snap.latency.ttft_p99_ms == pytest.approx(histogram_quantile(0.99, inc) * 1e3)
    # the KV events: the window's blocks stored, received from the engine's ZMQ stream
    assert any(isinstance(e, PrefixCacheStored) for e in drive.events)
