"""The vLLM worker's pure parts, without vLLM: paged KV layouts, layer names, the environment's
shadow settings, vLLM's fp8 cast as a method, and the recommendation in vLLM's terms."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from kvdiag.diagnosis.compression import engine_recommendation, vllm_setting
from kvdiag.collectors.vllm_kv_layout import gather_kv, layer_index
from kvdiag.collectors.vllm_worker import shadow_options
from kvdiag.kernels.methods import parse_method


def _paged(k: torch.Tensor, v: torch.Tensor, table: list[int], num_blocks: int, block: int, layout: str):
    """A cache [num_blocks, H, block, 2D] holding k, v [H, T, D] in the blocks of ``table``,
    written token by token the way each layout stores them (the rest random)."""
    heads, tokens, dim = k.shape
    cache = torch.randn(num_blocks, heads, block, 2 * dim)
    for t in range(tokens):
        b, n = table[t // block], t % block
        for h in range(heads):
            if layout == "cpu-vec":  # keys [D, block] then values [block, D], per block and head
                flat = cache[b, h].view(-1)
                flat[n: block * dim: block] = k[h, t]
                flat[block * dim + n * dim: block * dim + (n + 1) * dim] = v[h, t]
            else:
                cache[b, h, n, :dim], cache[b, h, n, dim:] = k[h, t], v[h, t]
    return cache


@pytest.mark.parametrize("layout", ["cpu-vec", "flash"])
def test_gather_reads_a_requests_kv_through_its_block_table(layout):
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 70, 8, generator=gen), torch.randn(3, 70, 8, generator=gen)
    table = [5, 2, 7, 0]  # 70 tokens in blocks of 32: three blocks used, out of order
    cache = _paged(k, v, table, num_blocks=9, block=32, layout=layout)
    got_k, got_v = gather_kv(cache, table, 70, layout)
    assert got_k.shape == (1, 3, 70, 8)
    assert torch.equal(got_k[0], k) and torch.equal(got_v[0], v)
    got_k[0, 0, 0, 0] += 1  # a copy: the cache is never written
    assert torch.equal(gather_kv(cache, table, 70, layout)[0][0], k)
    with pytest.raises(ValueError):
        gather_kv(cache, table, 70, "nhd")


def test_layer_index_of_vllm_layer_names():
    assert layer_index("model.layers.17.self_attn.attn") == 17
    assert layer_index("language_model.model.layers.3.attn") == 3
    assert layer_index("decoder.h.5.attn") == 5
    assert layer_index("attn") is None


def test_shadow_options_from_the_environment(monkeypatch):
    for name in ("KVDIAG_SHADOW_RATE", "KVDIAG_SHADOW_BUDGET", "KVDIAG_SHADOW_LAYERS", "KVDIAG_SHADOW_METHODS"):
        monkeypatch.delenv(name, raising=False)
    default = shadow_options()
    assert default["sample_rate"] == 0.005 and default["budget_frac"] == 0.01 and default["layers_per_run"] == 3
    assert default["methods"].split(",")[:2] == ["fp8_e4m3:s=1", "fp8_e5m2:s=1"]
    monkeypatch.setenv("KVDIAG_SHADOW_RATE", "1")
    monkeypatch.setenv("KVDIAG_SHADOW_BUDGET", "0")
    monkeypatch.setenv("KVDIAG_SHADOW_LAYERS", "0")
    monkeypatch.setenv("KVDIAG_SHADOW_METHODS", "int4")
    assert shadow_options() == dict(methods="int4", sample_rate=1.0, budget_frac=None, layers_per_run=None)
    monkeypatch.setenv("KVDIAG_SHADOW_RATE", "often")
    with pytest.raises(ValueError, match="KVDIAG_SHADOW_RATE"):
        shadow_options()


def test_demo_shadow_flags_reach_the_workers_shadow_on_vllm(monkeypatch):
    """`kvdiag demo --engine vllm --shadow ...`: the flags become the worker's environment, which
    its shadow reads back as the same options the embedded engine's runner takes."""
    import argparse

    from kvdiag.commands import _demo_shadow

    parser = argparse.ArgumentParser()
    _demo_shadow.add_arguments(parser)
    assert _demo_shadow.vllm_env(parser.parse_args([])) == {}  # without --shadow: the worker's defaults
    args = parser.parse_args(["--shadow", "--shadow-rate", "0.25", "--shadow-budget", "0",
                              "--shadow-layers", "2", "--shadow-methods", "int8,fp8_e5m2:s=1"])
    for name, value in _demo_shadow.vllm_env(args).items():
        monkeypatch.setenv(name, value)
    assert shadow_options() == dict(methods="int8,fp8_e5m2:s=1", sample_rate=0.25, budget_frac=None,
                                    layers_per_run=2)


