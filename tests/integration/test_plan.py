"""`kvdiag plan`: KV bytes per token against the real model's cache tensors and the recorded
log header, the predicted peak against the engine's measured peak, the concurrency simulation
against a brute-force oracle, the article's 175B figure against Little's law, CLI errors and
the CPU time on a 12k-request trace."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import hypothesis_examples
from trace_copies import repeat_mooncake
from kvdiag.simulation import concurrency
from kvdiag.pool.kv_shape import (BUILTIN_MODELS, ModelConfigError, from_hf_config,
                                          kv_bytes_per_token)
from kvdiag.simulation.capacity_plan import PlanSettings, make_plan
from kvdiag.traces.workload import PromptKeys, Workload, load_mooncake, synthetic
from kvdiag.cli import main

DATA = Path(__file__).parent.parent / "data"
DEMO_LOG = DATA / "demo_small" / "demo_24req_seed1.kvlog.gz"
MOONCAKE = DATA / "mooncake" / "synthetic_trace.jsonl"

PEAK_TOLERANCE = 0.05
"""Predicted peak blocks of the recorded demo run may differ from the engine's measured peak by
at most 5% (the engine fills prompts chunk by chunk and the planner holds each prompt whole
from arrival; at the peak every live prompt is whole)."""


# ---------------------------------------------------------------- bytes per token


def test_builtin_shapes_match_published_dimensions():
    # GPT-3 175B: d_model 12288, 96 layers, MHA -> K and V of d_model each per layer
    assert kv_bytes_per_token(BUILTIN_MODELS["gpt3-175b"], "fp16") == 2 * 96 * 12288 * 2
    # Llama-3: 8 KV heads of 128 (GQA), bf16
    assert kv_bytes_per_token(BUILTIN_MODELS["llama3-8b"], "bf16") == 2 * 32 * 1024 * 2
    assert kv_bytes_per_token(BUILTIN_MODELS["llama3-70b"], "bf16") == 2 * 80 * 1024 * 2
    assert BUILTIN_MODELS["llama3-8b"].attention == "GQA"
    assert BUILTIN_MODELS["gpt3-175b"].attention == "MHA"


def test_bytes_per_token_equals_recorded_log_header():
    header = json.loads(gzip.open(DEMO_LOG).readline())
    assert header["bytes_per_token"] == 46080
    assert kv_bytes_per_token(BUILTIN_MODELS["smollm2-135m"], "fp32") == header["bytes_per_token"]


def test_bytes_per_token_equals_real_dynamic_cache(model_dir):
    """The embedded model's own config.json, through the planner, against the bytes its
    transformers DynamicCache holds after a real prefill."""
    import torch
    from kv_model import prefill_kv

    ids, kv = prefill_kv()
    tokens = ids.shape[1]
    cache_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
    assert kv[0][0].dtype == torch.float32
    shape = from_hf_config(model_dir)
    assert kv_bytes_per_token(shape, "fp32") * tokens == cache_bytes
    assert shape.attention == "GQA"


def test_hf_config_errors_name_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"num_hidden_layers": 0, "num_attention_heads": 4, "hidden_size": 64}')
    with pytest.raises(ModelConfigError, match="config.json: num_hidden_layers"):
        from_hf_config(bad)
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match="expected JSON"):
        from_hf_config(tmp_path)


# ---------------------------------------------------------------- the recorded demo run


def _measured_peak_blocks() -> int:
    peak = 0
    with gzip.open(DEMO_LOG) as f:
        for line in f:
            event = json.loads(line)
            if event.get("type") == "kv_pool_sample":
                peak = max(peak, event["blocks_used"])
    return peak


@pytest.mark.parametrize("timing", ["recorded", "model"])
def test_predicted_peak_matches_engine_on_recorded_demo(timing, capsys):
    measured = _measured_peak_blocks()
    assert measured == 149
    assert main(["plan", "--trace", str(DEMO_LOG), "--timing", timing, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["variant"]: r for r in out["rows"]}
    predicted = rows["prefix sharing"]["peak_blocks"]
    assert abs(predicted - measured) <= PEAK_TOLERANCE * measured, (predicted, measured)
    # without sharing the prediction is far off: the engine shares prompt prefixes
    assert rows["as is"]["peak_blocks"] > 1.4 * measured
    assert out["model"]["kv_bytes_per_token"] == 46080
    assert out["engine"]["block_size_tokens"] == 32


def test_prompt_only_sharing_matches_replay_footprint():
    """With outputs of one token (a request holds only its prompt) the shared peak equals the
    replay simulator's memory footprint of the same log (an independent implementation)."""
    from kvdiag.diagnosis.frames import load
    from kvdiag.simulation.footprint import memory_footprint
    from kvdiag.traces.loaders import load_trace
    from kvdiag.traces.workload import from_logs

    logs, _ = load([DEMO_LOG])
    work = from_logs(logs, 32, "demo")
    sched = concurrency.HoldSchedule(work.arrival_s, work.finish_s, work.finish_s,
                                     work.prompt_tokens, np.ones(work.requests, np.int64))
    ours = concurrency.held_blocks(sched, 32, keys=work.prompt_keys).peak
    ours_unshared = concurrency.held_blocks(sched, 32).peak
    footprint = memory_footprint(load_trace(DEMO_LOG, format="kvdiag"))
    assert footprint.concurrency_model == "arrival to finish"
    assert (ours, ours_unshared) == (footprint.peak_shared_blocks, footprint.peak_unshared_blocks)


