"""P99 attribution on a real run: the real model on transformers' continuous-batching engine,
recorded by the kvdiag adapter, with long prompts injected halfway (the cause to find)."""

from __future__ import annotations

import time

import pytest

from kvdiag.analysis import latency
from kvdiag.analysis.logs import load

SHORT_TOKENS, LONG_TOKENS, PER_HALF, NEW_TOKENS = 30, 1000, 16, 8


@pytest.fixture(scope="module")
def long_halfway_log(tmp_path_factory, model_dir):
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    from kvdiag.collectors import transformers_cb as tcb
    from kvdiag.eventlog import LogWriter, make_header

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    page = 16
    path = tmp_path_factory.mktemp("attr") / "long_halfway.jsonl"
    long_ids = []
    with LogWriter(path, make_header(engine="transformers-cb", block_size_tokens=page, bytes_per_token=46080)) as sink:
        adapter = tcb.install(sink, sample_interval_s=0.05)
        try:
            manager = model.init_continuous_batching(
                generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1),
                continuous_batching_config=ContinuousBatchingConfig(page_size=page, num_blocks=256,
                                                                    max_batch_tokens=1024,  # a long prompt is one heavy step
                                                                    allow_block_sharing=False))
            manager.start()
            for i in range(2 * PER_HALF):  # one at a time; from the second half on, long prompts
                n = SHORT_TOKENS if i < PER_HALF else LONG_TOKENS
                rid = f"r{i}"
                if n == LONG_TOKENS:
                    long_ids.append(rid)
                manager.add_request([100 + (7 * j + i) % 4000 for j in range(n)], request_id=rid)
                assert manager.get_result(rid, timeout=300) is not None
            time.sleep(0.2)
            adapter.sample_now()
            manager.stop(block=True)
        finally:
            adapter.uninstall()
    return path, long_ids


@pytest.mark.model
@pytest.mark.slow
def test_long_prompts_halfway_are_the_attributed_cause(long_halfway_log):
    path, long_ids = long_halfway_log
    logs, _ = load([path])
    comps = {c.metric: c for c in latency.detect(logs)}
    step = comps["step"]  # NEW_TOKENS + 1 or more steps per request: > 100 on each side
    assert step.flagged, step
    arrivals = logs.frame("request_arrived").set_index("request_id")["ts_ns"]
    # the change point falls near the first long request (within a few requests: the split
    # is placed between steps, and a noisy step just before the injection can pull it earlier)
    assert arrivals[f"r{PER_HALF - 4}"] <= step.current_window_ns[0] <= arrivals[f"r{PER_HALF + 2}"]
    causes = {c.cause: c for c in step.causes}
    assert causes["long_sequences"].supported
    assert step.causes[0].cause == "long_sequences"
    assert set(causes["long_sequences"].evidence["long_request_ids"]) <= set(long_ids)
    for other in ("compression", "prefix_hit_rate", "memory_pressure", "fragmentation"):
        assert not causes[other].supported, causes[other]
