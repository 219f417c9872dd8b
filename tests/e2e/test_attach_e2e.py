"""End to end: the real demo server (SmolLM2 on transformers' continuous-batching engine with
the kvdiag agent, fault injection skipping every 2nd finished request's release) runs as a
separate process under chat traffic; ``kvdiag attach PID`` joins it for at least 20 s, until
the traffic has finished. Checked against the demo's own event log for the same period: the
streamed events are the demo's, the summary's KV numbers equal counts over the demo log, and
the leak finding names exactly the requests the fault injection leaked (every 2nd finished
request, in finishing order)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from kvdiag.events.eventlog import iter_events, read_header

pytestmark = [pytest.mark.model, pytest.mark.slow]

PORT = 18450
LEAK_EVERY = 2
ATTACH_S = 20
GRACE_S = 1.0
ATTACH_TAGS = {"process_sample", "nvml_sample", "phase_profile", "engine_metrics", "collector_status",
               "memory_bandwidth_probe", "host_energy_sample"}  # the agent records these too
SYSTEM = ("You are the support assistant of the Northwind online store. Answer in one short sentence, "
          "politely, and mention the order number when the customer gives one.")
QUESTIONS = ["Where is my order NW1001?", "Can I return shoes from order NW2044?",
             "My parcel NW3300 arrived damaged, what now?", "How long does shipping to Lyon take?",
             "Do you ship order NW5123 on weekends?", "Can I change the address of order NW6001?"]


def tag(ev) -> str:
    return ev.__struct_config__.tag


def _sampled_past_grace(out) -> bool:
    """Attach's log has a process sample later than every finish plus the grace period."""
    try:
        events = list(iter_events(out))
    except Exception:  # a line being written: read again on the next poll
        return False
    finishes = [e.ts_ns for e in events if tag(e) == "request_finished"]
    samples = [e.ts_ns for e in events if tag(e) == "process_sample"]
    return bool(finishes and samples) and max(samples) > max(finishes) + GRACE_S * 1e9


