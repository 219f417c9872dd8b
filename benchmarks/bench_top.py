"""`kvdiag top` costs, measured side by side in one run.

1. Snapshot build time for a 10,000-request log ÷ the default refresh interval (goal < 1):
   the log (CONSTRUCTED TEST DATA, tests/tui_data.py) is read and folded into a LiveState,
   then ``snapshot()`` is timed at the end and at the busiest moment (most live requests).
2. CPU of the UI process ÷ wall time at the default interval (goal <= 0.10 of one core):
   ``kvdiag top --log`` runs in a real terminal (tmux) replaying a log at 1x and at 10x, an
   idle ``sleep`` in the same terminal gives the floor, and (``--demo``, when this build has
   ``kvdiag demo``) plain ``kvdiag top`` runs the live demo: only the UI process is counted,
   not the demo server it started.

3. ``--fold``: the live fold on a vLLM-shaped stream (benchmarks/vllm_stream.py, CONSTRUCTED
   DATA) on one core, events/s, side by side in interleaved rounds: msgspec decoding of the
   stream's JSON lines (for scale), the pool ledger alone (``BlockLedger.apply_all``, goal
   >= 1 M events/s), top's fold (``LiveState.feed_all``: ledger, block facts, request, bin
   and latency state; and event by event, ``LiveState.feed``), and top's whole live path
   (``feed_all`` + ``LiveRules.record``, the rules' inputs, in chunks of 5,000 events).
   ``--curve``: the same stream with hashes-mode content on its arrivals, top's fold with and
   without the capacity-curve fold (kvdiag/live/views/curves.py), in chunks of 5,000 events
   with the curve read (``CurveFold.view``) after each, as top and the exporter do once a
   second; the curve fold alone on its own events; and ``uptime``'s load.
4. ``--rss N``: RSS of top + exporter (a LiveState and a PrometheusSink fed the same stream,
   5,000 events per second of event time, folded once a second, a snapshot every second and
   a scrape every 15 s of event time, as top, the exporter and Prometheus would) at 1 M
   events and at N (the goal: flat within +-10% up to 20 M); ``--with-rules`` adds top's
   LiveRules (the non-block events in typed arrays, block events folded into the block
   facts), run once at each mark.

5. ``--compare REF``: the fold timings of 3. (and top's fold on the content stream of
   ``--curve``, with and without the rules, reading the curve after every 5,000 events: the
   cadence of a source of 5,000 events/s; and top's tick at full speed, the measure of the
   live path's goal of >= 1 M events/s: chunks of its ``CHUNK_EVENTS``, one snapshot a
   second) for this checkout and for git revision REF (its
   ``kvdiag`` extracted with ``git archive`` into a temp folder), each round in a fresh process
   per tree (benchmarks/fold_worker.py), trees alternating; per-event microseconds and ratios
   to msgspec's decode of the same stream, medians of the rounds, with the load.
   ``--instructions``: the same timings' instructions per event instead, counted by valgrind's
   callgrind (one run per tree; the same whatever the machine's load, which moves this
   machine's timings by up to 40% within an hour).

Usage: python benchmarks/bench_top.py [--requests 10000] [--seconds 30] [--demo]
       python benchmarks/bench_top.py --compare main [--events 1000000] [--rounds 5]
       python benchmarks/bench_top.py --compare main --instructions [--events 200000]
       python benchmarks/bench_top.py --fold [--events 1000000] [--rss 20000000]
       python benchmarks/bench_top.py --curve [--events 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tui_data import write_constructed_log  # noqa: E402

from kvdiag.events.eventlog import iter_events
from kvdiag.live.state import LiveState  # noqa: E402

INTERVAL_S = 1.0


def snapshot_cost(log: Path) -> None:
    state = LiveState()
    t0 = time.perf_counter()
    n = 0
    busiest, busiest_ts = -1, 0
    for ev in iter_events(log):
        state.feed(ev)
        n += 1
        if len(state.requests.live) > busiest:
            busiest, busiest_ts = len(state.requests.live), ev.ts_ns
    fold_s = time.perf_counter() - t0
    times = []
    for _ in range(5):
        t = time.perf_counter()
        snap = state.snapshot(ev.ts_ns)
        times.append(time.perf_counter() - t)
    end_s = min(times)
    print(f"log: {n:,} events, {snap.requests.finished:,} finished requests")
    print(f"read+fold: {fold_s:.2f} s = {n / fold_s:,.0f} events/s (a replay catches up at "
          f"{n / fold_s / max(1, snap.events_per_s):,.0f}x the log's own rate)")
    print(f"snapshot at end of log: {end_s * 1e3:.1f} ms = {end_s / INTERVAL_S:.3f} of the {INTERVAL_S:g} s interval")

    state = LiveState()
    for ev in iter_events(log):
        if ev.ts_ns > busiest_ts:
            break
        state.feed(ev)
    t = time.perf_counter()
    snap = state.snapshot(busiest_ts)
    busy_s = time.perf_counter() - t
    print(f"snapshot at the busiest moment ({len(state.requests.live)} live requests): {busy_s * 1e3:.1f} ms = "
          f"{busy_s / INTERVAL_S:.3f} of the interval")


def ui_cpu(log: Path, seconds: float, demo: bool) -> None:
    if shutil.which("tmux") is None:
        print("tmux not installed: UI CPU share not measured")
        return
    kvdiag = str(Path(sys.executable).with_name("kvdiag"))
    runs = [("idle shell (sleep)", f"sleep {seconds + 30}", 3),
            ("kvdiag top --log, 1x", f"{kvdiag} top --log {log} --speed 1", 3),
            ("kvdiag top --log, 10x", f"{kvdiag} top --log {log} --speed 10", 3)]
    if demo:
        runs.append(("kvdiag top (live demo)", f"{kvdiag} top", 90))  # after model load and warm-up
    server = ["tmux", "-L", f"kvdiag-bench-{os.getpid()}", "-f", "/dev/null"]
    for label, cmd, warmup_s in runs:
        subprocess.run([*server, "new-session", "-d", "-s", "b", "-x", "120", "-y", "36", cmd], check=True,
                       env=dict(os.environ, TERM="xterm-256color"))
        pid = int(subprocess.run([*server, "list-panes", "-t", "b", "-F", "#{pane_pid}"], check=True,
                                 capture_output=True, text=True).stdout.strip())
        proc = psutil.Process(pid)
        time.sleep(warmup_s)  # start-up (imports, first snapshot, demo start) is not the steady state
        c0, w0 = proc.cpu_times(), time.monotonic()
        time.sleep(seconds)
        c1, w1 = proc.cpu_times(), time.monotonic()
        share = (c1.user + c1.system - c0.user - c0.system) / (w1 - w0)
        print(f"{label:<24} CPU/wall = {share:.3f} of one core")
        subprocess.run([*server, "send-keys", "-t", "b", "q"], capture_output=True)
        deadline = time.monotonic() + 120  # top stops the demo it started before it exits
        while time.monotonic() < deadline and subprocess.run(
                [*server, "has-session", "-t", "b"], capture_output=True).returncode == 0:
            time.sleep(0.5)
        subprocess.run([*server, "kill-server"], capture_output=True)
        time.sleep(1)  # let the tmux server exit before the next run starts one on the same socket


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def fold_rate(n_events: int, rounds: int = 5) -> None:
    """Events/s of each fold, rounds interleaved; the median round of each."""
    import statistics

    import msgspec

    import vllm_stream
    from kvdiag.pool.blockledger import BlockLedger
    from kvdiag.events.schema import AnyEvent

    events = list(vllm_stream.events(n_events))
    n = len(events)
    lines = [msgspec.json.encode(e) for e in events]
    decoder = msgspec.json.Decoder(AnyEvent)  # the tagged union of every event type

    def decode():
        for line in lines:
            decoder.decode(line)

    def ledger():
        BlockLedger().apply_all(events)

    def live_batch():
        LiveState().feed_all(events)

    def live_each():
        state = LiveState()
        for ev in events:
            state.feed(ev)

    def live_and_rules():
        from kvdiag.live.rules import LiveRules

        state, rules = LiveState(), LiveRules()
        for i in range(0, n, 5_000):  # as top polls its source
            rules.fold(state, events[i:i + 5_000])

    runs = {"msgspec JSON decode (for scale)": decode, "BlockLedger.apply_all": ledger,
            "LiveState.feed_all (top's fold)": live_batch, "LiveState.feed, one by one": live_each,
            "feed_all + LiveRules.record": live_and_rules}
    rates: dict[str, list[float]] = {k: [] for k in runs}
    print(f"fold: {n:,} vLLM-shaped events, {rounds} interleaved rounds; load before {load()}")
    for r in range(rounds):
        for name, fn in (runs.items() if r % 2 == 0 else reversed(runs.items())):
            t = time.process_time()
            fn()
            rates[name].append(n / (time.process_time() - t))
    ledger_rate = statistics.median(rates["BlockLedger.apply_all"])
    for name, v in rates.items():
        med = statistics.median(v)
        print(f"  {name:<34} {med / 1e6:5.2f} M events/s = {1e6 / med:5.2f} us/event "
              f"(rounds {min(v) / 1e6:.2f}..{max(v) / 1e6:.2f}); x{med / ledger_rate:.2f} the ledger's; "
              f"{med / 1e6:.2f} of the 1 M/s goal")
    print(f"  load after {load()}")


def rss_flat(n_events: int, with_rules: bool = False) -> None:
    """RSS of a LiveState + PrometheusSink at 1 M events and at ``n_events`` (``with_rules``:
    also top's LiveRules, which keeps the non-block events in typed arrays, run once at each
    mark after the reading, its time printed)."""
    import gc

    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    import vllm_stream
    from kvdiag.prometheus.exporter import PrometheusSink

    proc = psutil.Process()
    from kvdiag.live.rules import LiveRules

    state, sink = LiveState(), PrometheusSink()
    rules = LiveRules() if with_rules else None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(sink)
    marks = sorted({min(1_000_000, n_events), n_events})
    next_snap = next_scrape = 0
    batch: list = []
    seen, t0 = 0, time.perf_counter()
    print(f"rss: top + exporter{' + top rules' if with_rules else ''} fed {n_events:,} "
          f"vLLM-shaped events; load before {load()}")
    readings = []
    for ev in vllm_stream.events(n_events):
        batch.append(ev)
        sink.record(ev)
        seen += 1
        if len(batch) == 5_000 or seen >= marks[0]:  # 1 s of the stream: the exporter folds once a second
            state.feed_all(batch)
            sink.flush()
            if rules is not None:
                rules.record(batch)
            ts = batch[-1].ts_ns
            batch = []
            if ts >= next_snap:
                state.snapshot(ts)
                next_snap = ts + 1_000_000_000
            if ts >= next_scrape:
                generate_latest(registry)
                next_scrape = ts + 15_000_000_000
            if seen >= marks[0]:
                sink.flush()
                if rules is not None:  # top runs them every period: run them, then read
                    gc.collect()
                    before = proc.memory_info().rss
                    r0 = time.perf_counter()
                    found = rules.run(state.header, rules.take(state))
                    ran = (f"; {before / 2**20:.1f} MiB before the rules ran in {time.perf_counter() - r0:.2f} s: "
                           f"{len(found)} findings, "
                           f"{sum(f.status == 'fail' for f in found)} fail")
                gc.collect()
                rss = proc.memory_info().rss
                readings.append((seen, rss))
                print(f"  after {seen:>12,} events: RSS {rss / 2**20:8.1f} MiB "
                      f"({time.perf_counter() - t0:.0f} s){ran if rules is not None else ''}")
                marks.pop(0)
                if not marks:
                    break
    sink.close()
    if len(readings) == 2:
        (n1, r1), (n2, r2) = readings
        print(f"  RSS at {n2:,} / at {n1:,} events: {r2 / r1:.3f} (goal 0.90..1.10)")
    print(f"  load after {load()}")


def curve_rate(n_events: int, rounds: int = 5) -> None:
    """Events/s of top's fold with and without the capacity-curve fold, rounds interleaved."""
    import statistics
    import subprocess
    from unittest import mock

    import vllm_stream
    from kvdiag.live import state as live_state
    from kvdiag.live.views.curves import CurveFold

    events = list(vllm_stream.events(n_events, content=True))
    n = len(events)
    arrivals = sum(1 for e in events if type(e).__name__ == "RequestArrived")

    def run(state) -> None:
        for i in range(0, n, 5_000):
            state.feed_all(events[i:i + 5_000])
            state.curves.view()

    def without():
        with mock.patch.object(live_state, "chain_handlers", lambda handlers, extra: None):
            state = LiveState()
        run(state)

    def with_curve():
        run(LiveState())

    def fold_alone():  # the curve fold's own handlers over the same stream (others skipped)
        pool = events[0].num_blocks
        fold = CurveFold(lambda: 16, lambda: pool)
        get = fold.handlers.get
        for i in range(0, n, 5_000):
            for ev in events[i:i + 5_000]:
                h = get(type(ev))
                if h is not None:
                    h(ev, None, 0)
            fold.view()

    runs = {"LiveState.feed_all without the curve": without, "LiveState.feed_all with the curve": with_curve,
            "the curve fold alone": fold_alone}
    rates: dict[str, list[float]] = {k: [] for k in runs}
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"curve: {n:,} vLLM-shaped events with content ({arrivals:,} arrivals), {rounds} interleaved "
          f"rounds; uptime before: {uptime}")
    for r in range(rounds):
        for name, fn in (runs.items() if r % 2 == 0 else reversed(runs.items())):
            t = time.process_time()
            fn()
            rates[name].append(n / (time.process_time() - t))
    for name, v in rates.items():
        med = statistics.median(v)
        print(f"  {name:<38} {med / 1e6:5.2f} M events/s = {1e6 / med:5.2f} us/event "
              f"(rounds {min(v) / 1e6:.2f}..{max(v) / 1e6:.2f})")
    state = LiveState()
    run(state)
    row = state.curves.view().rows[0]
    print("  curve at the end: " + ", ".join(f"{p.multiple:g}x pool ({p.capacity_blocks} blocks) "
                                             f"{100 * (p.token_hit_rate or 0):.1f}%" for p in row.points))
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"  uptime after: {uptime}")


