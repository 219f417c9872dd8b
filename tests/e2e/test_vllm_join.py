"""`kvdiag attach` joining a real vLLM server that already served traffic.

Before the client joins, the server serves chats that share nothing (each its own system
prompt); after, chats that share one long system prompt. The shadow's results cover the
server's whole life, so comparing them with the engine's rate over what the client saw would
show a large false gap. The client must compare the same requests: those finished since it
joined, whose engine hit rate is exactly vLLM's own ``/metrics`` counter deltas over the
window (read here with prometheus_client's parser, the server idle at both reads).

Also on the same stream: a request's prefix-hit tokens (the plugin's ``PrefixHit`` events) add
up to the cached prompt tokens vLLM counted for it, and the pool keeps being sampled once the
traffic stops (the engine core takes no step while idle).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections import defaultdict

import pytest

from kvdiag.diagnosis import rules
from kvdiag.events.eventlog import iter_events
from kvdiag.live.state import LiveState
from kvdiag.events.schema import KVPoolSample, PrefixHit, RequestFinished, ShadowSharing
from vllm_harness import QUESTIONS, SYSTEM, chat, counter, metrics_text
from waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WARM = 4  # chats before the client joins
WINDOW = rules.MIN_SHARING_REQUESTS + 2  # chats after (enough for a verdict)
IDLE_SAMPLES = 3  # pool samples wanted after the last request finished


def _events(path) -> list:
    return list(iter_events(path)) if path.exists() else []


def test_attach_on_a_warm_server_compares_the_requests_since_it_joined(vllm_server, tmp_path):
    tag = uuid.uuid4().hex  # prompts no earlier test of this session sent
    for i in range(WARM):  # warm traffic nobody watches: long prompts that share nothing
        chat(vllm_server, QUESTIONS[i % len(QUESTIONS)], system=f"[{tag} warm {i}] " + " ".join([SYSTEM] * 3))

    out = tmp_path / "attach.kvlog"
    attach = subprocess.Popen([sys.executable, "-m", "kvdiag", "attach", str(vllm_server.proc.pid),
                               "--duration", "300", "--interval", "0.5", "--no-pyspy", "--json",
                               "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # joined: the agent's latest shadow results (sent first to a late client) are recorded
        wait_for(lambda: attach.poll() is not None or any(isinstance(e, ShadowSharing) for e in _events(out)),
                 60, "attach to join the plugin's stream", poll_s=0.1)
        assert attach.poll() is None, attach.stderr.read()
        before = metrics_text(vllm_server)  # idle: the warm chats are done
        system = f"[{tag} window] {SYSTEM}"
        for i in range(WINDOW):
            chat(vllm_server, QUESTIONS[i % len(QUESTIONS)], system=system)
        after = metrics_text(vllm_server)

        def idle_samples() -> int:
            ev = _events(out)
            done = [e.ts_ns for e in ev if isinstance(e, RequestFinished)]
            if len(done) < WINDOW:  # the last finish is not recorded yet: samples before it are not idle
                return 0
            return sum(1 for e in ev if isinstance(e, KVPoolSample) and e.ts_ns > max(done))
        # the engine takes no step now: samples keep coming only from the plugin's idle sampler
        wait_for(lambda: idle_samples() >= IDLE_SAMPLES, 30, "pool samples while the engine is idle", poll_s=0.1)
    finally:
        attach.send_signal(signal.SIGTERM)
        stdout, stderr = attach.communicate(timeout=60)
    assert attach.returncode == 0, stderr
    summary = json.loads(stdout)
    events = list(iter_events(out))

    # vLLM's own counters over the window (an independent read of /metrics)
    queries = counter(after, "vllm:prefix_cache_queries_total") - counter(before, "vllm:prefix_cache_queries_total")
    hits = counter(after, "vllm:prefix_cache_hits_total") - counter(before, "vllm:prefix_cache_hits_total")
    assert queries > 0 and hits > 0.5 * queries  # the shared system prompt is served from the cache

    sharing = summary["sharing"]
    assert sharing["requests"] == WINDOW
    assert sharing["prompt_tokens"] == queries
    assert sharing["engine_cached_tokens"] == hits
    assert sharing["engine_hit_rate"] == hits / queries
    # the gap rule compares the same requests and does not fire
    finding = next(f for f in summary["findings"] if f["rule"] == "sharing.consistency")
    assert finding["status"] == "pass", finding["message"]
    assert abs(sharing["gap"]) <= rules.SHARING_GAP_LIMIT
    # ... where the shadow over the server's whole life would have: the false gap this fixes
    latest = [e for e in events if isinstance(e, ShadowSharing)
              and (e.policy, e.block_size_tokens) == (finding["evidence"]["policy"],
                                                      finding["evidence"]["block_size_tokens"])
              and e.capacity_blocks == finding["evidence"]["capacity_blocks"]][-1]
    assert abs(latest.token_hit_rate - hits / queries) > rules.SHARING_GAP_LIMIT

    # per request, the plugin's prefix hits add up to the cached tokens vLLM counted for it
    finished = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    hit_tokens: dict = defaultdict(int)
    for e in events:
        if isinstance(e, PrefixHit):
            hit_tokens[e.request_id] += e.num_tokens
    assert len(finished) == WINDOW
    assert {r: hit_tokens.get(r, 0) for r in finished} == {r: e.cached_prompt_tokens for r, e in finished.items()}
    assert sum(e.cached_prompt_tokens for e in finished.values()) == hits
    # ... and top's requests view shows them
    state = LiveState()
    state.feed_all(events)
    rows = {r.request_id: r for r in state.snapshot(events[-1].ts_ns).requests.rows}
    assert {r: rows[r].hit_tokens for r in finished if r in rows} == {
        r: e.cached_prompt_tokens for r, e in finished.items() if r in rows}

    # idle: pool samples at the sample interval, all blocks given back, as vLLM's gauge says
    last_done = max(e.ts_ns for e in finished.values())
    idle = [e for e in events if isinstance(e, KVPoolSample) and e.ts_ns > last_done]
    assert len(idle) >= IDLE_SAMPLES
    assert all(e.running_requests == 0 and e.blocks_used == 0 for e in idle)
    assert counter(metrics_text(vllm_server), "vllm:kv_cache_usage_perc") == 0
