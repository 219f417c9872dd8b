"""Shadow on vs off inside transformers' continuous-batching engine (the demo's engine), in-process.

The real model serves rounds of chat prompts with ``model.generate_batch`` (paged KV, page 32,
prefix sharing on, one torch thread); rounds alternate off, on, off, on, ... in one process so
machine noise hits both arms. "on" = the engine adapter's shadow glue
(:mod:`kvdiag.collectors.transformers_cb_shadow`) at the default sampling (rate 0.05, time
budget 1%, in the engine thread, all methods + locality); the runner's budget clock runs only
during "on" rounds, as if it were the only server. Printed ratios (goal in parentheses):

- tokens/s: generated tokens / wall time of the arm's ``generate_batch`` calls, on / off (>= 0.98);
- P99 decode-step latency: the 99th percentile of the wall time of engine steps whose batch is
  all decode (every request at query length 1), shadow work included, on / off (<= 1.05);
and the machine's load average (os.getloadavg) before and after.
"""

import argparse
import os
import statistics
import time

import torch

from kvdiag.collectors.transformers_cb_shadow import DEFAULT_BUDGET_FRAC


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per arm")
    ap.add_argument("--requests", type=int, default=8, help="requests per round")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--sample-rate", type=float, default=0.05)
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_FRAC, help="shadow time budget, fraction")
    ap.add_argument("--background", action="store_true", help="measure in the runner's worker thread")
    args = ap.parse_args()
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    from kvdiag.collectors.transformers_cb_shadow import CBShadow, decode_row
    from kvdiag.kernels.shadow import ShadowRunner
    from kvdiag.model import resolve_model
    from kvdiag.sinks import ListSink

    path = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    system = "You are the support assistant of an online bookshop. Answer briefly and politely. " * 6
    prompts = []
    for i in range(args.requests):
        ids = tok.apply_chat_template([{"role": "system", "content": system},
                                       {"role": "user", "content": f"Where is my order number {1000 + i}?"}],
                                      add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    gen_cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1)
    cb_cfg = ContinuousBatchingConfig(page_size=32, num_blocks=128, max_batch_tokens=256, allow_block_sharing=True)

    paused_ns = [0]
    runner = ShadowRunner(ListSink(), sample_rate=args.sample_rate, budget_frac=args.budget, max_batch=1,
                          clock=lambda: time.perf_counter_ns() - paused_ns[0], background=args.background)
    shadow = CBShadow(runner).install()
    cls = ContinuousBatchingManager
    shadowed = cls.__dict__["_generation_step"]
    dispatch = [shadow._original]
    steps = {"off": [], "on": []}
    arm_now = ["off"]

    def timed_step(manager):
        decode = all(f.query_length == 1 for f in manager.batch_processor.inputs_and_outputs.requests_in_batch) \
            and decode_row(manager.batch_processor.inputs_and_outputs.requests_in_batch) is not None
        t0 = time.perf_counter_ns()
        dispatch[0](manager)
        if decode:
            steps[arm_now[0]].append(time.perf_counter_ns() - t0)

    cls._generation_step = timed_step
    wall = {"off": 0, "on": 0}
    tokens = {"off": 0, "on": 0}
    try:
        model.generate_batch(prompts[:2], generation_config=gen_cfg, continuous_batching_config=cb_cfg)  # warm-up
        steps["off"].clear()
        for _ in range(args.rounds):
            for arm in ("off", "on"):
                arm_now[0] = arm
                dispatch[0] = shadowed if arm == "on" else shadow._original
                t0 = time.perf_counter_ns()
                out = model.generate_batch(prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg)
                dt = time.perf_counter_ns() - t0
                if arm == "on":
                    runner.wait()
                else:
                    paused_ns[0] += dt
                wall[arm] += dt
                tokens[arm] += sum(len(o.generated_tokens) for o in out.values())
    finally:
        cls._generation_step = shadowed
        shadow.uninstall()
    load_after = os.getloadavg()
    tps = {arm: tokens[arm] / (wall[arm] / 1e9) for arm in wall}
    print(f"rounds per arm {args.rounds} x {args.requests} requests x {args.max_new_tokens} tokens; "
          f"decode steps off {len(steps['off'])}, on {len(steps['on'])}; shadow runs {runner.runs} "
          f"(sampled {len(shadow.samples)}, dropped busy {runner.dropped}, skipped by budget {runner.skipped_budget}), "
          f"errors {dict(runner.errors) or 0}/{shadow.errors}")
    print(f"shadow time / on-arm wall time = {runner.spent_ns / wall['on']:.4f} (budget {args.budget})")
    print(f"tokens/s off {tps['off']:.2f}, on {tps['on']:.2f}; ratio on/off = {tps['on'] / tps['off']:.3f} (goal >= 0.98)")
    print(f"P99 decode step ms off {p99(steps['off']) / 1e6:.1f}, on {p99(steps['on']) / 1e6:.1f}; ratio = "
          f"{p99(steps['on']) / p99(steps['off']):.3f} (goal <= 1.05); median ratio "
          f"{statistics.median(steps['on']) / statistics.median(steps['off']):.3f}")
    print(f"load average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
