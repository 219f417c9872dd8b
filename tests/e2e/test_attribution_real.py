"""P99 attribution on a real run: the real model on transformers' continuous-batching engine,
recorded by the kvdiag adapter, with long prompts injected halfway (the cause to find).

The injected effect is built to stand far above machine noise, so the change point is exact:
before it every engine step decodes one token (or prefills a short prompt); after it every
step prefills a chunk of CHUNK_TOKENS tokens of a long prompt (the long requests generate one
token, so they have no decode steps). A chunk step costs several times a decode step, so the
two groups of step durations do not overlap and Pettitt's statistic peaks exactly between
them. Exactly only if the change falls after the middle of the steps: a long prompt's chunk
steps grow longer as its context grows, and with as many heavy steps after the change as light
ones before, moving the split past the first heavy steps changes U by about (heavy after) -
(light before) ~ 0, so the peak wandered a bucket late (CI: 149 ms off with 128 ms buckets).
With L ~ 1.6 H light steps before the change (H heavy after), moving a heavy step before the
split lowers |U| by at least L - H. Moving a light step after it raises |U| when that step is
slower than a fraction (1 + H/L) / 2 ~ 81% of the light steps before it: a bucket of light steps
slowed together by a loaded machine (CI: one bucket, 281 ms early with 256 ms buckets) still
moves the peak one bucket early. So the test allows one bucket either way of the bucket holding
the first heavy step; the middle split lies ~ 35 light steps (several buckets) early, and the
test checks that it falls outside that range, so a detector that split at the middle fails."""

from __future__ import annotations

import time

import pytest

from kvdiag.diagnosis import latency_regression
from kvdiag.diagnosis.frames import load
from kvdiag.diagnosis.latency_facts import series as latency_series

SHORT_TOKENS, SHORT_NEW_TOKENS, SHORT_REQUESTS = 30, 8, 22  # 8-9 light steps each: ~180 in all
LONG_TOKENS, CHUNK_TOKENS, LONG_REQUESTS = 1000, 128, 14  # 8 heavy chunk steps each: > 100


@pytest.fixture(scope="module")
def long_halfway_log(tmp_path_factory, model_dir):
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    from kvdiag.collectors import transformers_cb as tcb
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    page = 16
    path = tmp_path_factory.mktemp("attr") / "long_halfway.jsonl"
    long_ids = []
    with LogWriter(path, make_header(engine="transformers-cb", block_size_tokens=page, bytes_per_token=46080)) as sink:
        adapter = tcb.install(sink, sample_interval_s=0.05)
        try:
            manager = model.init_continuous_batching(
                generation_config=GenerationConfig(max_new_tokens=SHORT_NEW_TOKENS, do_sample=False,
                                                   eos_token_id=-1),
                continuous_batching_config=ContinuousBatchingConfig(page_size=page, num_blocks=256,
                                                                    max_batch_tokens=CHUNK_TOKENS,
                                                                    allow_block_sharing=False))
            manager.start()
            for i in range(SHORT_REQUESTS + LONG_REQUESTS):  # one at a time; then long prompts
                long = i >= SHORT_REQUESTS
                rid = f"r{i}"
                if long:
                    long_ids.append(rid)
                manager.add_request([100 + (7 * j + i) % 4000 for j in range(LONG_TOKENS if long else SHORT_TOKENS)],
                                    request_id=rid, max_new_tokens=1 if long else SHORT_NEW_TOKENS)
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
    comps = {c.metric: c for c in latency_regression.detect(logs)}
    step = comps["step"]
    assert step.flagged, step
    # the change point is the first engine step after the first long request arrived, to the
    # latency series' bucket (change points fall on bucket boundaries; the bucket holding the
    # first long step may split either way)
    first_long_ns = logs.frame("request_arrived").set_index("request_id")["ts_ns"][long_ids[0]]
    steps_ns = logs.frame("engine_step")["ts_ns"]
    first_long_step_ns = int(steps_ns[steps_ns > first_long_ns].min())
    width_ns = latency_series(logs)["step"].width_ns
    t0_ns, t1_ns = logs.time_range_ns()
    assert width_ns * 50 < t1_ns - t0_ns  # a bucket is a small part of the log
    # one bucket either way of the bucket holding the first heavy step (see the module docstring);
    # a detector that split at the middle sample would fail here
    def buckets_off(split_ns):
        return (split_ns - first_long_step_ns) / width_ns

    assert -2 < buckets_off(step.current_window_ns[0]) < 2
    assert buckets_off(latency_regression.middle_split(latency_series(logs)["step"])) <= -2
    causes = {c.cause: c for c in step.causes}
    assert causes["long_sequences"].supported
    assert step.causes[0].cause == "long_sequences"
    assert set(causes["long_sequences"].evidence["long_request_ids"]) <= set(long_ids)
    for other in ("compression", "prefix_hit_rate", "memory_pressure", "fragmentation"):
        assert not causes[other].supported, causes[other]
