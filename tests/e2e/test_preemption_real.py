"""Preemption on transformers' real continuous-batching engine, and `kvdiag plan` against it.

1. In process: the embedded model with a pool too small for its requests' growth. The engine
   (transformers >= 5.2x) preempts by freeing running requests' blocks with
   ``free_blocks(no_cache=True)`` and requeues them (soft reset). The adapter must record one
   ``RequestPreempted`` per such call (a spy on the engine's own method counts them) and still
   one ``RequestFinished`` per request, with all its output tokens.
2. Recorded demo runs (tests/data/demo_preempt/ABOUT.md): `kvdiag plan --pool-blocks` on each
   run's own arrivals and lengths against the engine's recorded preemptions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.events.eventlog import read_log

DATA = Path(__file__).parent.parent / "data" / "demo_preempt"
POOL40 = DATA / "demo_16req_pool40.kvlog.gz"
POOL56 = DATA / "demo_16req_pool56.kvlog.gz"
POOL72 = DATA / "demo_16req_pool72.kvlog.gz"


def test_adapter_records_the_engines_preemptions(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    from kvdiag.collectors import transformers_cb as tcb
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.demo.smollm import ensure_model

    model_dir = ensure_model()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    page, new_tokens = 16, 40
    spy = []
    orig = PagedAttentionCache.free_blocks

    def free_blocks(self, request_id, no_cache=False):  # the engine's own preemption calls
        if no_cache:
            spy.append(request_id)
        return orig(self, request_id, no_cache)

    path = tmp_path / "preempt.jsonl"
    header = make_header(engine="transformers-cb", model=str(model_dir), block_size_tokens=page,
                         bytes_per_token=46080, node="preempt")
    PagedAttentionCache.free_blocks = free_blocks
    try:
        with LogWriter(path, header) as sink:
            adapter = tcb.install(sink, sample_interval_s=0.05)
            try:
                prompts = [list(range(200 + 7 * i, 260 + 7 * i)) for i in range(4)]
                out = model.generate_batch(
                    inputs=prompts,
                    generation_config=GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                                       eos_token_id=-1),
                    continuous_batching_config=ContinuousBatchingConfig(
                        page_size=page, num_blocks=12, max_batch_tokens=128,
                        allow_block_sharing=False))
            finally:
                adapter.uninstall()
    finally:
        PagedAttentionCache.free_blocks = orig
    assert len(out) == 4
    log = read_log(path)
    pre = log.frame("request_preempted")
    assert len(spy) > 0, "the pool was expected to force preemptions"
    assert sorted(pre["request_id"]) == sorted(spy)
    fin = log.frame("request_finished")
    assert len(fin) == 4 and fin["request_id"].is_unique
    assert (fin["output_tokens"] == new_tokens).all()
    assert (fin["prompt_tokens"] == 60).all()
    assert len(log.frame("request_first_token")) == 4


def _plan(log: Path, pool: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvdiag", "plan", "--trace", str(log),
                          "--pool-blocks", str(pool), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("log,pool", [(POOL40, 40), (POOL56, 56)])
def test_plan_against_the_engines_recorded_preemptions(log, pool):
    """Pools of 40 and 56 blocks: the engine preempted; the plan predicts an overflow and counts
    at least the preempted requests as affected (an upper bound: the unconstrained demand
    ignores the queueing the engine does instead); the pool plus the plan's headroom makes the
    plan's demand fit."""
    events = read_log(log)
    assert events.frame("kv_pool_info")["num_blocks"].iloc[0] == pool
    preempted = set(events.frame("request_preempted")["request_id"])
    assert preempted
    plan = _plan(log, pool)["pool"]
    assert plan["headroom_blocks"] > 0 and plan["first_overflow_s"] is not None
    assert plan["requests_affected"] >= len(preempted)
    assert _plan(log, pool + plan["headroom_blocks"])["pool"]["requests_affected"] == 0


def test_plan_headroom_was_enough_for_the_engine():
    """The headroom the plan asks for on the 40-block run (peak demand 72 blocks) was enough:
    the engine, recorded with 72 blocks and the same chats, preempted nothing, and the plan
    on that run predicts no overflow."""
    enough = 40 + _plan(POOL40, 40)["pool"]["headroom_blocks"]
    big = read_log(POOL72)
    assert big.frame("kv_pool_info")["num_blocks"].iloc[0] == 72 >= enough
    assert len(big.frame("request_preempted")) == 0
    assert _plan(POOL72, 72)["pool"]["requests_affected"] == 0


# the plan counts a request's blocks from arrival; the engine admits it a little later
PEAK_TOLERANCE_UNPREEMPTED = 0.10


def test_plan_peak_on_the_run_without_preemption():
    """Where nothing was preempted the engine's measured peak (max blocks_used) is the demand:
    the plan's predicted peak (exact prefix sharing) is within 10% of it, and above it."""
    measured = int(read_log(POOL72).frame("kv_pool_sample")["blocks_used"].max())
    rows = {r["variant"]: r for r in _plan(POOL72, 72)["rows"]}
    predicted = rows["prefix sharing"]["peak_blocks"]
    assert measured <= predicted <= (1 + PEAK_TOLERANCE_UNPREEMPTED) * measured, (predicted, measured)
