"""CPU cost of the Prometheus exporter on the observed process (goal: <= 0.5% of its CPU at a
15 s scrape interval).

Replays the recorded demo log's events (tests/data/demo_small, repeated with shifted times and
renamed requests) at a fixed rate into (A) a LogWriter only, or (B) the LogWriter and a
PrometheusSink served on 127.0.0.1, scraped by a separate process (a Prometheus stand-in whose
own CPU is not the observed process's). Both go through a FanoutSink, as kvdiag.run does.

Rate: ``--rate-multiple`` x the demo log's events/s ("real" rate). Time is compressed by
``--speedup`` S: events are sent S x faster and /metrics is scraped every 15/S s, so scrapes per
event equal a 15 s interval at the real rate. (Not scaled: the exporter's 1 s fold timer and the
writer's flush timer tick S x less often per event; both are cheap when their queue is empty.)

Per trial: the process's CPU time (time.process_time: all its threads) from the first event
until everything is flushed, per event. A and B trials are interleaved (alternating order).
Reported: CPU per event of A and B; B/A with a paired bootstrap 95% interval; the exporter's
cost as a share of the observed process's CPU, (B - A) per event x real rate / one core (the
engine process keeps at least one core busy: the demo runs one torch thread), with its
interval; the verdict against 0.5%: met (upper bound below), missed (lower bound above), or
undecided. Writes only into a temporary folder.

Usage: python benchmarks/bench_exporter_overhead.py [--trials 12] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from kvdiag.eventlog import LogWriter, iter_events, read_header
from kvdiag.exporter import serve
from kvdiag.sinks import FanoutSink

ROOT = Path(__file__).resolve().parent.parent
DEMO_LOG = ROOT / "tests/data/demo_small/demo_24req_seed1.kvlog.gz"
SCRAPE_INTERVAL_S = 15.0
GOAL = 0.005

SCRAPER = """
import sys, time, urllib.request
port, start, interval, n = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
for k in range(n):
    time.sleep(max(0.0, start + (k + 0.5) * interval - time.time()))
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
"""


def demo_rate(events) -> float:
    ts = [e.ts_ns for e in events]
    return len(events) / ((max(ts) - min(ts)) / 1e9)


def stream(events, n: int) -> list:
    """``n`` events: the log repeated, each copy shifted past the previous, requests renamed."""
    ts = [e.ts_ns for e in events]
    span = max(ts) - min(ts) + 1
    out, rep = [], 0
    while len(out) < n:
        for ev in events:
            changes = {"ts_ns": ev.ts_ns + rep * span}
            if getattr(ev, "request_id", None):
                changes["request_id"] = f"{ev.request_id}#{rep}"
            out.append(msgspec.structs.replace(ev, **changes))
            if len(out) == n:
                break
        rep += 1
    return out


def trial(with_exporter: bool, events: list, header, rate: float, seconds: float,
          speedup: float, folder: Path, index: int) -> float:
    """CPU seconds per event of one paced replay."""
    writer = LogWriter(folder / f"{'b' if with_exporter else 'a'}{index}.kvlog", header)
    sinks, exporter, scraper = [writer], None, None
    interval = SCRAPE_INTERVAL_S / speedup
    start = time.time() + 0.3
    if with_exporter:
        exporter = serve(0, header)
        sinks.append(exporter.sink)
        scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, str(exporter.port), str(start),
                                    str(interval), str(round(seconds / interval))])
    sink = FanoutSink(sinks)
    time.sleep(max(0.0, start - time.time()))
    t0 = time.perf_counter()
    c0 = time.process_time()
    for i, ev in enumerate(events):
        if i % 32 == 0:  # pace: event i is due at t0 + i / rate
            time.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        sink.record(ev)
    if scraper is not None:
        assert scraper.wait(timeout=60) == 0
    sink.flush()
    cpu = time.process_time() - c0
    writer.close()
    if exporter is not None:
        exporter.close()
    return cpu / len(events)


def bootstrap(a: list[float], b: list[float], stat, n: int = 10000) -> tuple[float, float]:
    rng = random.Random(0)
    pairs = list(zip(a, b))
    values = sorted(stat(*zip(*(rng.choice(pairs) for _ in pairs))) for _ in range(n))
    return values[int(0.025 * n)], values[int(0.975 * n) - 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=12, help="trials of each of A and B")
    parser.add_argument("--seconds", type=float, default=3.0, help="wall seconds per trial")
    parser.add_argument("--rate-multiple", type=float, default=100.0,
                        help="real event rate as a multiple of the demo log's")
    parser.add_argument("--speedup", type=float, default=20.0, help="time compression")
    args = parser.parse_args()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

    header = read_header(DEMO_LOG)
    log = list(iter_events(DEMO_LOG))
    demo = demo_rate(log)
    real_rate = demo * args.rate_multiple
    rate = real_rate * args.speedup
    events = stream(log, int(rate * args.seconds))
    scrapes = round(args.seconds / (SCRAPE_INTERVAL_S / args.speedup))
    print(f"demo log: {len(log)} events, {demo:.2f} events/s; real rate {args.rate_multiple:g}x = "
          f"{real_rate:.0f} events/s; sent at {rate:.0f} events/s (speedup {args.speedup:g}), "
          f"/metrics every {SCRAPE_INTERVAL_S / args.speedup:.3f} s = one scrape per "
          f"{SCRAPE_INTERVAL_S * real_rate:.0f} events, as 15 s at the real rate")
    print(f"{len(events)} events and {scrapes} scrapes per B trial; {args.trials} trials of A and "
          f"of B, interleaved; {os.cpu_count()} CPUs, load average before "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    a, b = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.trials):
            order = (False, True) if i % 2 == 0 else (True, False)
            for with_exporter in order:
                cost = trial(with_exporter, events, header, rate, args.seconds, args.speedup,
                             Path(tmp), i)
                (b if with_exporter else a).append(cost)
    mean = statistics.fmean

    def share(xa, xb):
        return (mean(xb) - mean(xa)) * real_rate

    ratio = mean(b) / mean(a)
    r_lo, r_hi = bootstrap(a, b, lambda xa, xb: mean(xb) / mean(xa))
    s_lo, s_hi = bootstrap(a, b, share)
    print(f"A LogWriter:                 {mean(a) * 1e6:8.2f} us CPU/event "
          f"(median {statistics.median(a) * 1e6:.2f}, trials {min(a) * 1e6:.2f}..{max(a) * 1e6:.2f})")
    print(f"B LogWriter + PrometheusSink:{mean(b) * 1e6:8.2f} us CPU/event "
          f"(median {statistics.median(b) * 1e6:.2f}, trials {min(b) * 1e6:.2f}..{max(b) * 1e6:.2f})")
    print(f"B/A: {ratio:.3f} (95% bootstrap {r_lo:.3f}..{r_hi:.3f})")
    print(f"exporter CPU at {real_rate:.0f} events/s, 15 s scrapes: {share(a, b) * 100:.4f}% of one "
          f"core (95% {s_lo * 100:.4f}%..{s_hi * 100:.4f}%)")
    verdict = "met" if s_hi <= GOAL else "missed" if s_lo > GOAL else "undecided"
    print(f"goal <= {GOAL * 100:g}% of the observed process's CPU (one core): {verdict}")
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
