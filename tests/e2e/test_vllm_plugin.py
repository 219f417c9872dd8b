"""kvdiag's plugin inside a real vLLM server: its block and request events agree with vLLM's own
counters and with a brute-force prefix cache, and the ledger balances."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest

from kvdiag.simulation.live_sharing import ShadowConfig, ShadowSharingSink
from kvdiag.pool.blockledger import BlockLedger
from kvdiag.collectors.agent_client import AgentStream
from kvdiag.events.schema import (BlockAllocated, BlockReleased, BlockStored, KVPoolInfo, KVPoolSample,
                           RequestArrived, RequestFinished)
from kvdiag.events.sinks import ListSink
from vllm_harness import QUESTIONS, SYSTEM, chat, counter, metrics_text
from waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _prefix_keys(arrived: RequestArrived, block: int) -> list:
    """Key ``k - 1`` names the prompt's first ``k`` full blocks: the tokens themselves (a
    token-id recording) or the salted hash of the block's last 16-token chunk, which chains over
    every token before it (a default recording)."""
    if arrived.token_ids is not None:
        tokens = list(arrived.token_ids)
        return [tuple(tokens[:k * block]) for k in range(1, len(tokens) // block + 1)]
    per = block // 16
    return [arrived.chunk_hashes[k * per - 1] for k in range(1, len(arrived.chunk_hashes) // per + 1)]


def _stored_key(ev: BlockStored, before: list):
    """The key of the sequence up to the end of stored block ``ev`` (``before``: the keys of
    the blocks before it)."""
    if ev.token_ids is not None:
        return tuple((before[-1] if before else ()) + tuple(ev.token_ids))
    return ev.chunk_hashes[-1]


def _brute_force_hits(arrived: list[RequestArrived], stored: dict[str, list[BlockStored]],
                      block: int) -> dict[str, int]:
    """Prefix hits of sequential requests in an unbounded cache with vLLM's rule: the leading
    full blocks of the prompt already cached, at most (prompt - 1) // block of them. Then the
    request's full blocks are cached: its hit blocks followed by the blocks it stored (prompt
    and generated tokens, in order, as its ``BlockStored`` events carry them)."""
    cache: set = set()
    hits = {}
    for ev in arrived:
        keys = _prefix_keys(ev, block)
        n = 0
        while n < (ev.prompt_tokens - 1) // block and keys[n] in cache:
            n += 1
        hits[ev.request_id] = n * block
        sequence = keys[:n]
        for blk in stored.get(ev.request_id, []):
            sequence.append(_stored_key(blk, sequence))
        cache.update(sequence)
    return hits


def test_plugin_events_match_vllm_counters_and_brute_force(vllm_server):
    events = ListSink()
    stream = AgentStream(vllm_server.socket_path, sink=events).start()
    assert stream.header.engine == "vllm"
    before = metrics_text(vllm_server)
    # a system prompt no earlier test sent (this server is shared by the session): a cold start
    system = f"[plugin test {uuid.uuid4().hex}] {SYSTEM}"
    answers = [chat(vllm_server, q, system=system) for q in QUESTIONS]
    assert all(a["choices"][0]["message"]["content"] for a in answers)
    finished = lambda: [e for e in events.events if isinstance(e, RequestFinished)]  # noqa: E731
    wait_for(lambda: len(finished()) >= len(QUESTIONS), 60, "the plugin's RequestFinished of every chat", poll_s=0.05)
    after = metrics_text(vllm_server)
    stream.close(drain_s=0.5)

    info = [e for e in events.events if isinstance(e, KVPoolInfo)]
    assert info and info[-1].block_size_tokens == 128 and info[-1].prefix_sharing  # told to a late client
    block = info[-1].block_size_tokens
    fin = finished()
    queries = counter(after, "vllm:prefix_cache_queries_total") - counter(before, "vllm:prefix_cache_queries_total")
    hits = counter(after, "vllm:prefix_cache_hits_total") - counter(before, "vllm:prefix_cache_hits_total")
    # the plugin's per-request numbers are vLLM's own counters, request by request
    assert sum(e.prompt_tokens for e in fin) == queries
    assert sum(e.cached_prompt_tokens for e in fin) == hits
    assert hits > 0.5 * queries  # the long shared system prompt is served from the cache

    arrived = [e for e in events.events if isinstance(e, RequestArrived)]
    assert [e.request_id for e in arrived] == [e.request_id for e in fin]  # sequential traffic
    # recorded by default: salted chunk hashes, no token id in any event
    assert stream.header.content == "hashes" and stream.header.content_salt
    for e in events.events:
        assert not msgspec.to_builtins(e).get("token_ids"), e
    assert all(e.chunk_hashes and e.partial_tokens == e.prompt_tokens % 16 for e in arrived)
    stored: dict[str, list[BlockStored]] = {}
    for e in events.events:
        if isinstance(e, BlockStored):
            stored.setdefault(e.request_id, []).append(e)
    expected = _brute_force_hits(arrived, stored, block)
    assert {e.request_id: e.cached_prompt_tokens for e in fin} == expected

    # kvdiag's shadow cache at vLLM's settings, fed the same events, predicts the same hits
    # (no prompt here is a whole number of blocks: there the shadow would count one block more)
    assert all(e.prompt_tokens % block for e in arrived)
    shadow = ShadowSharingSink([], engine_settings=True)
    for e in events.events:
        shadow.record(e)
    assert shadow.engine_config == ShadowConfig("lru", block, info[-1].num_blocks)
    assert shadow.gap() == pytest.approx(0.0, abs=1e-12)

    # the ledger balances: every block a finished request held was released
    ledger = BlockLedger()
    for e in events.events:
        ledger.apply(e)
    assert ledger.held_by_finished(time.time_ns(), grace_ns=0) == {}
    assert not ledger.anomalies
    allocated = sum(isinstance(e, BlockAllocated) for e in events.events)
    released = sum(isinstance(e, BlockReleased) for e in events.events)
    assert allocated > 0 and released >= allocated
    samples = [e for e in events.events if isinstance(e, KVPoolSample)]
    assert samples and all(s.blocks_used + s.blocks_cached + s.blocks_free == s.num_blocks for s in samples)


def _families(url: str) -> dict[str, list]:
    """Samples by name, read with prometheus_client's own parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_engine_core_serves_kvdiag_metrics_that_agree_with_vllms_own(vllm_server):
    """KVDIAG_PROMETHEUS: the plugin's agent serves kvdiag's metrics from vLLM's engine core
    (on 127.0.0.1); the pool size and the finished requests agree with vLLM's /metrics."""
    chat(vllm_server, QUESTIONS[0])
    vllm = metrics_text(vllm_server)
    from prometheus_client.parser import text_string_to_metric_families
    info = next(s for f in text_string_to_metric_families(vllm) for s in f.samples
                if s.name == "vllm:cache_config_info")
    succeeded = counter(vllm, "vllm:request_success_total")

    def finished() -> float:
        samples = _families(vllm_server.kvdiag_metrics_url).get("kvdiag_requests_finished_total", [])
        return sum(s.value for s in samples)

    wait_for(lambda: finished() >= succeeded, 60,
             "kvdiag_requests_finished_total to reach vLLM's request_success_total", poll_s=0.05)
    ours = _families(vllm_server.kvdiag_metrics_url)
    assert finished() == succeeded == counter(metrics_text(vllm_server), "vllm:request_success_total")
    blocks = {s.labels["state"]: s.value for s in ours["kvdiag_kv_blocks"]}
    # the usable blocks: vLLM's pool minus its null block (block 0, never handed out)
    assert sum(blocks.values()) == int(info.labels["num_gpu_blocks"]) - 1
    assert {s.labels["engine"] for s in ours["kvdiag_kv_blocks"]} == {"vllm"}