def test_fp8_cast_method_is_vllms_per_tensor_cast():
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 40, 16, generator=gen) * 3, torch.randn(1, 2, 40, 16, generator=gen)
    k[0, 0, 0, 0] = 1000.0  # beyond e4m3's largest value (448): saturated, as a cast with a clamp
    method = parse_method("fp8_e4m3:s=2")
    k_hat, v_hat, keep = method.compress(k, v).decode()
    expected = (k / 2).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 2
    assert keep is None and torch.equal(k_hat, expected)
    assert torch.equal(v_hat, (v / 2).to(torch.float8_e4m3fn).float() * 2)
    assert method.compress(k, v).ratio() == 4.0  # fp32 -> one byte, one scale per tensor
    with pytest.raises(ValueError, match="expected \\['s'\\]"):
        parse_method("fp8_e5m2:s=1:g=32")
    with pytest.raises(ValueError):
        parse_method("fp8_e5m2:s=0")


def test_vllm_setting_names_only_what_vllm_stores():
    assert vllm_setting("fp8_e4m3:s=1") == "--kv-cache-dtype fp8_e4m3"
    assert vllm_setting("fp8_e5m2:s=1") == "--kv-cache-dtype fp8_e5m2"
    for method in ("fp8_e4m3", "fp8_e4m3:s=2", "int4", "fp16", "h2o", None):
        assert vllm_setting(method) is None


def _table(rows):
    return pd.DataFrame(rows, columns=["group", "method", "ratio", "attn_out_rel_error"])


def test_engine_recommendation_one_setting_for_every_layer_and_the_capacity_it_frees():
    table = _table([("1-6", "fp8_e4m3:s=1", 4.0, 0.010), ("7-12", "fp8_e4m3:s=1", 4.0, 0.020),
                    ("1-6", "fp8_e5m2:s=1", 4.0, 0.020), ("7-12", "fp8_e5m2:s=1", 4.0, 0.050),
                    ("1-6", "int4", 6.0, 0.001), ("7-12", "int4", 6.0, 0.001)])
    rec = engine_recommendation(table, "vllm", num_blocks=100, block_bytes=1 << 20, block_size_tokens=128)
    row = rec.iloc[0]
    # e5m2 exceeds the budget in layers 7-12, so e4m3, judged by its worst group
    assert row["setting"] == "--kv-cache-dtype fp8_e4m3" and row["error"] == 0.020 and row["worst_group"] == "7-12"
    assert row["kv_bytes"] == 100 << 20
    assert row["frees_bytes"] == pytest.approx((100 << 20) * 0.75)
    assert row["extra_tokens"] == pytest.approx(100 * 128 * 3)
    assert engine_recommendation(table, "transformers-cb").empty
    over = engine_recommendation(_table([("1-6", "fp8_e4m3:s=1", 4.0, 0.2)]), "vllm")
    assert over.iloc[0]["setting"] is None and "keep the cache's dtype" in over.iloc[0]["reason"]
    none = engine_recommendation(_table([("1-6", "int4", 6.0, 0.001)]), "vllm")
    assert none.iloc[0]["setting"] is None and "fp8_e4m3:s=1" in none.iloc[0]["reason"]


def test_worker_events_reach_the_engine_cores_sink_through_the_inbox(tmp_path):
    from kvdiag.collectors.vllm_worker_link import WorkerInbox, WorkerLink
    from kvdiag.events.hooks import HookErrors
    from kvdiag.events.schema import ProcessSample
    from kvdiag.events.sinks import ListSink

    path = str(tmp_path / "inbox.sock")
    assert WorkerLink.connect(path) is None  # not listening yet: the worker tries again later
    received, errors = ListSink(), HookErrors(ListSink(), "test")
    inbox = WorkerInbox(path, received, errors)
    link = WorkerLink.connect(path)
    sent = [ProcessSample(ts_ns=i, pid=7, rss_bytes=1000 + i) for i in range(500)]
    for ev in sent:
        link.record(ev)
    link.close()
    inbox.close()
    assert received.events == sent and link.dropped == 0 and errors.total == 0
    assert not (tmp_path / "inbox.sock").exists()


def test_a_worker_not_yet_accepted_when_the_inbox_closes_still_delivers(tmp_path, monkeypatch):
    """A worker that connected and sent while the inbox's accepting thread had not run yet (a
    loaded machine): close() accepts it and records what it sent."""
    from kvdiag.collectors.vllm_worker_link import WorkerInbox, WorkerLink
    from kvdiag.events.hooks import HookErrors
    from kvdiag.events.schema import ProcessSample
    from kvdiag.events.sinks import ListSink

    monkeypatch.setattr(WorkerInbox, "_accept", lambda self: None)  # the accepting thread never runs
    path = str(tmp_path / "inbox.sock")
    received = ListSink()
    inbox = WorkerInbox(path, received, HookErrors(ListSink(), "test"))
    link = WorkerLink.connect(path)
    sent = [ProcessSample(ts_ns=i, pid=7, rss_bytes=i) for i in range(50)]
    for ev in sent:
        link.record(ev)
    link.close()
    inbox.close()
    assert received.events == sent and inbox.connections == 1


