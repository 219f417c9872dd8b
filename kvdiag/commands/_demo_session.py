"""What `kvdiag demo` does around its server on either engine: say where the run is recorded, ask
the first question, drive the traffic with the live line, stop the server (quickly once the
requests in flight are cut), and summarise."""

from __future__ import annotations

import http.client
import os
import signal
import sys
import threading
import time
from pathlib import Path

from kvdiag.commands._demo_live import LiveStats, live_line
from kvdiag.commands._demo_prometheus import prometheus_url
from kvdiag.demo.traffic import Result, TrafficDriver, TrafficPlan, chat

DRAIN_S = 60.0
"""Longest wait for the requests in flight once no more are sent (--duration over, Ctrl-C)."""
CANCEL_WAIT_S = 5.0
"""Longest wait, after cutting the requests in flight, for the engine to record them aborted."""
QUICK_STOP = ((signal.SIGTERM, 10.0), (signal.SIGINT, 10.0), (signal.SIGKILL, 10.0))
"""How a demo stops its server once it has cut the requests in flight (Ctrl-C, `kvdiag top`
quitting, a drain that ran out): the server cancels a request whose client left, so uvicorn's
graceful shutdown has nothing to wait for (a forced exit would answer them HTTP 500)."""


class Traffic:
    """The demo's traffic driver and its counters (shared by the live line and the summary)."""

    def __init__(self, base_url: str, model_dir: Path, plan: TrafficPlan, args) -> None:
        self.counters = {"done": 0, "failed": 0, "cut": 0, "tokens": 0}
        self.driver = TrafficDriver(base_url, str(model_dir), plan, max_tokens=args.max_tokens,
                                    on_result=self._on_result, max_in_flight=args.max_in_flight or None)

    def _on_result(self, result: Result) -> None:
        self.counters["done"] += 1
        self.counters["tokens"] += result.completion_tokens
        if result.cut:
            self.counters["cut"] += 1
        elif not result.ok:
            self.counters["failed"] += 1


def arrivals_line(args) -> str:
    if not args.max_in_flight:
        return (f"kvdiag demo: arrivals Poisson {args.rate:g} req/s, no cap on requests in flight "
                "(the queue grows if this machine serves fewer)")
    return (f"kvdiag demo: arrivals Poisson {args.rate:g} req/s, at most {args.max_in_flight} requests in "
            "flight: the arrival rate is capped at what this machine serves, so queue wait stays bounded "
            "(--max-in-flight 0 lifts the cap)")


def cap_note(driver: TrafficDriver, args) -> str:
    """"arrival rate capped at X req/s: this machine serves Y req/s" once the cap delayed an
    arrival ("" before)."""
    if not driver.capped:
        return ""
    released, served = driver.rates_per_s()
    return (f"arrival rate capped at {released:.2f} req/s (asked {args.rate:g}): this machine serves "
            f"{served:.2f} req/s with {args.max_in_flight} in flight")


def drive(traffic: Traffic, args, stats: LiveStats):
    """Send the planned chats, printing the live line; returns (counters, seconds). With
    --duration, sending stops after that wall time and the requests in flight are drained
    (``draining N`` is printed; at most :data:`DRAIN_S`)."""
    tty = sys.stdout.isatty()
    counters, driver = traffic.counters, traffic.driver
    start = time.monotonic()
    print(arrivals_line(args), flush=True)

    def on_drain(n: int) -> None:
        print(("\n" if tty else "") + f"kvdiag demo: draining {n} request{'s' if n != 1 else ''} in flight "
              f"(at most {DRAIN_S:g} s)", flush=True)

    worker = threading.Thread(target=driver.run, kwargs={"num_requests": args.requests, "duration_s": args.duration,
                                                         "drain_s": DRAIN_S, "on_drain": on_drain}, daemon=True)
    worker.start()
    last_print = 0.0
    while worker.is_alive():
        worker.join(timeout=0.5)
        now = time.monotonic()
        if tty or now - last_print >= 5.0 or not worker.is_alive():
            line = live_line(counters["done"], args.requests, counters["tokens"], now - start, stats)
            note = cap_note(driver, args)
            line += f" | {note}" if note else ""
            print(("\r" + line + "  ") if tty else line, end="" if tty else "\n", flush=True)
            last_print = now
    if tty:
        print()
    return counters, time.monotonic() - start


