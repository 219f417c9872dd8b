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

``--vllm-rate R`` measures instead, in this process on one core, what the exporter costs on a
vLLM-shaped stream (benchmarks/vllm_stream.py, CONSTRUCTED DATA) at R events/s with 15 s
scrapes: CPU per event of ``record`` plus the folds (one per second of event time, as the
exporter's fold thread does) and CPU per scrape (collect + exposition, at the end of each
15 s of event time), in interleaved trials; share of one core = R x CPU per event + CPU per
scrape / 15 s (goal <= 0.5%).

Usage: python benchmarks/bench_exporter_overhead.py [--trials 12] [--seconds 3]
       python benchmarks/bench_exporter_overhead.py --vllm-rate 5000 [--trials 5]
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

from kvdiag.events.eventlog import iter_events, read_header
from kvdiag.events.log_writer import LogWriter
from kvdiag.prometheus.exporter import serve
from kvdiag.events.sinks import FanoutSink

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


def vllm_rate(rate: float, trials: int, events_per_trial: int = 300_000) -> None:
    """The exporter's share of one core at ``rate`` vLLM-shaped events/s, 15 s scrapes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vllm_stream
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from kvdiag.prometheus.exporter import PrometheusSink

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    events = list(vllm_stream.events(events_per_trial))
    fold_every = max(1, round(rate))  # one fold per second of the stream at `rate`
    scrape_every = round(rate * SCRAPE_INTERVAL_S)
    print(f"vLLM-shaped stream: {len(events):,} events per trial at {rate:g} events/s = a fold every "
          f"{fold_every:,} events, a scrape every {scrape_every:,}; {trials} trials; {os.cpu_count()} CPUs, "
          f"load before {load}")
    per_event, per_scrape = [], []
    for _ in range(trials):
        sink = PrometheusSink()
        sink._stop.set()  # folds are driven here, one per second of the stream's time
        registry = CollectorRegistry(auto_describe=False)
        registry.register(sink)
        fold_cpu = scrape_cpu = 0.0
        scrapes = 0
        for start in range(0, len(events), fold_every):
            chunk = events[start:start + fold_every]
            c = time.process_time()
            for ev in chunk:
                sink.record(ev)
            sink.flush()
            fold_cpu += time.process_time() - c
            if (start + fold_every) // scrape_every > start // scrape_every:
                c = time.process_time()
                generate_latest(registry)
                scrape_cpu += time.process_time() - c
                scrapes += 1
        per_event.append(fold_cpu / len(events))
        per_scrape.append(scrape_cpu / max(1, scrapes))
        sink.close()
    ev_s, sc_s = statistics.median(per_event), statistics.median(per_scrape)
    share = rate * ev_s + sc_s / SCRAPE_INTERVAL_S
    print(f"record + fold: {ev_s * 1e6:.2f} us CPU/event (trials {min(per_event) * 1e6:.2f}.."
          f"{max(per_event) * 1e6:.2f}); scrape: {sc_s * 1e3:.2f} ms CPU (trials {min(per_scrape) * 1e3:.2f}.."
          f"{max(per_scrape) * 1e3:.2f})")
    print(f"exporter at {rate:g} events/s, 15 s scrapes: {share * 100:.3f}% of one core "
          f"(events {rate * ev_s * 100:.3f}% + scrapes {sc_s / SCRAPE_INTERVAL_S * 100:.4f}%); "
          f"goal <= {GOAL * 100:g}%: {'met' if share <= GOAL else 'missed'} "
          f"({share / GOAL:.2f} of the budget); highest event rate within it: {(GOAL - sc_s / SCRAPE_INTERVAL_S) / ev_s:,.0f}/s")
    print(f"load after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=12, help="trials of each of A and B")
    parser.add_argument("--seconds", type=float, default=3.0, help="wall seconds per trial")
    parser.add_argument("--rate-multiple", type=float, default=100.0,
                        help="real event rate as a multiple of the demo log's")
    parser.add_argument("--speedup", type=float, default=20.0, help="time compression")
    parser.add_argument("--vllm-rate", type=float, default=0.0, metavar="R",
                        help="only the vLLM-shaped stream's cost at R events/s (see the docstring)")
    args = parser.parse_args()
    if args.vllm_rate:
        vllm_rate(args.vllm_rate, args.trials if args.trials != 12 else 5)
        return
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
