"""Throughput of the demo server with and without `kvdiag attach` running, side by side.

    python benchmarks/attach_overhead.py [--window 30] [--clients 4]

Starts the real demo server (SmolLM2, transformers' continuous batching, kvdiag agent, one
torch thread), drives it closed-loop with ``--clients`` concurrent chat clients, and measures
generated tokens/s over three equal windows: without attach, with ``kvdiag attach`` (process,
py-spy and agent stream), without again. Prints the ratio with / mean(without).
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

    from kvdiag.commands.demo import DemoServer
    from kvdiag.model import ensure_model
    from kvdiag.traffic import TrafficPlan, chat

    model_dir = ensure_model()
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-bench-"))
    server = DemoServer(model_dir, tmp / "demo.jsonl", args.port, page_size=32, num_blocks=256,
                        inject_leak=0, threads=1)
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

    def rate(t0: float, t1: float) -> float:
        with lock:
            return sum(n for t, n in done if t0 <= t < t1) / (t1 - t0)

    try:
        server.wait_ready()
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(10)  # warm-up
        t0 = time.monotonic()
        time.sleep(args.window)
        t1 = time.monotonic()
        attach = subprocess.Popen([sys.executable, "-m", "kvdiag", "attach", str(server.proc.pid),
                                   "--duration", str(args.window + 2), "--out", str(tmp / "attach.jsonl"), "--json"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(2)  # attach start-up (imports, py-spy check) is not steady state
        t2 = time.monotonic()
        time.sleep(args.window)
        t3 = time.monotonic()
        _, err = attach.communicate(timeout=120)
        t4 = time.monotonic()
        time.sleep(args.window)
        t5 = time.monotonic()
        stop.set()
        without = (rate(t0, t1) + rate(t4, t5)) / 2
        with_attach = rate(t2, t3)
        print(f"tokens/s without attach: {rate(t0, t1):.2f} and {rate(t4, t5):.2f}; with attach: {with_attach:.2f}")
        print(f"attach rc {attach.returncode}{' ' + err.strip().splitlines()[-1] if err.strip() else ''}")
        print(f"throughput ratio with/without attach: {with_attach / without:.3f}")
    finally:
        stop.set()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