def stop_after_traffic(traffic: Traffic, server, stats: LiveStats) -> int:
    """Stop the server once the traffic is over; requests the drain gave up on are cut first."""
    if traffic.driver.abandoned:
        traffic.driver.abort()
        stats.wait_idle(CANCEL_WAIT_S)
        return server.stop(QUICK_STOP)
    return server.stop()


def interrupted(traffic: Traffic, server, stats: LiveStats) -> None:
    """Ctrl-C (or `kvdiag top` quitting): no more requests, then the server stops quickly
    (:data:`QUICK_STOP`); what the traffic got is said in one line."""
    c = traffic.counters
    cut = traffic.driver.abort()
    print(f"\nkvdiag demo: interrupted; no more requests, {cut} in flight cut, stopping the server",
          file=sys.stderr, flush=True)
    stats.wait_idle(CANCEL_WAIT_S)  # the engine records the cancelled requests as aborted
    server.stop(QUICK_STOP)
    stats.close()
    print(f"kvdiag demo: stopped: {c['done'] - c['failed'] - c['cut']} requests answered, {c['failed']} failed, "
          f"{cut} cut by the stop", file=sys.stderr, flush=True)


def summary(driver, counters: dict, elapsed: float, stats: LiveStats, server, code: int, args) -> list:
    """Print what the run did; returns the failed results."""
    results = driver.results
    failed = [r for r in results if not r.ok and not r.cut]
    long_count = sum(r.is_long for r in results)
    answered = [r for r in results if r.ok]
    print(f"done: {len(answered)} requests answered ({long_count} long prompts), "
          f"{len(failed)} failed, {counters['tokens']} tokens in {elapsed:.1f} s "
          f"({counters['tokens'] / elapsed:.1f} tok/s)")
    if driver.abandoned:
        print(f"kvdiag demo: {driver.abandoned} requests still unanswered after draining {DRAIN_S:g} s: "
              "cut when the server stopped, not counted")
    note = cap_note(driver, args)
    if note:
        print(note)
    if stats.prefix_hit_rate is not None:
        print(f"prefix cache: {stats.cached_prompt_tokens}/{stats.prompt_tokens} prompt tokens served from "
              f"cache ({stats.prefix_hit_rate:.0%}); peak KV blocks used {stats.peak_blocks_used}/{stats.num_blocks}")
    sample = next((r for r in results if r.ok and r.answer), None)
    if sample is not None:
        print(f"sample answer ({sample.request_id}): {sample.answer.strip()[:160]!r}")
    if failed:
        print(f"first failure: {failed[0].request_id}: {failed[0].error}; server log {server.server_log}:\n"
              f"{server.tail()}", file=sys.stderr)
    if code not in (0, 128 + signal.SIGTERM):
        print(f"kvdiag demo: the server exited with code {code}; see {server.server_log}", file=sys.stderr)
    return failed


def ask(server, model_dir: Path, args) -> bool:
    """``--ask``: one question first, its answer printed; False (said) when the server fails."""
    try:
        answer = chat(server.base_url, str(model_dir), [{"role": "user", "content": args.ask}],
                      args.max_tokens, "ask/t0")
    except (OSError, http.client.HTTPException) as exc:
        print(f"kvdiag demo: the server failed to answer ({exc}); server log {server.server_log}:\n"
              f"{server.tail()}", file=sys.stderr)
        return False
    print(f"Q: {args.ask}\nA: {answer['choices'][0]['message']['content']}", flush=True)
    return True



def print_started(server, log_path: Path, args) -> None:
    """Where to find the run: the server's PID (what `doctor --pid`, `top --pid` and `attach`
    take, as they take this launcher's), the event log, the server's output, the metrics URL;
    the warning when the log records token ids."""
    if args.record_tokens:
        from kvdiag.agent import warn_recording_tokens
        warn_recording_tokens()
    print(f"kvdiag demo: server PID {server.proc.pid} (launcher PID {os.getpid()}: `kvdiag doctor --pid`, "
          f"`kvdiag top --pid` and `kvdiag attach` take either)", flush=True)
    print(f"kvdiag demo: event log {log_path}", flush=True)
    print(f"kvdiag demo: server output {server.server_log}", flush=True)
    if args.prometheus is not None:
        print(f"kvdiag demo: Prometheus metrics at {prometheus_url(args.prometheus)}", flush=True)
