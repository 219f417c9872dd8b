"""`kvdiag demo` end to end: the real server under the agent, real traffic, a consistent log.

The log's events are checked against independent computations: the engine's own prefix
matcher (transformers' ``compute_block_hash`` on each prompt's token ids, over the ledger
replayed from the log), block counts from token counts, and the engine's ledger as the agent
read it when it stopped (the last pool sample).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from demo_invariants import expected_blocks, replay, timestamps_problems
from kvdiag.events.eventlog import read_log

NUM_REQUESTS = int(os.environ.get("KVDIAG_TEST_DEMO_REQUESTS", "10"))
MAX_TOKENS = 12


# no --port: the demo picks a free one, so several checkouts can run this test at once
@pytest.fixture(scope="module")
def demo_run(model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("demo") / "demo.kvlog"
    cmd = [sys.executable, "-m", "kvdiag", "demo", "--requests", str(NUM_REQUESTS), "--seed", "1",
           "--rate", "2", "--max-tokens", str(MAX_TOKENS), "--log", str(log_path),
           "--ask", "What is the capital of France?",
           "--record-tokens"]  # the consistency check recomputes the engine's keys from token ids
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    return proc, log_path


@pytest.mark.model
@pytest.mark.slow
def test_demo_ends_by_itself_and_answers_with_real_text(demo_run):
    proc, log_path = demo_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    answer = next(line for line in proc.stdout.splitlines() if line.startswith("A: "))
    assert "Paris" in answer
    assert f"event log: {log_path}" in proc.stdout
    assert "prefix hit" in proc.stdout
    # where to find the run, printed at start
    assert re.search(r"^kvdiag demo: server PID \d+ \(launcher PID \d+", proc.stdout, re.M)
    assert f"kvdiag demo: event log {log_path}\n" in proc.stdout
    assert f"kvdiag demo: server output {log_path}.server.txt\n" in proc.stdout
    # --record-tokens: one warning line at start, and the header says so
    assert proc.stderr.count("kvdiag: recording prompts' token ids") == 1, proc.stderr[-2000:]
    assert read_log(log_path, strict=True).header.content == "token_ids"


@pytest.mark.model
@pytest.mark.slow
def test_demo_log_is_consistent_with_the_engine(demo_run):
    _, log_path = demo_run
    log = read_log(log_path, strict=True)
    assert not log.problems
    assert log.header.engine == "transformers-cb" and log.header.bytes_per_token == 46080
    r = replay(log_path)
    assert not r.problems, r.problems[:5]
    assert len(r.finished) == NUM_REQUESTS + 1  # the traffic and the --ask question
    assert all(f.status == "finished" for f in r.finished.values())
    # a production-like mix: long prompts, shared prefixes, several turns
    prompts = log.frame("request_arrived")["prompt_tokens"]
    assert (prompts > 512).any() and (prompts < 512).any()
    assert sum(f.cached_prompt_tokens > 0 for f in r.finished.values()) >= NUM_REQUESTS // 3
    from kvdiag.agent.transformers_serve import serves_in_a_child
    if serves_in_a_child(["transformers", "serve"]):
        # the model's own process numbers requests itself: the HTTP X-Request-ID stays upstream
        assert sorted(r.finished, key=int) == [str(i) for i in range(NUM_REQUESTS + 1)]
    else:
        assert any(rid.endswith("/t1") for rid in r.finished)  # the driver's conversation/turn ids
    for rid, fin in r.finished.items():
        # every block the request held is released (cached or not) when it finishes
        assert r.held_at_finish[rid] == [], rid
        # blocks per request = ceil(tokens written to the cache / page size)
        assert r.blocks_at_finish[rid] == expected_blocks(fin.prompt_tokens, fin.output_tokens, r.page_size), rid
        # prefix-hit tokens = what the engine's own matcher finds on the replayed ledger
        assert fin.cached_prompt_tokens == r.prefix_hit_tokens.get(rid, 0) == r.expected_cached_tokens[rid], rid
    # the engine's ledger as the agent read it at shutdown agrees with the replay
    assert r.last_sample is not None
    assert r.last_sample.blocks_used == 0
    assert r.last_sample.blocks_cached == len(r.cached_blocks_at_end)
    assert r.last_sample.blocks_free + r.last_sample.blocks_cached == r.last_sample.num_blocks
    assert timestamps_problems(log_path) == []
    # token occupancy <= 1: a shared prefix block holds its tokens once
    pool = log.frame("kv_pool_sample")
    assert (pool["tokens_held"] <= pool["blocks_used"] * r.page_size).all()
    assert (pool["tokens_held"] > 0).any()


def test_demo_log_carries_live_shadow_sharing(demo_run):
    _, log_path = demo_run
    log = read_log(log_path, strict=True)
    shadow = log.frame("shadow_sharing")
    info = log.frame("kv_pool_info").iloc[0]
    final = shadow[shadow["ts_ns"] == shadow["ts_ns"].max()]
    configs = set(zip(final["block_size_tokens"], final["capacity_blocks"].fillna(-1)))
    assert {(16, -1), (64, -1), (256, -1), (info["block_size_tokens"], info["num_blocks"])} <= configs
    finished = log.frame("request_finished")
    engine_rate = finished["cached_prompt_tokens"].sum() / finished["prompt_tokens"].sum()
    assert final["engine_hit_rate"].tolist() == pytest.approx([engine_rate] * len(final))
    assert (final["requests"] == len(finished)).all()
    # larger chunks can only match fewer prompt tokens (a chunk hits only when all of it does)
    by_size = final[final["capacity_blocks"].isna()].set_index("block_size_tokens")["token_hit_rate"]
    assert by_size[16] >= by_size[64] >= by_size[256]


@pytest.mark.model
@pytest.mark.slow
def test_demo_log_has_host_memory_and_the_leak_rule_evaluates(demo_run):
    """The agent samples its own process: the first leak check is not N/A on the demo, and a
    healthy demo (no injected leak) is not flagged as leaking host memory."""
    from kvdiag.diagnosis import leak_rules
    from kvdiag.diagnosis.frames import load

    _, log_path = demo_run
    logs = load([log_path])[0]
    ps = logs.frame("process_sample")
    assert len(ps) >= 4 and (ps["rss_bytes"] > 0).all()
    assert ps["pss_bytes"].notna().any()
    f = leak_rules.memory_growth(logs)
    assert f.status != "n/a", f.message
    assert f.evidence["source"] == "host RSS"
    assert f.status != "fail", f.message


@pytest.mark.model
@pytest.mark.slow
def test_fresh_demo_log_gets_the_same_verdicts_live_and_offline(demo_run):
    """A log just recorded by the real demo, replayed through top's live path, ends with the
    doctor's findings on the file (ids, statuses, messages, evidence)."""
    from test_rules_live_offline import _same, live_findings, offline_findings

    _, log_path = demo_run
    live = live_findings(log_path)
    _same(live, offline_findings(log_path))
    assert live["leak.release_paths"].status == "pass" and live["sharing.consistency"].status != "n/a"


