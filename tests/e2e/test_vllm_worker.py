"""kvdiag's shadow inside a real vLLM server's worker, checked against vLLM's own KV read by a
test-only path (``tests/vllm_site/sitecustomize.py``: the key and value rows vLLM writes into
its cache, by slot, assembled through the request's block table), and a missing worker hook."""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path

import pytest
import torch

from kvdiag.collectors.agent_client import AgentStream
from kvdiag.shadow.runner import ShadowRunner
from kvdiag.events.schema import (CollectorStatus, KVPoolInfo, ProcessSample, RequestFinished, ShadowCompression,
                           ShadowLocality)
from kvdiag.events.sinks import ListSink
from vllm_harness import QUESTIONS, SYSTEM, chat, collected_tests_use, running_vllms
from waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SITE = Path(__file__).parent.parent / "vllm_site"
METHODS = "fp8_e4m3:s=1,int4"
DUMP_STEPS = 3
SKIPPED = "vllm-plugin:GPUModelRunner.execute_model"  # the worker's step hook, as its status names it
# every decode step sampled, every layer, no CPU budget: each measured step has its twin offline
SHADOW_ENV = {"KVDIAG_SHADOW_RATE": "1", "KVDIAG_SHADOW_BUDGET": "0", "KVDIAG_SHADOW_LAYERS": "0",
              "KVDIAG_SHADOW_METHODS": METHODS}


