"""Shadow on vs off inside transformers' continuous-batching engine (the demo's engine), in-process.

The real model serves rounds of chat prompts with ``model.generate_batch`` (paged KV, page 32,
prefix sharing on, one torch thread). The harness (benchmarks/overhead.py) interleaves the two
conditions round by round, off/on then on/off, so machine noise hits both. "on" = the engine
adapter's shadow glue (:mod:`kvdiag.collectors.transformers_cb_shadow`) at the default sampling
(rate at most 0.005, CPU budget 1%, three layers per sampled step, in the engine thread, all
methods + locality), after a warm-up that pays the kernels' one-time costs; the runner's
CPU clock leaves out the CPU of "off" rounds, as if it were the only server. Printed:

- tokens per CPU-second: generated tokens / CPU time of this process in the round, the ratio
  on / off with its 95% interval and the verdict on the goal (>= 0.98); instructions per token
  where perf can count them;
- P99 decode-step latency: the 99th percentile of the wall time of engine steps whose batch is
  all decode (every request at query length 1), shadow work included, on / off (<= 1.05);
- the runner's achieved sampling rate and CPU spent against its budget, and the machine's load.
"""

import argparse
import os
import statistics
import time

import torch

from kvdiag.collectors.transformers_cb_shadow import DEFAULT_BUDGET_FRAC, DEFAULT_LAYERS_PER_RUN, DEFAULT_SAMPLE_RATE
from overhead import Goal, InstructionCounter, RoundCost, perf_instructions_available, report, run_interleaved


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=12, help="interleaved rounds (each runs both conditions)")
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

    from kvdiag.collectors.transformers_cb_shadow import CBShadow, decode_row
    from kvdiag.analysis.compression import frame_of, sampling_summary
    from kvdiag.kernels.shadow import CpuClock, ShadowRunner
    from kvdiag.schema import ShadowBudget
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

    def timed_step(manager):
        decode = all(f.query_length == 1 for f in manager.batch_processor.inputs_and_outputs.requests_in_batch) \
            and decode_row(manager.batch_processor.inputs_and_outputs.requests_in_batch) is not None
        t0 = time.perf_counter_ns()
        dispatch[0](manager)
        if decode:
            steps[arm_now[0]].append(time.perf_counter_ns() - t0)

    perf_note = perf_instructions_available()

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
        res = run_interleaved(("off", "on"), "off", args.rounds, run_round)
    finally:
        cls._generation_step = shadowed
        shadow.uninstall()  # closes the runner: its last ShadowBudget has the final counts
    res.perf_note = perf_note
    print()
    print(f"{args.rounds} rounds x {args.requests} requests x {args.max_new_tokens} tokens per condition; "
          f"decode steps off {len(steps['off'])}, on {len(steps['on'])}; shadow runs {runner.runs} "
          f"(dropped busy {runner.dropped}, skipped by budget {runner.skipped_budget}), "
          f"errors {dict(runner.errors) or 0}/{shadow.errors}")
    print("shadow sampling: " + (sampling_summary(frame_of(sink.events, ShadowBudget)) or "no step sampled"))
    print(report(res, [Goal("on", 0.98)]))
    print(f"P99 decode step ms off {p99(steps['off']) / 1e6:.1f}, on {p99(steps['on']) / 1e6:.1f}; ratio = "
          f"{p99(steps['on']) / p99(steps['off']):.3f} (goal <= 1.05); median ratio "
          f"{statistics.median(steps['on']) / statistics.median(steps['off']):.3f}")

if __name__ == "__main__":
    main()