def test_inbox_closes_within_its_drain_time_while_a_worker_stays_connected(tmp_path):
    import time

    from kvdiag.collectors.vllm_worker_link import WorkerInbox, WorkerLink
    from kvdiag.events.hooks import HookErrors
    from kvdiag.events.schema import ProcessSample
    from kvdiag.events.sinks import ListSink

    received = ListSink()
    inbox = WorkerInbox(str(tmp_path / "inbox.sock"), received, HookErrors(ListSink(), "test"))
    link = WorkerLink.connect(str(tmp_path / "inbox.sock"))
    link.record(ProcessSample(ts_ns=1, pid=7, rss_bytes=1))
    deadline = time.monotonic() + 10
    while not received.events:  # delivered while connected
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    inbox.close(drain_s=0.5)
    assert time.monotonic() - started < 2.0
    link.record(ProcessSample(ts_ns=2, pid=7, rss_bytes=2))  # after close: not recorded, no error
    link.close(timeout_s=1.0)
    assert [e.ts_ns for e in received.events] == [1]


def test_the_workers_inbox_is_never_taken_for_the_agents_socket(monkeypatch):
    """The engine core listens on its agent socket and on the workers' inbox, both in the
    runtime dir; vLLM's process title hides its environment from /proc, so the finder reads the
    listening sockets: it must return the agent's alone (a client of the inbox reads nothing)."""
    import os

    from kvdiag import agent
    from kvdiag.collectors.agent_client import candidate_sockets
    from kvdiag.collectors.vllm_worker_link import WorkerInbox, choose_worker_socket
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.hooks import HookErrors
    from kvdiag.events.sinks import ListSink
    from kvdiag.paths import runtime_dir

    import tempfile

    # a short folder: a socket's path holds at most 107 bytes, more than pytest's tmp_path
    # (under xdist, a worker's) leaves for kvdiag/ and the inbox's name
    run = tempfile.TemporaryDirectory(prefix="kv-run-")
    monkeypatch.setenv("XDG_RUNTIME_DIR", run.name)
    monkeypatch.delenv("KVDIAG_WORKER_SOCKET", raising=False)
    monkeypatch.delenv("KVDIAG_SOCKET", raising=False)
    inbox_path = choose_worker_socket()
    assert os.path.dirname(inbox_path) == str(runtime_dir())
    inbox = WorkerInbox(inbox_path, ListSink(), HookErrors(ListSink(), "test"))
    agent_path = runtime_dir() / "demo-1-2.sock"  # a name without the agent- prefix, as the demo's
    live = agent.LiveSocketSink(agent_path, make_header(engine="vllm"))
    try:
        found = candidate_sockets([os.getpid()])
        assert agent_path in found and Path(inbox_path) not in found
    finally:
        live.close()
        inbox.close(drain_s=0.1)
        run.cleanup()


def test_attention_hooks_run_on_sampled_steps_alone():
    """Between sampled steps the attention backend's class holds vLLM's own ``forward`` (no
    kvdiag code per layer); a sampled step puts the wrapper on and the step's end takes it off,
    and ``MethodHooks.restore`` leaves vLLM's class as it was."""
    from types import SimpleNamespace

    from kvdiag.collectors.vllm_worker import WorkerShadow
    from kvdiag.events.hooks import HookErrors, MethodHooks
    from kvdiag.events.sinks import ListSink

    class Base:
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
            return "out"

    class Impl(Base):  # inherits forward, as a backend may
        pass

    errors = HookErrors(ListSink(), "test")
    methods = MethodHooks(errors)
    shadow = WorkerShadow(errors, methods)
    shadow._hook_attention(Impl, "cpu")
    shadow._gate(False)
    assert Impl.__dict__["forward"] is Base.forward

    class Runner:
        sampled = 0

        def should_sample(self):
            return True

        def layers_of_run(self, n, sampled):
            return [0]

    shadow.active, shadow.runner = True, Runner()
    shadow.num_layers = 1
    step = SimpleNamespace(num_scheduled_tokens={"r": 1})
    shadow._before_step(SimpleNamespace(), step)
    assert Impl.__dict__["forward"] is not Base.forward  # armed: the wrapper is on
    shadow.armed = None  # as a layer does when it cannot read the layout
    shadow._after_step(None, None, SimpleNamespace())
    assert Impl.__dict__["forward"] is Base.forward
    # an unsampled step (prefill only) leaves vLLM's own method on
    shadow._before_step(SimpleNamespace(), SimpleNamespace(num_scheduled_tokens={"r": 7}))
    assert Impl.__dict__["forward"] is Base.forward and Impl().forward(*range(6)) == "out"
    methods.restore()
    assert "forward" not in Impl.__dict__ and errors.total == 0
