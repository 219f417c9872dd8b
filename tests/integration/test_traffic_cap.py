"""The demo's traffic driver against a real HTTP server whose answers the test releases one by
one: the cap on requests in flight holds (the server never sees more), the arrival rate so
falls to what the server answers, ``--duration`` is wall time and the drain is bounded."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvdiag.demo.traffic import TrafficDriver, TrafficPlan

WAIT_S = 30.0  # the longest any condition below may take to come true (it comes at once)


class GatedServer:
    """An OpenAI-style chat endpoint that answers a request only when the test releases one."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.in_progress = self.max_in_progress = self.arrived = 0
        self.gate = threading.Semaphore(0)
        gated = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with gated.cond:
                    gated.arrived += 1
                    gated.in_progress += 1
                    gated.max_in_progress = max(gated.max_in_progress, gated.in_progress)
                    gated.cond.notify_all()
                gated.gate.acquire()
                with gated.cond:
                    gated.in_progress -= 1
                    gated.cond.notify_all()
                body = json.dumps({"choices": [{"message": {"content": "ok"}}],
                                   "usage": {"prompt_tokens": 10, "completion_tokens": 1}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def wait(self, predicate) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout=WAIT_S), (self.arrived, self.in_progress)

    def close(self) -> None:
        for _ in range(64):
            self.gate.release()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = GatedServer()
    yield s
    s.close()


def _start(driver: TrafficDriver, **kwargs) -> threading.Thread:
    t = threading.Thread(target=driver.run, kwargs=kwargs, daemon=True)
    t.start()
    return t


def test_the_cap_bounds_requests_at_the_server_and_caps_the_arrival_rate(server):
    # single-turn conversations: no follow-up waits for another answer
    plan = TrafficPlan(seed=3, rate_per_s=1e6, max_turns=1)
    driver = TrafficDriver(server.url, "m", plan, max_in_flight=2)
    run = _start(driver, num_requests=6)
    for answered in range(6):
        # the server holds as many as the cap allows (fewer only at the end of the plan)
        server.wait(lambda: server.in_progress == min(2, 6 - answered) and server.arrived == min(6, answered + 2))
        assert driver.released == server.arrived  # the driver holds the others back
        server.gate.release()
    run.join(WAIT_S)
    assert not run.is_alive()
    assert server.max_in_progress == 2 and len(driver.results) == 6 and all(r.ok for r in driver.results)
    # releases after the first two found the cap reached (all four, unless the driver's thread
    # reached one only after the slot was freed: scheduling on a loaded machine)
    assert 1 <= driver.capped <= 4
    released_rate, served_rate = driver.rates_per_s()
    # each release waited for an answer: both rates are 6 over (almost) the same window
    assert released_rate < plan.rate_per_s and served_rate <= released_rate


def test_without_a_cap_every_arrival_reaches_the_server(server):
    plan = TrafficPlan(seed=3, rate_per_s=1e6, max_turns=1)
    driver = TrafficDriver(server.url, "m", plan, max_in_flight=None)
    run = _start(driver, num_requests=6)
    server.wait(lambda: server.in_progress == 6)
    for _ in range(6):
        server.gate.release()
    run.join(WAIT_S)
    assert server.max_in_progress == 6 and driver.capped == 0 and len(driver.results) == 6


def test_duration_is_wall_time_and_the_drain_is_bounded(server):
    """Nothing is answered: sending stops at --duration, the drain gives up after drain_s and
    says how many it waited for; the run returns after about duration + drain."""
    plan = TrafficPlan(seed=3, rate_per_s=1e6, max_turns=1)
    driver = TrafficDriver(server.url, "m", plan, max_in_flight=3)
    drained = []
    started = time.monotonic()
    driver.run(duration_s=0.5, drain_s=0.5, on_drain=drained.append)
    took = time.monotonic() - started
    assert drained == [3] and driver.abandoned == 3 and driver.released == 3 and not driver.results
    # the server never answers: abandoned == 3 proves the drain gave up rather than waited for
    # answers; sending stopped at the duration, not before, and the drain took its 0.5 s
    assert driver.stopped_sending_s - driver.started_s >= 0.5
    assert took >= 1.0
    assert took < 10.0, took  # bounded (scheduling on a loaded machine adds to the 1 s, never 9 s)


def test_stop_ends_a_run_waiting_for_a_slot(server):
    plan = TrafficPlan(seed=3, rate_per_s=1e6, max_turns=1)
    driver = TrafficDriver(server.url, "m", plan, max_in_flight=1)
    run = _start(driver, num_requests=100, drain_s=0.0)
    server.wait(lambda: server.in_progress == 1)
    driver.stop()
    run.join(WAIT_S)
    assert not run.is_alive() and driver.released == 1 and driver.abandoned == 1


def test_abort_cuts_the_requests_in_flight(server):
    """What `kvdiag top` quitting does to the demo's traffic: the connections in flight are cut
    at once (the server sees its clients leave), nothing more is sent, and the cut requests are
    told apart from failures."""
    plan = TrafficPlan(seed=3, rate_per_s=1e6, max_turns=1)
    driver = TrafficDriver(server.url, "m", plan, max_in_flight=3)
    run = _start(driver, num_requests=100)
    server.wait(lambda: server.in_progress == 3)
    assert driver.abort() == 3
    run.join(WAIT_S)
    assert not run.is_alive() and driver.in_flight == 0 and server.arrived == 3
    assert len(driver.results) == 3 and all(r.cut and not r.ok for r in driver.results)


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="max in flight"):
        TrafficDriver("http://127.0.0.1:1", "m", TrafficPlan(seed=0, rate_per_s=1.0), max_in_flight=0)


@pytest.mark.parametrize("args,message", [
    (["--duration", "0"], "--duration: expected a positive number of seconds"),
    (["--max-in-flight", "-1"], "--max-in-flight: expected 0 (no cap) or a positive number"),
    (["--num-blocks", "0"], "--num-blocks: expected a positive number"),
    (["--engine", "vllm", "--page-size", "-16"], "--page-size: expected a positive number"),
    (["--engine", "vllm", "--max-batch-tokens", "0"], "--max-batch-tokens: expected a positive number"),
])
def test_demo_refuses_bad_traffic_options(args, message, capsys):
    from kvdiag.cli import main

    assert main(["demo", *args]) == 2
    assert capsys.readouterr().err == f"kvdiag demo: {message}\n"