# ---------------------------------------------------------------- the oracle


def _oracle_levels(start, first, finish, p, o, B, keys=None):
    """Blocks held right after all events at each distinct event time, request by request."""
    d = (finish - first) / np.maximum(o, 1)
    times = set(start) | set(finish)
    for i in range(len(p)):
        times |= {first[i] + k * d[i] for k in range(1, max(o[i], 1))}
    out = []
    for t in sorted(times):
        held, live_keys = 0, set()
        for i in range(len(p)):
            if not start[i] <= t < finish[i]:
                continue
            k = max([0] + [k for k in range(1, max(o[i], 1)) if first[i] + k * d[i] <= t])
            blocks = math.ceil((p[i] + k) / B)
            if keys is not None:  # full prompt blocks: held once over all live requests
                live_keys |= set(keys[i])
                blocks -= len(keys[i])
            held += blocks
        out.append((t, held + len(live_keys)))
    return out


@st.composite
def small_workloads(draw):
    n = draw(st.integers(1, 7))
    B = draw(st.sampled_from([1, 2, 4, 16]))
    start = np.array([draw(st.integers(0, 20)) for _ in range(n)], float)
    prefill = np.array([draw(st.integers(0, 5)) for _ in range(n)], float)
    o = np.array([draw(st.integers(0, 12)) for _ in range(n)], np.int64)
    decode = np.array([draw(st.integers(0, 6)) for _ in range(n)], float)
    p = np.array([draw(st.integers(0, 40)) for _ in range(n)], np.int64)
    keys = None
    if draw(st.booleans()):  # chained keys: requests share a common prefix of full blocks
        keys = []
        for i in range(n):
            family = draw(st.integers(0, 2))
            keys.append([(family, j) for j in range(int(p[i]) // B)])
    first = start + prefill
    return start, first, first + decode * o, p, o, B, keys


def _prompt_keys(keys, B) -> PromptKeys:
    ids = {}
    flat = [ids.setdefault(k, len(ids)) for ks in keys for k in ks]
    offsets = np.concatenate([[0], np.cumsum([len(k) for k in keys])]).astype(np.int64)
    return PromptKeys(np.asarray(flat, np.int64), offsets, np.ones(len(ids), np.int64))


@settings(max_examples=hypothesis_examples(150), deadline=None)
@given(small_workloads(), st.integers(0, 12))
def test_held_blocks_match_brute_force(w, pool):
    start, first, finish, p, o, B, keys = w
    sched = concurrency.HoldSchedule(start, first, finish, p, o)
    sim = concurrency.held_blocks(sched, B, keys=None if keys is None else _prompt_keys(keys, B))
    oracle = _oracle_levels(start, first, finish, p, o, B, keys)
    assert sim.peak == max(level for _, level in oracle)
    # the level after the last event at each distinct time, and the time-weighted mean
    idx = np.searchsorted(sim.times_s, [t for t, _ in oracle], side="right") - 1
    assert [int(sim.level[i]) if i >= 0 else 0 for i in idx] == [lvl for _, lvl in oracle]
    ts = np.array([t for t, _ in oracle])
    lv = np.array([lvl for _, lvl in oracle])
    if ts[-1] > ts[0]:
        want = float((lv[:-1] * np.diff(ts)).sum() / (ts[-1] - ts[0]))
        assert sim.mean() == pytest.approx(want)
        seq = concurrency.sequences(sched)
        live = [sum(start[i] <= t < finish[i] for i in range(len(p))) for t in ts]
        assert seq.peak == max(live)
        # the pool what-if: time above the pool, and requests live during such a time
        over = [(a, b) for a, b, lvl in zip(ts[:-1], ts[1:], lv[:-1]) if lvl > pool]
        got = concurrency.pool_overflow(sim, sched, pool)
        assert got.over_s == pytest.approx(sum(b - a for a, b in over))
        assert got.requests_affected == sum(
            any(a < finish[i] and b > start[i] for a, b in over) for i in range(len(p)))
        assert got.headroom_blocks == max(lv) - pool


def test_pool_overflow_by_hand():
    # two one-block requests, [0, 2) and [1, 3): 1, 2, 1, 0 blocks
    sched = concurrency.HoldSchedule(np.array([0.0, 1.0]), np.array([0.0, 1.0]),
                                     np.array([2.0, 3.0]), np.array([16, 16]), np.array([1, 1]))
    got = concurrency.pool_overflow(concurrency.held_blocks(sched, 16), sched, 1)
    assert (got.over_s, got.requests_affected, got.first_overflow_s, got.headroom_blocks) == (1.0, 2, 1.0, 1)
    assert got.over_fraction == pytest.approx(1 / 3)
    assert concurrency.pool_overflow(concurrency.held_blocks(sched, 16), sched, 2).requests_affected == 0


def test_predicted_reservations_use_finished_history():
    # A (0..1 s, 16 + 32 tokens) finishes before B arrives: B is predicted 32 output tokens
    sched = concurrency.HoldSchedule(np.array([0.0, 2.0]), np.array([0.0, 2.0]),
                                     np.array([1.0, 3.0]), np.array([16, 16]), np.array([32, 0]))
    reserved = concurrency.predicted_reservations(sched, 16)
    assert list(reserved.level) == [1, 0, 3, 0]  # A: prompt only (no history); B: ceil(48/16)


def test_time_weighted_quantile():
    tl = concurrency.Timeline(np.array([0.0, 1.0, 100.0]), np.array([10, 1, 0]))
    assert tl.peak == 10
    assert tl.quantile(0.99) == 1  # level 1 (or less) for 99 s of 100
    assert tl.quantile(0.995) == 10  # the top 1% is the 1 s at level 10
    assert tl.mean() == pytest.approx((10 * 1 + 1 * 99) / 100)


# ---------------------------------------------------------------- the article's figure


def test_article_figure_175b_at_1000_qps():
    """175B fp16, 1000 QPS, 512-token prompts, 128 output tokens at 20 ms each: the peak is
    more than 2 TB and within a few % of Little's law x the mean blocks a request holds."""
    work = synthetic(1000, 20000, "512", "128", seed=1)
    s = PlanSettings(dtype="fp16", block_size_tokens=16, gpu_memory_gib=80, kv_share=0.5,
                     decode_s_per_token=0.02)
    plan = make_plan(work, BUILTIN_MODELS["gpt3-175b"], s)
    row = plan.rows[0]
    assert row.peak_kv_bytes > 2e12
    # independent: a request holds 32 blocks for one step, then ceil((512 + k) / 16) for
    # k = 1..127, each for 20 ms; Little's law: 1000/s x 2.56 s requests in flight
    mean_blocks_per_request = (32 + sum(math.ceil((512 + k) / 16) for k in range(1, 128))) / 128
    steady_bytes = 1000 * 128 * 0.02 * mean_blocks_per_request * 16 * 2 * 96 * 12288 * 2
    assert steady_bytes < row.peak_kv_bytes < 1.1 * steady_bytes
    assert row.gpus_needed == math.ceil(row.peak_kv_bytes / (40 * 2**30))
    assert 18 <= row.servers_needed <= 24  # "about 20x one 8-GPU server"


# ---------------------------------------------------------------- CLI


def test_cli_table_shows_formula_and_assumptions(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps at the terminal's width
    assert main(["plan", "--model", "llama3-8b", "--qps", "10", "--requests", "200",
                 "--prompt-tokens", "lognormal:1000,0.5", "--output-tokens", "200",
                 "--sharing-hit-rate", "0.3", "--compression-ratio", "2"]) == 0
    out = capsys.readouterr().out
    assert "131,072 bytes/token" in out
    assert "2 x 32 layers x 8 KV heads x 128 head_dim x 2 bytes (bf16)" in out
    for variant in ("as is", "prefix sharing", "compression", "sharing + compression"):
        assert variant in out
    assert "lognormal, median 1000 tokens, sigma 0.5" in out
    assert "one token every 20 ms" in out


def test_cli_sharing_and_compression_rows(capsys):
    assert main(["plan", "--model", "llama3-8b", "--qps", "5", "--requests", "100",
                 "--prompt-tokens", "320", "--output-tokens", "1", "--block-size", "16",
                 "--sharing-hit-rate", "0.5", "--compression-ratio", "4", "--json"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    # prompts of 320 tokens = 20 blocks; half shared -> 10 blocks per request
    assert rows["prefix sharing"]["peak_blocks"] * 2 == rows["as is"]["peak_blocks"]
    assert rows["compression"]["peak_kv_bytes"] * 4 == rows["as is"]["peak_kv_bytes"]


def _cli_error(capsys, argv) -> str:
    assert main(["plan", *argv]) == 2
    return capsys.readouterr().err


def test_cli_bad_input_exits_2_naming_the_place(capsys, tmp_path):
    assert "--qps -5.0: expected a positive" in _cli_error(capsys, ["--model", "gpt3-175b", "--qps", "-5"])
    missing = tmp_path / "nope.jsonl"
    assert f"{missing}: no such file" in _cli_error(capsys, ["--model", "gpt3-175b", "--trace", str(missing)])
    assert "no-such-model: expected a built-in model" in _cli_error(capsys, ["--model", "no-such-model", "--qps", "1"])
    assert "--kv-share 0.0" in _cli_error(capsys, ["--model", "gpt3-175b", "--qps", "1", "--kv-share", "0"])
    assert "expected --qps or --trace" in _cli_error(capsys, ["--model", "gpt3-175b"])
    trace = tmp_path / "bad.jsonl"
    lines = MOONCAKE.read_text().splitlines()[:3]
    trace.write_text(lines[0] + "\n" + '{"timestamp": 5, "input_length": -1, "hash_ids": []}\n' + lines[2] + "\n")
    err = _cli_error(capsys, ["--model", "gpt3-175b", "--trace", str(trace), "--strict"])
    assert f"{trace}:2: input_length" in err
    # without --strict the bad line is skipped and named, the rest is planned
    assert main(["plan", "--model", "gpt3-175b", "--trace", str(trace), "--json"]) == 0
    captured = capsys.readouterr()
    assert f"{trace}:2" in captured.err
    out = json.loads(captured.out)
    assert out["workload"]["requests"] == 2 and out["skipped_lines"]["count"] == 1


# ---------------------------------------------------------------- a large trace


def test_plan_on_12k_request_trace(tmp_path):
    """The Mooncake trace three times over (11,979 requests, later copies shifted in time); its
    speed goal (< 1 s of CPU) is measured in benchmarks/bench_plan.py, not here: a timed test
    on a shared machine fails on the load, not on the code."""
    lines = MOONCAKE.read_text().splitlines()
    trace = tmp_path / "mooncake_x3.jsonl"
    repeat_mooncake(MOONCAKE, trace, copies=3)
    work = load_mooncake(trace, 16)
    plan = make_plan(work, BUILTIN_MODELS["llama3-70b"], PlanSettings(dtype="bf16"))
    assert work.requests == 3 * len(lines) >= 11_979
    assert len(plan.rows) == 2  # as is, and sharing from the trace's keys


def test_workload_is_sorted_by_arrival(tmp_path):
    lines = MOONCAKE.read_text().splitlines()[:5]
    trace = tmp_path / "shuffled.jsonl"
    trace.write_text("\n".join(reversed(lines)) + "\n")
    work = load_mooncake(trace, 512)
    assert (np.diff(work.arrival_s) >= 0).all() and work.arrival_s[0] == 0
    firsts = [json.loads(x)["hash_ids"][0] for x in lines]
    # the keys moved with their requests: requests with equal first ids share a first key
    order = sorted(range(5), key=lambda i: (json.loads(lines[i])["timestamp"], -i))
    dense = work.prompt_keys.key_ids[work.prompt_keys.offsets[:-1]]
    for a in range(5):
        for b in range(5):
            assert (dense[a] == dense[b]) == (firsts[order[a]] == firsts[order[b]])


def test_workload_from_plain_arrays_needs_no_trace():
    w = Workload(np.array([0.0, 1.0]), np.array([16, 16]), np.array([1, 1]), "two")
    plan = make_plan(w, BUILTIN_MODELS["smollm2-135m"],
                     PlanSettings(dtype="fp32", block_size_tokens=16, decode_s_per_token=2.0))
    # each holds 1 block for 2 s; they overlap during [1, 2)
    assert plan.rows[0].peak_blocks == 2
    assert plan.rows[0].peak_kv_bytes == 2 * 16 * 46080


def test_cli_pool_what_if_on_demo(capsys):
    """The demo pool's own measured peak (149 blocks) is exactly enough for its demand with
    sharing; one block less overflows."""
    for pool, headroom in ((149, 0), (148, 1)):
        assert main(["plan", "--trace", str(DEMO_LOG), "--pool-blocks", str(pool), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)["pool"]
        assert got["demand"] == "with exact prefix sharing"
        assert got["headroom_blocks"] == headroom
        assert (got["requests_affected"] > 0) == (headroom > 0)
        assert got["pool_bytes"] == pool * 32 * 46080


def _first_seen_labels(ids) -> list[int]:
    """Each id replaced by the index of its first occurrence: equal labels = equal keys."""
    first: dict = {}
    return [first.setdefault(i, len(first)) for i in ids]


def test_plan_and_replay_key_a_token_trace_with_extra_keys_identically(tmp_path):
    """`plan` (workload.load_tokens) and `replay` (traces.load_tokens) read one token-id trace
    through one reader: the same blocks get equal keys in both, and exactly the blocks whose
    (extra_keys, token prefix) is equal, counted by brute force."""
    from kvdiag.traces import request_traces as traces
    from kvdiag.traces import workload

    block = 4
    shared = list(range(1, 13))  # three full blocks
    rows = [(shared, ["lora-a"]), (shared, ["lora-b"]), (shared, ["lora-a"]), (shared, None),
            (shared[:8] + [99, 98, 97, 96, 5], None), (shared, ["lora-b"])]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": float(i), "token_ids": t, "output_tokens": 3,
                                        **({"extra_keys": e} if e is not None else {})}) + "\n"
                            for i, (t, e) in enumerate(rows)))

    def brute(use_extra: bool) -> list:
        return [(json.dumps(e) if use_extra else None, tuple(t[:(j + 1) * block]))
                for t, e in rows for j in range(len(t) // block)]

    want = _first_seen_labels(brute(True))
    repeats = len(want) - len(set(want))
    assert repeats == 8  # rows 2 and 5 repeat 0 and 1 (3 blocks each), row 4 two of row 3
    assert repeats != len(brute(False)) - len(set(brute(False)))  # extra_keys matter here

    planned = workload.load_tokens(path, block)
    replayed = traces.load_tokens(path, block)
    assert list(planned.prompt_keys.offsets) == list(replayed.offsets)
    assert _first_seen_labels(planned.prompt_keys.key_ids.tolist()) == want
    assert _first_seen_labels(replayed.block_ids.tolist()) == want