@pytest.fixture(scope="module")
def attached(tmp_path_factory, model_dir):
    from kvdiag.commands.demo import DEFAULT_MAX_BATCH_TOKENS, DemoServer
    from kvdiag.demo.traffic import chat
    tmp = tmp_path_factory.mktemp("attach")
    server = DemoServer(model_dir, tmp / "demo.jsonl", PORT, page_size=32, num_blocks=256,
                        max_batch_tokens=DEFAULT_MAX_BATCH_TOKENS, inject_leak=LEAK_EVERY, threads=1)

    def ask(i: int) -> None:
        chat(server.base_url, str(model_dir), [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
             max_tokens=8, request_id=f"q{i}", timeout_s=120)

    server.start()
    try:
        server.wait_ready()
        ask(0)  # warm-up, before attaching
        out = tmp / "attach.jsonl"
        attach = subprocess.Popen([sys.executable, "-m", "kvdiag", "attach", str(server.proc.pid), "--duration",
                                   "600", "--out", str(out), "--json", "--grace", str(GRACE_S),
                                   "--pyspy-window", "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        started_s = time.monotonic()
        deadline = time.monotonic() + 60  # attach imports, finds the agent and connects: its
        while not (out.exists() and '"collector":"agent","available":true' in out.read_text()):  # log says so
            assert attach.poll() is None and time.monotonic() < deadline, attach.stderr.read()
            time.sleep(0.1)
        clients = [threading.Thread(target=ask, args=(i,)) for i in range(1, len(QUESTIONS) + 1)]
        for c in clients:
            c.start()
            time.sleep(0.3)
        for c in clients:
            c.join(timeout=120)
        # attach stays at least ATTACH_S, and until it has sampled the process past the last
        # finish's grace period (the traffic's end, not a fixed window a loaded machine outlasts);
        # then SIGTERM ends it as a supervisor would
        deadline = time.monotonic() + 120
        while not (time.monotonic() - started_s >= ATTACH_S and _sampled_past_grace(out)):
            assert attach.poll() is None and time.monotonic() < deadline, attach.stderr.read()
            time.sleep(0.2)
        attach.terminate()
        stdout, stderr = attach.communicate(timeout=120)
    finally:
        server.stop()
    return {"rc": attach.returncode, "stdout": stdout, "stderr": stderr, "out": out,
            "demo": tmp / "demo.jsonl", "pid": server.proc.pid}


def test_attach_records_process_pyspy_and_agent_events(attached):
    assert attached["rc"] == 0, attached["stderr"]
    summary = json.loads(attached["stdout"])
    status = {c["collector"]: c["available"] for c in summary["collectors"]}
    assert status["agent"] and status["py-spy"] and not status["nvml"], summary["collectors"]
    events = list(iter_events(attached["out"]))
    procs = [e for e in events if tag(e) == "process_sample"]
    assert attached["pid"] in {e.pid for e in procs} and len(procs) >= ATTACH_S // 2
    phases = [e for e in events if tag(e) == "phase_profile"]
    assert sum(p.num_samples for p in phases) > 100
    busy = sum(p.num_samples * (1 - p.shares.get("idle", 0)) for p in phases)
    assert busy > 0
    assert sum(1 for e in events if tag(e) == "block_allocated") > 0


def test_streamed_events_are_the_demo_log_of_the_same_period(attached):
    enc = msgspec.json.Encoder()
    streamed = [e for e in iter_events(attached["out"]) if tag(e) not in ATTACH_TAGS]
    demo = list(iter_events(attached["demo"]))
    # the agent first tells a client what it set up before it connected (the pool's shape, its
    # collectors' status): those are events of the demo's log from before the period
    setup = 0
    while setup < len(streamed) and tag(streamed[setup]) in ("kv_pool_info", "collector_status"):
        setup += 1
    told, streamed = streamed[:setup], streamed[setup:]
    assert streamed
    assert {enc.encode(e) for e in told} <= {enc.encode(e) for e in demo}
    lo, hi = min(e.ts_ns for e in streamed), max(e.ts_ns for e in streamed)
    # what attach records itself (process samples among them) is left out on both sides: the
    # agent samples its own process too, with the same event type
    demo_window = [e for e in demo if lo <= e.ts_ns <= hi and tag(e) not in ATTACH_TAGS]
    assert sorted(map(enc.encode, streamed)) == sorted(map(enc.encode, demo_window))

    # the summary's KV numbers, recomputed from the demo's own log over that window
    kv = json.loads(attached["stdout"])["kv"]
    count = lambda t: sum(1 for e in demo_window if tag(e) == t)  # noqa: E731
    assert kv["blocks_allocated"] == count("block_allocated")
    assert kv["blocks_released"] == count("block_released")
    assert kv["prefix_hits"] == count("prefix_hit")
    assert kv["requests_finished"] == count("request_finished")
    finished = [e for e in demo_window if tag(e) == "request_finished"]
    assert kv["prompt_tokens"] == sum(e.prompt_tokens for e in finished)
    assert kv["cached_prompt_tokens"] == sum(e.cached_prompt_tokens for e in finished)
    last_pool = max((e for e in demo_window if tag(e) == "kv_pool_sample"), key=lambda e: e.ts_ns)
    assert (kv["blocks_used"], kv["blocks_cached"], kv["num_blocks"], kv["tokens_held"]) == \
        (last_pool.blocks_used, last_pool.blocks_cached, last_pool.num_blocks, last_pool.tokens_held)
    assert kv["block_size_tokens"] == read_header(attached["demo"]).block_size_tokens == 32


def test_injected_leak_is_named(attached):
    demo = list(iter_events(attached["demo"]))  # file order = the order the engine finished them
    finished_order = [e.request_id for e in demo if tag(e) == "request_finished"]
    leaked = set(finished_order[LEAK_EVERY - 1::LEAK_EVERY])
    everything = list(iter_events(attached["out"]))
    end = max(e.ts_ns for e in everything)  # the window ends with attach's last sample
    streamed = [e for e in everything if tag(e) not in ATTACH_TAGS]
    arrived = {e.request_id for e in streamed if tag(e) == "request_arrived"}
    finished_at = {e.request_id: e.ts_ns for e in streamed if tag(e) == "request_finished"}
    held: dict[str, set] = {}
    for e in streamed:
        if tag(e) in ("block_allocated", "prefix_hit"):
            held.setdefault(e.request_id, set()).add(e.block_id)
        elif tag(e) == "block_released":
            held.get(e.request_id, set()).discard(e.block_id)
    expect = {r: sorted(held[r]) for r in leaked
              if r in arrived and r in finished_at and finished_at[r] <= end - GRACE_S * 1e9 and held.get(r)}
    assert len(expect) >= 2, "the traffic should leak several requests inside the window"
    finding = next(f for f in json.loads(attached["stdout"])["findings"] if f["rule"] == "leak.finished_holding")
    assert finding["status"] == "fail"
    assert finding["evidence"]["requests"] == expect
