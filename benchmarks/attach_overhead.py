"""Throughput of the demo server with and without `kvdiag attach` running, side by side.

    python benchmarks/attach_overhead.py [--window 30] [--clients 4]

Starts the real demo server (SmolLM2, transformers' continuous batching, kvdiag agent, one
torch thread), drives it closed-loop with ``--clients`` concurrent chat clients, and measures
the server's throughput over three equal windows: without attach, with ``kvdiag attach``
(process, py-spy and agent stream), without again. Throughput = tokens the engine processed
(prefill + decode, from the server's own ``EngineStep`` events in its log) per second of
window; requests completing are too coarse a clock at a few requests per window. Because
arrivals make that bursty, the script also compares the median duration of decode steps at the
most common batch size (the engine's speed, independent of what was queued). Prints both
ratios with / without (> 1 means faster with attach).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=30.0, help="seconds per measured window")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--port", type=int, default=18460)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    from kvdiag.commands.demo import DEFAULT_MAX_BATCH_TOKENS, DemoServer
    from kvdiag.demo.smollm import ensure_model
    from kvdiag.demo.traffic import TrafficPlan, chat

    model_dir = ensure_model()
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-bench-"))
    server = DemoServer(model_dir, tmp / "demo.jsonl", args.port, page_size=32, num_blocks=256,
                        max_batch_tokens=DEFAULT_MAX_BATCH_TOKENS, inject_leak=0, threads=1)
    server.start()
    done: list[tuple[float, int]] = []  # (completion time, completion tokens)
    stop = threading.Event()
    lock = threading.Lock()

    def client(seed: int) -> None:
        plan = TrafficPlan(seed=seed, rate_per_s=1.0, long_share=0.0).requests()
        while not stop.is_set():
            p = next(plan)
            msgs = [{"role": "system", "content": p.conversation.system_prompt},
                    {"role": "user", "content": p.conversation.user_turns[0]}]
            try:
                ans = chat(server.base_url, str(model_dir), msgs, args.max_tokens, f"b{seed}-{p.index}")
                with lock:
                    done.append((time.monotonic(), int(ans["usage"]["completion_tokens"])))
            except Exception as exc:  # a failed request is reported, not counted
                print(f"request failed: {exc}", file=sys.stderr)

    steps: list = []

    def rate(t0: float, t1: float) -> float:
        """Engine tokens/s between two wall-clock times (ns)."""
        return sum(e.num_tokens for e in steps if t0 <= e.ts_ns < t1) / ((t1 - t0) / 1e9)

    def decode_rate(t0: float, t1: float) -> float:
        return sum(e.decode_tokens for e in steps if t0 <= e.ts_ns < t1) / ((t1 - t0) / 1e9)

    try:
        server.wait_ready()
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(10)  # warm-up
        t0 = time.time_ns()
        time.sleep(args.window)
        t1 = time.time_ns()
        attach = subprocess.Popen([sys.executable, "-m", "kvdiag", "attach", str(server.proc.pid),
                                   "--duration", str(args.window + 2), "--out", str(tmp / "attach.jsonl"), "--json"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(2)  # attach start-up (imports, py-spy check) is not steady state
        t2 = time.time_ns()
        time.sleep(args.window)
        t3 = time.time_ns()
        attach.communicate(timeout=120)
        t4 = time.time_ns()
        time.sleep(args.window)
        t5 = time.time_ns()
        stop.set()
    finally:
        stop.set()
        server.stop()
    from kvdiag.events.eventlog import iter_events
    from kvdiag.events.schema import EngineStep
    steps.extend(e for e in iter_events(tmp / "demo.jsonl") if isinstance(e, EngineStep))
    without = (rate(t0, t1) + rate(t4, t5)) / 2
    with_attach = rate(t2, t3)
    print(f"engine tokens/s without attach: {rate(t0, t1):.1f} and {rate(t4, t5):.1f}; with attach: {with_attach:.1f}")
    print(f"decode tokens/s without attach: {decode_rate(t0, t1):.2f} and {decode_rate(t4, t5):.2f}; "
          f"with attach: {decode_rate(t2, t3):.2f}")
    print(f"completed requests: {len(done)}; attach rc {attach.returncode}")
    print(f"throughput ratio with/without attach: {with_attach / without:.3f}")
    decode = [e for e in steps if e.phase == "decode"]
    if decode:
        import statistics
        from collections import Counter
        batch = Counter(e.batch_size for e in decode).most_common(1)[0][0]

        def median_ms(t0: int, t1: int) -> float:
            d = [e.duration_ns for e in decode if e.batch_size == batch and t0 <= e.ts_ns < t1]
            return statistics.median(d) / 1e6 if d else float("nan")

        a1, b, a2 = median_ms(t0, t1), median_ms(t2, t3), median_ms(t4, t5)
        print(f"median decode step at batch {batch}: without {a1:.1f} / {a2:.1f} ms, with attach {b:.1f} ms")
        print(f"decode speed ratio with/without attach: {((a1 + a2) / 2) / b:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