DURATION_S = 40
"""Long enough for four in-process `doctor --pid --seconds 2` runs (each records 2 s, then runs
every rule: several seconds each on a loaded 2-core machine) while the demo still serves."""


@pytest.mark.model
@pytest.mark.slow
def test_every_pid_of_a_running_demo_reaches_its_agent_and_duration_is_wall_time(model_dir, tmp_path, capsys):
    """`kvdiag doctor --pid` with the launcher's, the server's and each of its children's PIDs
    (the engine process among them) reaches the demo's agent; the Prometheus URL the demo
    printed answers; --duration is wall time: sending stops after it, the drain is said and
    bounded."""
    import psutil

    from kvdiag.cli import main
    from kvdiag.commands._demo_session import DRAIN_S
    from kvdiag.commands.demo import DEFAULT_MAX_IN_FLIGHT

    log_path = tmp_path / "demo.kvlog"
    demo = subprocess.Popen([sys.executable, "-m", "kvdiag", "demo", "--duration", str(DURATION_S), "--rate", "2",
                             "--max-tokens", "8", "--log", str(log_path), "--prometheus", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in demo.stdout:  # until the traffic starts: the server is ready, its agent up
            lines.append(line)
            if line.startswith("kvdiag demo: arrivals"):
                sending_at = time.monotonic()
                break
        out = "".join(lines)
        assert demo.poll() is None, out
        server, launcher = map(int, re.search(r"server PID (\d+) \(launcher PID (\d+)", out).groups())
        assert launcher == demo.pid
        url = re.search(r"Prometheus metrics at (\S+)", out).group(1)
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200 and b"kvdiag_" in resp.read()
        children = [c.pid for c in psutil.Process(server).children(recursive=True)]
        assert children  # transformers serve runs its model in a process of its own
        for pid in [launcher, server, *children]:
            # reached: the agent's stream was recorded and judged (0 or 1 are verdicts; 2 and 4
            # would say no agent was reached); a 2-second window is no window for the verdicts
            assert main(["doctor", "--pid", str(pid), "--seconds", "2", "--json"]) in (0, 1), pid
            assert json.loads(capsys.readouterr().out)["findings"], pid
        rest, _ = demo.communicate(timeout=DURATION_S + DRAIN_S + 120)
        ended_at = time.monotonic()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, out + rest
    draining = re.search(r"^kvdiag demo: draining (\d+) requests? in flight", rest, re.M)
    assert draining and 1 <= int(draining.group(1)) <= DEFAULT_MAX_IN_FLIGHT, rest
    # sending stopped after DURATION_S of wall time; the drain and the stop are bounded
    assert DURATION_S <= ended_at - sending_at < DURATION_S + DRAIN_S + 60, rest
