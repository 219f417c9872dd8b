"""Miss causes on a real vLLM server with a small pool: the causes of the plugin's log sum to
vLLM's own ``/metrics`` counter deltas (``prefix_cache_queries`` - ``prefix_cache_hits``,
read with prometheus_client's parser) exactly, and each cause vLLM can produce shows up:

- cold: the first chat with a system prompt;
- below_block: a chat whose prompt is shorter than one block, and every prompt's partial tail;
- hash_domain: the first chat again under a ``cache_salt`` (vLLM folds it into its block hashes);
- evicted: the first chat's system prompt (two full blocks before the question) after other
  long prompts went through a pool of 9 blocks of 128 tokens; and blocks vLLM evicted while two
  chats were in flight although the shadow still held them (the engine's own evictions as the
  evidence).

The engine core imports this checkout's kvdiag (``PYTHONPATH``): the plugin under test records
``RequestArrived.cache_domain``, whatever kvdiag vLLM's environment was last refreshed with.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from kvdiag.diagnosis.miss_replay import miss_causes_of_events
from kvdiag.diagnosis.miss_tally import CAUSES
from kvdiag.commands._demo_vllm import VllmServer
from kvdiag.events.eventlog import iter_events
from kvdiag.events.schema import KVPoolInfo, RequestArrived, RequestFinished
from engine_evictions import recomputed_after_eviction
from vllm_harness import QUESTIONS, SYSTEM, counter, metrics_text

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

POOL_BLOCKS = 9  # 9 x 128 tokens: a long system prompt takes 4, so three others evict it
REPO = Path(__file__).resolve().parents[2]


def _chat(server, system: str, question: str, salt: str | None = None, max_tokens: int = 4) -> dict:
    body = {"model": server.model, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(f"{server.base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _server(vllm_python, model_dir, tmp_path, pool_blocks: int) -> tuple[VllmServer, Path]:
    """A vLLM server with a pool of ``pool_blocks`` blocks of 128 tokens, its plugin log."""
    log = tmp_path / "plugin.kvlog"
    env = {"KVDIAG_LOG": str(log), "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    # the subject is vLLM's block pool and scheduler, which compiling the model leaves alone
    server = VllmServer(vllm_python, model_dir, tmp_path / "server.kvlog", extra_env=env,
                        block_size_tokens=128, num_blocks=pool_blocks, max_model_len_tokens=1024, eager=True)
    return server, log


def _evict_in_sequence(server, first: str, tag: str) -> None:
    """cold, hit, below_block, hash_domain, then three other long prompts push the first out."""
    _chat(server, first, QUESTIONS[0])  # cold, then a partial tail
    _chat(server, first, QUESTIONS[1])  # the system prompt's blocks hit
    _chat(server, "Be brief.", "Hi")  # shorter than one block
    _chat(server, first, QUESTIONS[0], salt=f"tenant-{tag}")  # same tokens, another domain
    for i in range(3):  # other long prompts push the first out of the pool
        _chat(server, f"[{tag} other {i}] {SYSTEM}", QUESTIONS[2])
    _chat(server, first, QUESTIONS[3])  # evicted


def _evict_under_in_flight_pressure(server, first: str, tag: str) -> None:
    """Twice: two long chats in flight take 8 of the 9 blocks (three full prompt blocks and a
    partial one each), so vLLM evicts cached blocks of ``first``'s system prompt that the
    shadow, holding content alone at 9 blocks, still holds; ``first``'s system prompt, sent
    while they run, misses them."""
    _chat(server, first, QUESTIONS[0])
    for wave in range(2):
        others = [threading.Thread(target=_chat, args=(server, f"[{tag} other {wave}{i}] {SYSTEM}",
                                                       QUESTIONS[2]), kwargs={"max_tokens": 200})
                  for i in range(2)]
        for t in others:
            t.start()
        deadline = time.monotonic() + 120
        while counter(metrics_text(server), "vllm:num_requests_running") < 2:  # both in flight
            assert time.monotonic() < deadline, "the two chats never ran at once"
            time.sleep(0.05)
        _chat(server, first, QUESTIONS[1 + wave])
        for t in others:
            t.join()


def test_miss_causes_sum_to_vllm_counters_on_a_small_pool(vllm_python, model_dir, tmp_path):
    """Both scenarios on one server (one vLLM start less), each with its own tagged prompts:
    first in sequence, then under in-flight pressure. The causes of the whole log sum to vLLM's
    counter deltas; the blocks vLLM recomputes after evicting them (counted from its own
    BlockStored and BlockEvicted, independently of the fold) are exactly the evicted tokens,
    some without a reuse distance (the shadow still held them: the engine's evidence)."""
    server, log = _server(vllm_python, model_dir, tmp_path, POOL_BLOCKS)
    tags = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    server.start()
    try:
        server.wait_ready()
        server.model = str(model_dir)
        before = metrics_text(server)
        _evict_in_sequence(server, f"[{tags[0]}] {SYSTEM}", tags[0])
        _evict_under_in_flight_pressure(server, f"[{tags[1]}] {SYSTEM}", tags[1])
        after = metrics_text(server)
    finally:
        server.stop()

    queries = counter(after, "vllm:prefix_cache_queries_total") - counter(before, "vllm:prefix_cache_queries_total")
    hits = counter(after, "vllm:prefix_cache_hits_total") - counter(before, "vllm:prefix_cache_hits_total")
    events = list(iter_events(log))
    pool = next(e for e in events if isinstance(e, KVPoolInfo))
    assert pool.num_blocks == POOL_BLOCKS
    finished = [e for e in events if isinstance(e, RequestFinished)]
    assert len(finished) == 8 + 7 and all(e.status == "finished" for e in finished)
    salted = [e for e in events if isinstance(e, RequestArrived) and e.cache_domain]
    assert len(salted) == 1

    result = miss_causes_of_events(events, engine="vllm")
    causes = result.total.by_cause()
    assert result.total.missed_tokens == queries - hits > 0
    assert sum(causes.values()) == queries - hits  # exactly vLLM's missed tokens
    assert causes["cold"] > 0 and causes["below_block"] > 0
    assert causes["hash_domain"] >= 2 * 128, causes  # the salted chat's system-prompt blocks
    recomputed = recomputed_after_eviction(events, cached_at_first_admission=True)
    assert causes["evicted"] == recomputed * pool.block_size_tokens, (recomputed, causes)
    assert causes["unknown"] == 0 and causes["engine_skip"] == 0, causes
    by_id = {r.request_id: dict(zip(CAUSES, r.tokens)) for r in result.requests}
    arrived = [e.request_id for e in events if isinstance(e, RequestArrived)]
    in_order = [by_id[i] for i in arrived[:8]]  # the scenario in sequence: one chat at a time
    assert sum(c["preemption"] + c["in_flight"] for c in in_order) == 0, in_order
    # the system prompt fills two blocks before the question starts: those two were evicted
    assert in_order[-1]["evicted"] >= 2 * 128, in_order[-1]
    short = min(finished, key=lambda e: e.prompt_tokens)
    assert short.prompt_tokens < pool.block_size_tokens
    assert by_id[short.request_id]["below_block"] == short.prompt_tokens - short.cached_prompt_tokens
    # under in-flight pressure, vLLM evicted blocks the shadow at its settings still held
    assert sum(n for r in result.requests for d, _, n in r.evicted if d is None) > 0
