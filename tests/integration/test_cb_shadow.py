"""Shadow compression wired into transformers' continuous-batching engine, in-process, real model."""

from __future__ import annotations

import pytest

from kvdiag.kernels.methods import Method
from kvdiag.events.schema import CollectorError, ShadowCompression, ShadowLocality
from kvdiag.events.sinks import ListSink

PAGE = 32
SYSTEM = "You are a support assistant of a small bookshop. Be brief and kind. " * 3


def _prompts(tok, n):
    out = []
    for i in range(n):
        ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": f"Question {i}: is order {i} shipped?"}],
                                      add_generation_prompt=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


@pytest.fixture(scope="module")
def real(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    model.eval()
    return model, tok


def _generate(model, prompts, max_new_tokens):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    out = model.generate_batch(
        prompts, generation_config=GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(page_size=PAGE, num_blocks=48, max_batch_tokens=256,
                                                            allow_block_sharing=True))
    return {rid: (list(o.prompt_ids), list(o.generated_tokens)) for rid, o in out.items()}


class Raising(Method):
    def compress(self, k, v, attn_mass=None):
        k.mul_(0)  # must only ever see a copy of the live cache
        raise RuntimeError("compressor exploded")


class _Recording:
    """Keeps every snapshot (K, V, q per layer) the runner measured, for the independent check."""

    def __init__(self, runner):
        self.snapshots = []
        original = runner._snapshot

        def snapshot(layers_kv, queries, layers):
            snap = original(layers_kv, queries, layers)
            assert list(layers) == list(range(len(layers_kv)))  # these tests measure every layer
            self.snapshots.append(snap)
            return snap
        runner._snapshot = snapshot


def _installed(sink, **kwargs):
    from kvdiag.collectors import transformers_cb as tcb
    from kvdiag.shadow import transformers_cb as cbs

    adapter = tcb.install(sink)
    kwargs.setdefault("layers_per_run", None)  # every layer of each sampled step
    shadow = cbs.install(sink, background=False, **kwargs)
    return adapter, shadow


@pytest.mark.model
def test_shadow_gathers_the_requests_paged_kv_and_query(real):
    """Every sampled step's K/V and query equal those of the same request's tokens recomputed
    with a plain DynamicCache forward; events carry the request's tokens so far."""
    import torch
    from transformers import DynamicCache

    from kvdiag.kernels.attention import QueryCapture

    model, tok = real
    prompts = _prompts(tok, 3)
    sink = ListSink()
    adapter, shadow = _installed(sink, methods="int8,int4", sample_rate=1.0, budget_frac=None)
    recorder = _Recording(shadow.runner)
    try:
        outputs = _generate(model, prompts, max_new_tokens=5)
    finally:
        shadow.uninstall()
        adapter.uninstall()
    assert shadow.errors == 0 and not shadow.runner.errors
    assert len(shadow.samples) == len(recorder.snapshots) >= 2
    comp = [e for e in sink.events if isinstance(e, ShadowCompression)]
    loc = [e for e in sink.events if isinstance(e, ShadowLocality)]
    n_layers, kv_heads, q_heads = model.config.num_hidden_layers, model.config.num_key_value_heads, \
        model.config.num_attention_heads
    assert len(comp) == len(shadow.samples) * n_layers * kv_heads * 2
    assert len(loc) == len(shadow.samples) * n_layers * q_heads
    seq_lens = sorted(s.seq_len_tokens for s in shadow.samples)
    assert sorted({e.seq_len_tokens for e in comp}) == sorted(set(seq_lens))
    assert sorted({e.seq_len_tokens for e in loc}) == sorted(set(seq_lens))

    capture = QueryCapture(model)
    try:
        for sample, snap in zip(shadow.samples, recorder.snapshots):
            prompt, generated = outputs[sample.request_id]
            tokens = (prompt + generated)[: sample.seq_len_tokens]
            # a decode step: the cache holds the prompt and some generated tokens, the last one new
            assert len(prompt) < sample.seq_len_tokens < len(prompt) + len(generated)
            cache = DynamicCache(config=model.config)
            capture.armed = True
            with torch.no_grad():
                model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
            capture.armed = False
            queries = capture.queries()
            for layer, (k, v, q) in enumerate(snap):
                ref = cache.layers[layer]
                assert k.shape == ref.keys.shape == (1, kv_heads, sample.seq_len_tokens, k.shape[-1])
                torch.testing.assert_close(k, ref.keys, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(v, ref.values, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(q, queries[layer][:, :, -1:, :], atol=1e-4, rtol=1e-4)
    finally:
        capture.close()


@pytest.mark.model
def test_shadow_never_changes_the_generated_tokens(real):
    """Same tokens with shadow off, on at every step, and with a compressor that raises
    (counted and reported as CollectorError)."""
    model, tok = real
    prompts = _prompts(tok, 3)
    off = _generate(model, prompts, max_new_tokens=6)

    sink = ListSink()
    adapter, shadow = _installed(sink, methods="int4", sample_rate=1.0, budget_frac=None, locality=False)
    try:
        on = _generate(model, prompts, max_new_tokens=6)
    finally:
        shadow.uninstall()
        adapter.uninstall()
    assert on == off
    assert shadow.samples and shadow.errors == 0

    sink = ListSink()
    adapter, shadow = _installed(sink, methods=[Raising("raising", "raising")], sample_rate=1.0, budget_frac=None, locality=False)
    try:
        broken = _generate(model, prompts, max_new_tokens=6)
    finally:
        shadow.uninstall()
        adapter.uninstall()
    assert broken == off
    errors = [e for e in sink.events if isinstance(e, CollectorError) and e.collector.startswith("shadow:")]
    expected = len(shadow.samples) * model.config.num_hidden_layers
    assert expected > 1 and sum(shadow.runner.errors.values()) == expected
    # kvdiag.events.hooks' policy: the first error at once, the rest when the shadow is uninstalled
    assert [(e.collector, e.count) for e in errors] == [("shadow:raising", 1), ("shadow:raising", expected - 1)]
    assert "compressor exploded" in errors[0].message


def test_shadow_flags_reach_the_agent_and_bad_ones_fail_in_one_line():
    import argparse
    import subprocess
    import sys

    from kvdiag.commands import _demo_shadow
    from kvdiag.run import parse_args

    parser = argparse.ArgumentParser()
    _demo_shadow.add_arguments(parser)
    args = parser.parse_args(["--shadow", "--shadow-methods", "int4,h2o", "--shadow-rate", "0.2",
                              "--shadow-budget", "0"])
    assert _demo_shadow.check(args) is None
    run_args, command = parse_args(_demo_shadow.agent_args(args) + ["--", "transformers", "serve"])
    assert (run_args.shadow, run_args.shadow_methods, run_args.shadow_rate, run_args.shadow_budget) == \
        (True, "int4,h2o", 0.2, 0.0)
    assert command == ["transformers", "serve"]
    assert _demo_shadow.agent_args(parser.parse_args([])) == []
    assert "unknown method" in _demo_shadow.check(parser.parse_args(["--shadow-methods", "int3"]))
    proc = subprocess.run([sys.executable, "-m", "kvdiag.run", "--shadow", "--shadow-methods", "int3", "--",
                           "python", "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("kvdiag.run: --shadow-methods: unknown method 'int3'")


@pytest.mark.model
def test_agent_with_shadow_writes_shadow_events_to_its_log(real, tmp_path):
    from kvdiag import agent
    from kvdiag.diagnosis.compression import compression_table, recommend
    from kvdiag.events.eventlog import read_log

    model, tok = real
    log_path = tmp_path / "shadow.kvlog"
    agent.start(log_path=str(log_path), socket=False, block_size_tokens=PAGE,
                shadow={"methods": "int8,int4", "sample_rate": 1.0, "budget_frac": None})
    try:
        outputs = _generate(model, _prompts(tok, 2), max_new_tokens=4)
    finally:
        agent.stop()
    log = read_log(log_path)
    assert not log.problems
    comp, loc = log.frame("shadow_compression"), log.frame("shadow_locality")
    # every decode step (tokens 2..4 of each request share steps) was sampled once
    assert comp["ts_ns"].nunique() == 3 and set(comp["method"]) == {"int8", "int4"}
    # by default three layers per sampled step, spread over the depth and rotating
    layers = model.config.num_hidden_layers
    measured = {ts: sorted(set(g["layer"])) for ts, g in comp.groupby("ts_ns")}
    assert sorted(measured.values()) == [[k, k + layers // 3, k + 2 * layers // 3] for k in range(3)]
    assert len(loc) == 3 * 3 * model.config.num_attention_heads
    prompt_lens = {len(p) for p, _ in outputs.values()}
    assert set(comp["seq_len_tokens"]) <= {n + i for n in prompt_lens for i in (1, 2, 3)}
    table = compression_table(comp)
    assert set(table["group"]) == {"1-6", "7-12", "13+"}
    assert list(recommend(table)["group"]) == ["1-6", "7-12", "13+"]


@pytest.mark.model
def test_agent_warms_the_shadow_up_before_the_engine_serves(real, model_dir, tmp_path):
    """Given the model's folder, ``agent.start`` pays the shadow's one-time costs before the
    engine serves: every CPU kernel a sampled step calls is built and compiled by then (no kernel
    built and no numba signature added while serving), and the warm-up records nothing."""
    from kvdiag import agent
    from kvdiag.events.eventlog import read_log
    from kvdiag.kernels import quant_cpu, quant_simd

    model, tok = real
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    quant_simd.token_kernels.cache_clear()  # as in a fresh process: nothing built yet
    quant_simd.channel_kernels.cache_clear()

    def builds():
        return quant_simd.token_kernels.cache_info().misses, quant_simd.channel_kernels.cache_info().misses

    log_path = tmp_path / "warm.kvlog"
    agent.start(log_path=str(log_path), socket=False, block_size_tokens=PAGE, model=str(model_dir),
                shadow={"methods": "int8,fp8_e4m3", "sample_rate": 1.0, "budget_frac": None})
    try:
        built = builds()
        assert built == (2, 2)  # int8 and fp8 values per token, keys per channel
        kernels = [quant_cpu._kernels(fmt, axis, 32, head_dim) for fmt in ("int8", "fp8_e4m3")
                   for axis in ("token", "channel")]
        assert builds() == built  # the warm-up built each of them
        signatures = [[list(fn.signatures) for fn in ks] for ks in kernels]
        assert all(enc and dec for _, enc, dec in signatures)  # encode and decode compiled
        _generate(model, _prompts(tok, 2), max_new_tokens=4)
    finally:
        agent.stop()
    assert builds() == built
    assert [[list(fn.signatures) for fn in ks] for ks in kernels] == signatures
    comp = read_log(log_path).frame("shadow_compression")
    assert comp["ts_ns"].nunique() == 3  # the three sampled decode steps, and not the warm-up


def test_kv_shape_of_reads_the_models_config_and_says_none_otherwise(tmp_path):
    import json

    from kvdiag.agent import KVShape, kv_shape_of

    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert kv_shape_of(str(tmp_path)) == KVShape(layers=30, query_heads=9, kv_heads=3, head_dim=64)
    assert kv_shape_of(str(tmp_path)).fp32_bytes_per_token == 2 * 30 * 3 * 64 * 4
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "head_dim": 128, "num_key_value_heads": None}))
    assert kv_shape_of(str(tmp_path)) == KVShape(30, 9, 9, 128)  # no KV heads given: multi-head attention
    for broken in ('{"num_hidden_layers": 30}', '{"num_hidden_layers": 30, "num_attention_heads": 0, '
                   '"hidden_size": 576}', '{not json'):
        (tmp_path / "config.json").write_text(broken)
        assert kv_shape_of(str(tmp_path)) is None
    assert kv_shape_of("") is None and kv_shape_of(str(tmp_path / "absent")) is None


def test_kv_shape_of_a_hub_id_reads_the_local_hugging_face_cache_only(tmp_path, monkeypatch):
    """A hub id (``kvdiag run --model org/name``) is looked up in the local cache, in the layout
    huggingface_hub writes (refs/main -> snapshots/<commit>/config.json); nothing is fetched."""
    import json

    from kvdiag.agent import KVShape, kv_shape_of

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--acme--tiny-lm"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}))
    assert kv_shape_of("acme/tiny-lm") == KVShape(4, 8, 2, 32)
    assert kv_shape_of("acme/not-cached") is None
    assert kv_shape_of("no such / id") is None