def instructions(worker: Path, trees: dict, plain: Path, content: Path, d: str) -> dict[str, dict[str, int]]:
    """Instructions of each timing of fold_worker.py, per tree: one run under callgrind that
    dumps a profile part at each of the worker's marks (``--marks``; part 1 is its setup)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions counts with valgrind's callgrind: install valgrind (apt install valgrind)")
    out = {}
    for name, tree in trees.items():
        prefix = Path(d) / f"cg-{len(out)}"
        env = dict(os.environ, PYTHONPATH=str(tree))
        proc = subprocess.run(["valgrind", "--tool=callgrind", "--dump-before=getppid",
                               f"--callgrind-out-file={prefix}.%p", sys.executable, str(worker),
                               str(plain), str(content), "--marks"],
                              env=env, capture_output=True, text=True, cwd=d)
        if proc.returncode:
            raise SystemExit(f"{name}: fold_worker under callgrind failed:\n{proc.stderr[-3000:]}")
        names = [k for k in json.loads(proc.stdout.strip().splitlines()[-1]) if k != "kvdiag"]
        parts = {}
        for f in Path(d).glob(f"{prefix.name}.*.*"):
            totals = next(line for line in f.read_text().splitlines() if line.startswith("totals:"))
            parts[int(f.suffix[1:])] = int(totals.split()[1])
            f.unlink()
        for f in Path(d).glob(f"{prefix.name}.*"):
            f.unlink()
        if len(parts) != len(names) + 1:
            raise SystemExit(f"{name}: {len(parts)} profile parts for {len(names)} timings")
        out[name] = {k: parts[i + 2] for i, k in enumerate(names)}
    return out


def compare(ref: str, n_events: int, rounds: int, count_instructions: bool = False) -> None:
    """Rounds of benchmarks/fold_worker.py on this checkout and on ``ref``, alternating;
    ``count_instructions``: instead, one run of each under callgrind, instructions per event
    (the same whatever the machine's load; the compiled kernels are compiled for valgrind's
    CPU, so their share is close to, not equal to, the native one)."""
    import statistics

    import msgspec

    import vllm_stream

    root = Path(__file__).resolve().parents[1]
    worker = Path(__file__).resolve().parent / "fold_worker.py"
    with tempfile.TemporaryDirectory() as d:
        old = Path(d) / "ref"
        old.mkdir()
        archive = subprocess.run(["git", "-C", str(root), "archive", ref, "kvdiag"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        plain, content = Path(d) / "plain.jsonl", Path(d) / "content.jsonl"
        for path, kw in ((plain, {}), (content, {"content": True})):
            with open(path, "wb") as f:
                for ev in vllm_stream.events(n_events, **kw):
                    f.write(msgspec.json.encode(ev) + b"\n")
        trees = {"this checkout": root, ref: old}
        if count_instructions:
            counts = instructions(worker, trees, plain, content, d)
            scale = "msgspec JSON decode (for scale)"
            print(f"compare: {n_events:,} vLLM-shaped events, instructions counted by valgrind's callgrind")
            print(f"  {'instructions/event (x msgspec decode)':<42} {'this checkout':>20} {ref:>20} "
                  f"{'this/ref':>9}")
            for k in counts[ref]:
                new, was = (counts[t][k] / n_events for t in trees)
                print(f"  {k:<42} {new:9,.0f} (x{new / (counts['this checkout'][scale] / n_events):5.2f}) "
                      f"{was:9,.0f} (x{was / (counts[ref][scale] / n_events):5.2f}) {new / was:9.3f}")
            return
        results: dict[str, list[dict]] = {k: [] for k in trees}
        print(f"compare: {n_events:,} vLLM-shaped events, {rounds} rounds, a fresh process per tree and round; "
              f"load before {load()}")
        for r in range(rounds):
            for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                env = dict(os.environ, PYTHONPATH=str(trees[name]))
                proc = subprocess.run([sys.executable, str(worker), str(plain), str(content)], env=env,
                                      capture_output=True, text=True, cwd=d)
                if proc.returncode:
                    raise SystemExit(f"{name}: fold_worker failed:\n{proc.stderr}")
                results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        for name, runs in results.items():
            print(f"  {name}: kvdiag from {runs[0]['kvdiag'].replace(str(root), '.').replace(d, '<tmp>')}")
        scale = "msgspec JSON decode (for scale)"
        names = [k for k in results[ref][0] if k != "kvdiag"]
        med = {t: {k: statistics.median(r[k] for r in results[t]) for k in names} for t in trees}
        ratio = {t: {k: statistics.median(r[k] / r[scale] for r in results[t]) for k in names} for t in trees}
        print(f"  {'us/event (x msgspec decode)':<42} {'this checkout':>22} {ref:>22} {'speed-up':>9} "
              f"{'M events/s':>11}")
        for k in names:
            new, was = med["this checkout"][k], med[ref][k]
            print(f"  {k:<42} {new:7.3f} us (x{ratio['this checkout'][k]:5.2f}) "
                  f"{was:7.3f} us (x{ratio[ref][k]:5.2f}) {was / new:8.2f}x {1 / new:10.2f}")
        print(f"  load after {load()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--demo", action="store_true", help="also measure plain `kvdiag top` on the live demo")
    ap.add_argument("--fold", action="store_true", help="only the live fold's events/s (3.)")
    ap.add_argument("--events", type=int, default=None, help="events of the fold benchmark (default 1,000,000)")
    ap.add_argument("--rss", type=int, default=0, metavar="N", help="only RSS at 1 M and N events (4.)")
    ap.add_argument("--curve", action="store_true", help="only top's fold with and without the capacity curve")
    ap.add_argument("--with-rules", action="store_true", help="--rss: also top's LiveRules event window")
    ap.add_argument("--compare", metavar="REF", help="the fold timings of this checkout and of git revision REF")
    ap.add_argument("--rounds", type=int, default=5, help="--compare: rounds")
    ap.add_argument("--instructions", action="store_true",
                    help="--compare: instructions per event counted by valgrind (default --events 200000)")
    args = ap.parse_args()
    if args.compare:
        n = args.events if args.events is not None else (200_000 if args.instructions else 1_000_000)
        compare(args.compare, n, args.rounds, args.instructions)
        return
    args.events = args.events or 1_000_000
    if args.curve:
        curve_rate(args.events)
        return
    if args.fold or args.rss:
        if args.fold:
            fold_rate(args.events)
        if args.rss:
            rss_flat(args.rss, args.with_rules)
        return
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        big = write_constructed_log(Path(d) / "big.jsonl", n_requests=args.requests, arrivals_per_s=10.0)
        print(f"wrote {big.stat().st_size / 1e6:.0f} MB constructed log in {time.perf_counter() - t:.0f} s")
        snapshot_cost(big)
        small = write_constructed_log(Path(d) / "small.jsonl", n_requests=400, arrivals_per_s=2.0)
        ui_cpu(small, args.seconds, args.demo)


if __name__ == "__main__":
    main()
