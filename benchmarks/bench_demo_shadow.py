"""Shadow on vs off inside transformers' continuous-batching engine (the demo's engine), in-process.

The real model serves rounds of chat prompts with ``model.generate_batch`` (paged KV, page 32,
prefix sharing on, one torch thread). The harness (benchmarks/overhead.py) interleaves the two
conditions so that machine noise hits both:

- ``--interleave steps`` (the default): blocks of ``--block-steps`` consecutive engine steps
  alternate between off and on, each pair of blocks in a seeded random order, and the cost is
  the engine thread's CPU per token of those steps (:class:`overhead.StepArms`; shadow work
  runs in the step, so all of it is counted, and the ratio overstates the process's overhead).
  Pairs whose steps differ in batch shape (requests, query tokens) are left out, the sampled
  steps that fell in them counted and printed;
- ``--interleave rounds``: whole rounds of requests, off/on then on/off, and the cost is the
  process's CPU per token. Rounds are seconds apart; on this 2-core machine tokens per
  CPU-second move by +-10% from round to round, which leaves a 2% goal undecided.

"on" = the engine
adapter's shadow glue (:mod:`kvdiag.shadow.transformers_cb`) at the default sampling
(rate at most 0.005, CPU budget 1%, three layers per sampled step, in the engine thread, all
methods + locality), after a warm-up that pays the kernels' one-time costs; the runner's
CPU clock leaves out the CPU of "off" rounds, as if it were the only server. Printed:

- tokens per CPU-second: generated tokens / CPU time (as above), the ratio on / off with its
  95% interval and the verdict on the goal (>= 0.98); instructions per token where perf can
  count them (rounds only);
- P99 decode-step latency: the 99th percentile of the wall time of engine steps whose batch is
  all decode (every request at query length 1), shadow work included, on / off (<= 1.05);
- the runner's achieved sampling rate and CPU spent against its budget, and the machine's load.
"""

import argparse
import os
import statistics
import time

import torch

