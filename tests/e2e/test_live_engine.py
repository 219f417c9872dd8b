"""Live shadow sharing fed by the transformers engine adapter, on the real model and engine:
at the engine's own settings the content-hash hit rate equals the engine's reported hit rate
(no gap on a healthy engine), and the what-ifs equal the offline simulator on the same prompts."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

SYSTEMS = ["You are a meticulous travel agent. Answer in two sentences and always name a concrete "
           "place to visit, with opening hours when you know them, and mention the nearest "
           "public transport stop.",
           "You are a terse Linux administrator. Reply with shell commands only, no prose, and "
           "prefer POSIX tools that exist on every distribution; never use sudo unless asked."]
QUESTIONS = ["What should I see in Lyon?", "How do I list open ports?", "Plan a day in Kyoto."]


def test_engine_hit_rate_equals_shadow_at_engine_settings(tmp_path, model_dir):
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvdiag.simulation.live_sharing import ShadowConfig, ShadowSharingSink
    from kvdiag.simulation.sharing import simulate
    from kvdiag.traces.loaders import load_trace
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.events.schema import RequestArrived
    from kvdiag.events.sinks import FanoutSink, ListSink

    from kvdiag.collectors import transformers_cb

    torch.set_num_threads(1)
    path = model_dir
    tok = AutoTokenizer.from_pretrained(str(path))
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def chat(system, question):
        enc = tok.apply_chat_template([{"role": "system", "content": system},
                                       {"role": "user", "content": question}],
                                      add_generation_prompt=True)
        return list(enc["input_ids"])

    first = [chat(s, QUESTIONS[0]) for s in SYSTEMS]
    second = [chat(s, q) for s in SYSTEMS for q in QUESTIONS[1:]]
    events = ListSink()
    whatif = ShadowConfig("lru", 16, None)
    shadow = ShadowSharingSink([whatif], ListSink(), interval_s=3600)
    transformers_cb.install(FanoutSink([events, shadow]), record_token_ids=True)
    cfg = ContinuousBatchingConfig(page_size=32, num_blocks=64, allow_block_sharing=True)
    gen = GenerationConfig(max_new_tokens=2, do_sample=False)
    try:  # two waves on one persistent engine: the second finds the first's system prompts
        model.generate_batch(inputs=first, generation_config=gen,
                             continuous_batching_config=cfg, persistent_manager=True)
        model.generate_batch(inputs=second, generation_config=gen,
                             continuous_batching_config=cfg, persistent_manager=True)
    finally:
        transformers_cb.uninstall()
    assert shadow.errors == 0
    assert shadow.engine_config == ShadowConfig("lru", 32, 64)
    assert shadow.engine_hit_rate > 0  # the second wave really reused the system prompts
    assert shadow.gap() == pytest.approx(0.0, abs=1e-12)
    # the what-if at 16-token blocks equals the offline replay of the same events, logged
    prompts = [e.token_ids for e in events.events if isinstance(e, RequestArrived)]
    assert sorted(map(tuple, prompts)) == sorted(map(tuple, first + second))
    log = tmp_path / "engine.kvlog"
    with LogWriter(log, make_header(engine="transformers-cb", block_size_tokens=32)) as w:
        for ev in events.events:
            w.record(ev)
    offline = simulate(load_trace(log, block_size_tokens=16), "lru", None)
    live = {(e.policy, e.block_size_tokens): e for e in shadow.snapshot()}[("lru", 16)]
    assert live.token_hit_rate == pytest.approx(offline.token_hit_rate, abs=1e-12)