def _site_env(**extra: str) -> dict:
    path = os.pathsep.join([str(SITE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return {**SHADOW_ENV, "PYTHONPATH": path, **extra}


def _serve(server, events: ListSink, shadow: bool = True) -> tuple[list, list[str]]:
    """One request with a prompt no cache holds (its decode steps are dumped), then the chats;
    returns (the events up to the first request's end, the chats' answers). ``shadow``: first
    wait until the worker says its shadow is ready (linked to the engine core, kernels warm)."""
    stream = AgentStream(server.socket_path, sink=events).start()
    if shadow:
        wait_for(lambda: any(isinstance(e, CollectorStatus) and e.collector == "vllm-worker:shadow"
                             and e.available for e in events.events), 120, "the worker's shadow to be ready",
                 poll_s=0.05)
    finished = lambda: [e for e in events.events if isinstance(e, RequestFinished)]  # noqa: E731
    chat(server, "Hi", system=f"[worker test {uuid.uuid4().hex}] {SYSTEM[:600]}", max_tokens=DUMP_STEPS + 1)
    wait_for(lambda: len(finished()) >= 1, 60, "the first request's RequestFinished", poll_s=0.05)
    if shadow:
        # the worker samples its memory every few seconds; a client that joined after the
        # sample it took when it linked sees the next one (the statuses are replayed, samples not)
        ready = next(e for e in events.events if isinstance(e, CollectorStatus)
                     and e.collector == "vllm-worker:shadow" and e.available)
        worker_pid = int(ready.hint.split(":")[0].split()[-1])
        wait_for(lambda: any(isinstance(e, ProcessSample) and e.pid == worker_pid for e in events.events), 60,
                 "a memory sample of the worker process", poll_s=0.05)
    first = list(events.events)
    answers = [chat(server, q)["choices"][0]["message"]["content"] for q in QUESTIONS]
    wait_for(lambda: len(finished()) >= 1 + len(QUESTIONS), 60, "the RequestFinished of every chat", poll_s=0.05)
    stream.close(drain_s=0.5)
    return first, answers


@pytest.fixture(scope="module")
def worker_vllms(request, vllm_python, model_dir, tmp_path_factory):
    """This module's servers, started at once: ``shadowed``, whose worker shadow measures every
    decode step with vLLM's KV dumped beside; ``hidden_hook``, whose worker hook is hidden from
    kvdiag (where a collected test needs it)."""
    folder = tmp_path_factory.mktemp("vllm-worker")
    dump = folder / "dump"
    dump.mkdir()
    configs = {"shadowed": (folder, {"extra_env": _site_env(KVDIAG_TEST_KV_DUMP=str(dump),
                                                            KVDIAG_TEST_KV_DUMP_STEPS=str(DUMP_STEPS))})}
    if collected_tests_use(request, "hidden_hook"):
        configs["hidden_hook"] = (tmp_path_factory.mktemp("vllm-hidden-hook"),
                                  {"extra_env": _site_env(KVDIAG_TEST_HIDE_HOOK="1")})
    with running_vllms(vllm_python, model_dir, configs) as servers:
        yield servers, dump


@pytest.fixture(scope="module")
def shadowed(worker_vllms):
    """The shadowed server's events and answers, and vLLM's KV of its first decode steps; the
    server is stopped once it has served them."""
    servers, dump = worker_vllms
    events = ListSink()
    first, answers = _serve(servers["shadowed"], events)
    servers["shadowed"].stop()
    steps = {int(p.stem.split("-")[1]): torch.load(p) for p in sorted(dump.glob("step-*.pt"))}
    return first, answers, steps, events


@pytest.fixture(scope="module")
def hidden_hook(worker_vllms):
    return worker_vllms[0]["hidden_hook"]


def _probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Eager attention of one decode query ``q`` [QH, D] over ``k`` [KH, T, D]: [QH, T], fp64."""
    group = q.shape[0] // k.shape[0]
    scores = torch.einsum("hd,htd->ht", q.double(), k.double().repeat_interleave(group, dim=0)) * scale
    return torch.softmax(scores, dim=-1)


def test_worker_shadow_equals_offline_kernels_on_vllms_own_kv(shadowed):
    first, _answers, steps, _events = shadowed
    assert len(steps) == DUMP_STEPS, "the dump path saw no decode step"
    compression = [e for e in first if isinstance(e, ShadowCompression)]
    locality = [e for e in first if isinstance(e, ShadowLocality)]
    info = [e for e in first if isinstance(e, KVPoolInfo)][-1]
    for seq_len, step in steps.items():
        layers = sorted(step["layers"])
        assert layers == list(range(info.num_layers))
        measured = {(e.layer, e.head, e.method): e for e in compression if e.seq_len_tokens == seq_len}
        assert len(measured) == info.num_layers * info.num_kv_heads * 2, f"step {seq_len} not measured"
        # the same kernels, offline, on the K/V and query the dump path took
        offline = ListSink()
        ShadowRunner(offline, methods=METHODS, sample_rate=1.0, budget_frac=None, scaling=step["scale"]).run(
            0, [(step["layers"][i][1].unsqueeze(0), step["layers"][i][2].unsqueeze(0)) for i in layers],
            [step["layers"][i][0].unsqueeze(0).unsqueeze(2) for i in layers])
        for e in offline.events:
            if isinstance(e, ShadowCompression):
                got = measured[(e.layer, e.head, e.method)]
                for field in ("ratio", "k_rel_error", "v_rel_error", "attn_score_error", "attn_out_rel_error"):
                    assert getattr(got, field) == pytest.approx(getattr(e, field), rel=1e-9, abs=1e-12), field
        # locality per head from eager attention computed here
        heads = {(e.layer, e.head): e for e in locality if e.seq_len_tokens == seq_len}
        recent = math.ceil(0.2 * seq_len)
        sinks = min(4, seq_len - recent)
        for layer in layers:
            q, k, _v = step["layers"][layer]
            p = _probs(q, k, step["scale"])
            for h in range(q.shape[0]):
                ev = heads[(layer, h)]
                assert ev.recent_mass == pytest.approx(float(p[h, seq_len - recent:].sum()), abs=1e-5)
                assert ev.sink_mass == pytest.approx(float(p[h, :sinks].sum()), abs=1e-5)
                entropy = float(-(p[h] * p[h].clamp_min(1e-300).log()).sum())
                assert ev.entropy_nats == pytest.approx(entropy, rel=1e-4, abs=1e-5)
    # memory in the worker: its own process (VLLM::Worker, beside the engine core's) is sampled,
    # and the pool's bytes are the KV tensors' (every layer's cache, the null block included)
    pid = next(iter(steps.values()))["pid"]
    assert pid in {e.pid for e in first if isinstance(e, ProcessSample)}
    kv_bytes = sum(next(iter(steps.values()))["kv_bytes"].values())
    assert info.block_bytes * (info.num_blocks + 1) == kv_bytes


def test_top_and_report_fill_their_compression_and_locality_from_the_worker(shadowed, tmp_path):
    """The live view (top) and the report read the worker's events as they read the embedded
    engine's; the report names vLLM's setting for the recommendation."""
    from kvdiag.diagnosis.frames import load as load_logs
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.live.state import LiveState
    from kvdiag.reports.section_shadow import compression as compression_section
    from kvdiag.events.schema import LogHeader

    _first, _answers, _steps, events = shadowed
    recorded = [e for e in events.events if not isinstance(e, LogHeader)]
    state = LiveState()
    state.feed_all(recorded)
    snap = state.snapshot(max(e.ts_ns for e in recorded))
    assert {r.method for r in snap.compression.rows} == set(METHODS.split(","))
    assert snap.locality.samples > 0 and snap.locality.num_layers == 30
    assert all(v is not None for row in snap.locality.cells["recent"] for v in row)
    log = tmp_path / "worker.kvlog"
    writer = LogWriter(log, make_header(engine="vllm", model="m"))
    for e in recorded:
        writer.record(e)
    writer.close()
    section = compression_section(load_logs([log])[0])
    titles = [getattr(b, "title", "") for b in section.blocks]
    assert any(t.startswith("In vLLM's terms") for t in titles), titles


def test_missing_worker_hook_leaves_answers_intact(shadowed, hidden_hook):
    _first, answers, _steps, _events = shadowed
    events = ListSink()
    _, hidden = _serve(hidden_hook, events, shadow=False)
    assert hidden == answers  # greedy: the same answers with and without the worker's shadow
    skipped = [e for e in events.events if isinstance(e, CollectorStatus) and e.collector == SKIPPED]
    assert not skipped[0].available
    assert skipped and "scheduler_output" in skipped[0].hint
    assert not any(isinstance(e, ShadowCompression) for e in events.events)
    assert any(isinstance(e, RequestFinished) for e in events.events)  # the scheduler's hooks record on