from kvdiag.shadow.transformers_cb import DEFAULT_BUDGET_FRAC, DEFAULT_LAYERS_PER_RUN, DEFAULT_SAMPLE_RATE
from kvdiag.diagnosis.intervals import goal_verdict
from overhead import Goal, InstructionCounter, RoundCost, StepArms, perf_instructions_available, report, run_interleaved


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--interleave", choices=("steps", "rounds"), default="steps",
                    help="alternate the conditions by blocks of engine steps or by rounds")
    ap.add_argument("--block-steps", type=int, default=1, help="engine steps per block (--interleave steps)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds of requests (with --interleave rounds, "
                                                            "each runs both conditions)")
    ap.add_argument("--requests", type=int, default=8, help="requests per round")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--sample-rate", type=float, default=DEFAULT_SAMPLE_RATE, help="most share of steps sampled")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_FRAC, help="shadow CPU budget, fraction")
    ap.add_argument("--background", action="store_true", help="measure in the runner's worker thread")
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS_PER_RUN,
                    help="layers measured per sampled step (0: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    from kvdiag.shadow.transformers_cb import CBShadow, decode_row
    from kvdiag.diagnosis.compression import frame_of, sampling_summary
    from kvdiag.shadow.runner import CpuClock, ShadowRunner
    from kvdiag.events.schema import ShadowBudget
    from kvdiag.demo.smollm import resolve_model
    from kvdiag.events.sinks import ListSink

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

    class OnRoundsCpu(CpuClock):
        """Process CPU without the CPU of "off" rounds: the budget sees only shadowed work."""

        paused_ns = 0

        def process_ns(self) -> int:
            return time.process_time_ns() - self.paused_ns

    cpu_clock = OnRoundsCpu()
    sink = ListSink()
    runner = ShadowRunner(sink, sample_rate=args.sample_rate, budget_frac=args.budget, max_batch=1,
                          cpu_clock=cpu_clock, background=args.background, layers_per_run=args.layers or None)
    # a first shadow run pays one-time costs (imports, numba kernels loaded or compiled): paid
    # here by a throwaway runner, as a server that has been up for a while has paid them
    warm = ShadowRunner(ListSink(), sample_rate=1.0, budget_frac=None, max_batch=1, layers_per_run=None)
    shadow = CBShadow(warm).install()
    cls = ContinuousBatchingManager
    shadowed = cls.__dict__["_generation_step"]
    dispatch = [shadow._original]
    steps = {"off": [], "on": []}
    arm_now = ["off"]

    by_steps = args.interleave == "steps"
    arms = StepArms(("off", "on"), args.block_steps, seed=0)
    sampled_at = []  # the steps (StepArms' count) that ran shadow work

    def timed_step(manager):
        batch = manager.batch_processor.inputs_and_outputs.requests_in_batch
        decode = all(f.query_length == 1 for f in batch) and decode_row(batch) is not None
        tokens = sum(1 for f in batch if f.has_new_token)  # requests that sample a token in this step
        work = (len(batch), sum(f.query_length for f in batch))
        runs = runner.runs
        if by_steps and counting[0]:
            arm_now[0] = arms.arm()
            dispatch[0] = shadowed if arm_now[0] == "on" else shadow._original
        t0, cpu0 = time.perf_counter_ns(), time.thread_time_ns()
        dispatch[0](manager)
        cpu, wall = time.thread_time_ns() - cpu0, time.perf_counter_ns() - t0
        if by_steps and counting[0]:
            if runner.runs > runs:
                sampled_at.append(arms.steps)
            arms.record(tokens, cpu, work)
            if arm_now[0] == "off":
                cpu_clock.paused_ns += cpu
        if decode:
            steps[arm_now[0]].append(wall)

    perf_note = perf_instructions_available()

    counting = [False]

    def run_round(arm: str, r: int) -> RoundCost:
        arm_now[0] = arm
        dispatch[0] = shadowed if arm == "on" else shadow._original
        cpu0 = time.process_time_ns()
        with InstructionCounter([os.getpid()], perf_note is None) as counter:
            out = model.generate_batch(prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg)
            if arm == "on":
                runner.wait()
        cpu = time.process_time_ns() - cpu0
        if arm == "off":
            cpu_clock.paused_ns += cpu
        return RoundCost(sum(len(o.generated_tokens) for o in out.values()), cpu / 1e9, counter.count)

    cls._generation_step = timed_step
    try:
        dispatch[0] = shadowed
        t0 = time.process_time()
        model.generate_batch(prompts[:2], generation_config=GenerationConfig(max_new_tokens=3, do_sample=False,
                                                                              eos_token_id=-1),
                             continuous_batching_config=cb_cfg)  # warm-up, every step shadowed
        print(f"warm-up: {warm.runs} whole-model shadow runs, {time.process_time() - t0:.1f} CPU-s with the "
              f"one-time costs", flush=True)
        runner.scaling = warm.scaling  # read from the model when the warm-up armed its capture
        shadow.runner = runner
        steps["off"].clear()
        steps["on"].clear()
        if by_steps:
            counting[0] = True
            generated = 0
            for r in range(args.rounds):
                out = model.generate_batch(prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg)
                generated += sum(len(o.generated_tokens) for o in out.values())
                print(f"round {r + 1}/{args.rounds}: {arms.steps} steps; load {os.getloadavg()[0]:.2f}", flush=True)
            runner.wait()
            counting[0] = False
        else:
            res = run_interleaved(("off", "on"), "off", args.rounds, run_round)
    finally:
        cls._generation_step = shadowed
        shadow.uninstall()  # closes the runner: its last ShadowBudget has the final counts
    print()
    print(f"{args.rounds} rounds x {args.requests} requests x {args.max_new_tokens} tokens per condition; "
          f"decode steps off {len(steps['off'])}, on {len(steps['on'])}; shadow runs {runner.runs} "
          f"(dropped busy {runner.dropped}, skipped by budget {runner.skipped_budget}), "
          f"errors {dict(runner.errors) or 0}/{shadow.errors}")
    print("shadow sampling: " + (sampling_summary(frame_of(sink.events, ShadowBudget)) or "no step sampled"))
    if by_steps:
        est = arms.ratio("on", "off")
        matched = set(arms.matched_pairs())
        cpu_s = {arm: sum(arms.cpu_ns[arm][j] for j in matched) / 1e9 for arm in arms.conditions}
        tokens = {arm: sum(arms.tokens[arm][j] for j in matched) for arm in arms.conditions}
        print(f"machine: {os.cpu_count()} CPUs; load average (1 min) now {os.getloadavg()[0]:.2f}")
        print(f"tokens counted in the steps {sum(map(sum, arms.tokens.values()))}, generated {generated} "
              f"(must agree)")
        left_out = [i for i in sampled_at if i // (2 * args.block_steps) not in matched]
        print(f"block pairs that did the same work: {len(matched)} of {arms.steps // (2 * args.block_steps)}; "
              f"sampled steps {len(sampled_at)}, of them in pairs left out {len(left_out)}")
        print(f"{est.n} block pairs of {args.block_steps} steps: off {tokens['off']} tokens in {cpu_s['off']:.1f} "
              f"engine CPU-s ({tokens['off'] / cpu_s['off']:.2f}/s), on {tokens['on']} in {cpu_s['on']:.1f} "
              f"({tokens['on'] / cpu_s['on']:.2f}/s)")
        print(f"goal: on tokens per engine CPU-second >= 0.98 x off: {goal_verdict(est, 0.98).upper()} "
              f"(ratio {est.value:.4f}, 95% interval {est.lo:.4f}..{est.hi:.4f}, {est.n} block pairs)")
    else:
        res.perf_note = perf_note
        print(report(res, [Goal("on", 0.98)]))
    print(f"P99 decode step ms off {p99(steps['off']) / 1e6:.1f}, on {p99(steps['on']) / 1e6:.1f}; ratio = "
          f"{p99(steps['on']) / p99(steps['off']):.3f} (goal <= 1.05); median ratio "
          f"{statistics.median(steps['on']) / statistics.median(steps['off']):.3f}")

if __name__ == "__main__":
    main()
