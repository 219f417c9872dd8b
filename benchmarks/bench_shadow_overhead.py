"""Shadow on vs off on the real model in-process (DynamicCache, greedy, one torch thread):
generated tokens/s ratio (goal >= 0.98) and P99 decode-step latency ratio (goal <= 1.05) at the
default sampling (ShadowRunner defaults: rate at most 0.05, CPU budget 0.02). The arms alternate
prompt by prompt (off, on, off, on, ...) in one process so that machine noise hits both; the
runner's CPU clock leaves out the "off" arm's CPU, as if it were the only server. (The
engine's own path, with interleaved rounds and intervals: bench_demo_shadow.py.)"""

import argparse
import statistics
import time

import torch

from kvdiag.commands.shadow import PROMPTS
from kvdiag.demo.smollm import load_model, resolve_model
from kvdiag.shadow.runner import CpuClock, ShadowRunner
from kvdiag.shadow.hf_decoder import shadow_generate
from kvdiag.events.sinks import ListSink


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--background", action="store_true", help="measure in the runner's worker thread")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(resolve_model(args.model))
    shadow_generate(model, tok, PROMPTS[:1], None, 8)  # warm-up
    steps = {"off": [], "on": []}
    tokens = {"off": 0, "on": 0}
    class OnArmCpu(CpuClock):
        paused_ns = 0

        def process_ns(self) -> int:
            return time.process_time_ns() - self.paused_ns

    cpu_clock = OnArmCpu()
    runner = ShadowRunner(ListSink(), cpu_clock=cpu_clock, background=args.background)
    for _ in range(args.rounds):
        for prompt in PROMPTS:
            for arm in ("off", "on"):
                t0 = time.process_time_ns()
                res = shadow_generate(model, tok, [prompt], runner if arm == "on" else None, args.max_new_tokens)
                if arm == "off":
                    cpu_clock.paused_ns += time.process_time_ns() - t0
                steps[arm] += res.step_ns
                tokens[arm] += res.decode_tokens
    runner.wait()
    runner.close()
    tps = {arm: tokens[arm] / (sum(steps[arm]) / 1e9) for arm in steps}
    print(f"decode steps: off {len(steps['off'])}, on {len(steps['on'])}; shadow runs {runner.runs}, "
          f"shadow time {runner.spent_ns / 1e9:.2f} s, errors {dict(runner.errors)}")
    print(f"shadow CPU / on-arm engine CPU = {runner.spent_ns / max(runner.engine_ns(), 1):.4f} "
          f"(budget {runner.budget_frac}); achieved rate {runner.sampled / max(runner.offered, 1):.4f}")
    print(f"tokens/s off {tps['off']:.2f}, on {tps['on']:.2f}; ratio on/off = {tps['on'] / tps['off']:.3f} (goal >= 0.98)")
    print(f"P99 step ms off {p99(steps['off']) / 1e6:.1f}, on {p99(steps['on']) / 1e6:.1f}; ratio = "
          f"{p99(steps['on']) / p99(steps['off']):.3f} (goal <= 1.05); median ratio "
          f"{statistics.median(steps['on']) / statistics.median(steps['off']):.3f}")


if __name__ == "__main__":
    main()
