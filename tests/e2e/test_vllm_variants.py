"""Two more real vLLM servers: one with its prefix cache off (the consistency check must show the
gap the content allows) and a hook made to fail (vLLM must keep serving), and one without the
plugin (vLLM's answers and counters must not change because kvdiag was there)."""

from __future__ import annotations

import time

import pytest

from kvdiag.diagnosis import rules, sharing_rules
from kvdiag.simulation.live_sharing import ShadowSharingSink
from kvdiag.diagnosis.frames import load as load_logs
from kvdiag.collectors.agent_client import AgentStream
from kvdiag.events.log_writer import LogWriter
from kvdiag.events.schema import CollectorError, KVPoolInfo, RequestFinished
from kvdiag.events.sinks import ListSink
from vllm_harness import QUESTIONS, chat, counter, metrics_text, running_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _wait_finished(events: ListSink, n: int, timeout_s: float = 60.0) -> list[RequestFinished]:
    deadline = time.monotonic() + timeout_s
    while True:
        done = [e for e in events.events if isinstance(e, RequestFinished)]
        if len(done) >= n:
            return done
        assert time.monotonic() < deadline, f"only {len(done)} of {n} requests finished"
        time.sleep(0.05)


def test_prefix_cache_off_shows_the_gap_and_a_failing_hook_is_contained(vllm_python, model_dir, tmp_path):
    with running_vllm(vllm_python, model_dir, tmp_path, prefix_caching=False, eager=True,
                      extra_env={"KVDIAG_FAIL_HOOK": "get_new_blocks"}) as server:
        events = ListSink()
        stream = AgentStream(server.socket_path, sink=events).start()
        before = metrics_text(server)
        # enough requests for the consistency rule to judge (rules.MIN_SHARING_REQUESTS)
        traffic = QUESTIONS * -(-rules.MIN_SHARING_REQUESTS // len(QUESTIONS))
        answers = [chat(server, q) for q in traffic]
        finished = _wait_finished(events, len(traffic))
        after = metrics_text(server)
        stream.close(drain_s=0.5)
    # vLLM served every request although kvdiag's allocation hook raised each time
    assert all(a["choices"][0]["message"]["content"] for a in answers)
    errors = [e for e in events.events if isinstance(e, CollectorError)]
    assert [e.collector for e in errors] == ["vllm-plugin:BlockPool.get_new_blocks"]
    assert "KVDIAG_FAIL_HOOK" in errors[0].message
    # the engine served nothing from a prefix cache ...
    assert counter(after, "vllm:prefix_cache_hits_total") == counter(before, "vllm:prefix_cache_hits_total")
    assert sum(e.cached_prompt_tokens for e in finished) == 0
    info = [e for e in events.events if isinstance(e, KVPoolInfo)]
    assert info and not info[-1].prefix_sharing
    # ... while the content shares the long system prompt: the shadow at vLLM's settings says so
    shadow = ShadowSharingSink([], engine_settings=True)
    for e in events.events:
        shadow.record(e)
    assert shadow.gap() > 0.5
    # and the doctor's rule, on the log of these events, warns
    log = tmp_path / "off.kvlog"
    writer = LogWriter(log, stream.header)
    for e in events.events:
        writer.record(e)
    shadow.out = writer
    shadow.flush()
    writer.close()
    finding = sharing_rules.sharing_consistency(load_logs([log])[0])
    assert finding.status == "warn" and finding.evidence["gap"] > rules.SHARING_GAP_LIMIT


def test_without_the_plugin_answers_and_counters_are_unchanged(plain_vllm, vllm_server):
    """The same greedy chats on the session's server without kvdiag and on its server with it:
    the same answers and, once both caches hold the shared prompt, the same counter deltas."""
    for q in QUESTIONS:  # warm both prefix caches with the shared prompt and every question
        chat(plain_vllm, q)
        chat(vllm_server, q)
    deltas = {}
    answers = {}
    for name, server in (("plain", plain_vllm), ("plugin", vllm_server)):
        before = metrics_text(server)
        answers[name] = [chat(server, q)["choices"][0]["message"]["content"] for q in QUESTIONS]
        after = metrics_text(server)
        deltas[name] = {c: counter(after, c) - counter(before, c)
                        for c in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                                  "vllm:prompt_tokens_total", "vllm:generation_tokens_total")}
    assert answers["plain"] == answers["plugin"]
    assert deltas["plain"] == deltas["plugin"]
    assert deltas["plain"]["vllm:prefix_cache_hits_total"] > 0
