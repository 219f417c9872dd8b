"""Cost of the transformers-cb adapter: the demo workload's generated tokens/s with and without
the hooks, measured side by side in one process (runs alternate, A B A B ...), ratio printed.

    .venv/bin/python benchmarks/bench_hooks.py [--requests 8] [--max-tokens 16] [--rounds 2]

With hooks, events go where the agent sends them: a LogWriter to a temporary log file.
Tokens/s = generated tokens / wall-clock time of ``generate_batch`` (1 torch thread). On a shared
machine wall-clock time swings by tens of percent between runs, so the script also reports
tokens per CPU-second of this process (``time.process_time``: all its threads, including the
engine's generation thread and the log writer), which other processes do not inflate.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def demo_prompts(tokenizer, num_requests: int, seed: int) -> list[list[int]]:
    """First turns of the demo's chat traffic (shared system prompts, short and long questions)."""
    from kvdiag.demo.traffic import TrafficPlan

    prompts = []
    for planned in TrafficPlan(seed=seed, rate_per_s=1.0).requests():
        if planned.turn:
            continue
        conv = planned.conversation
        ids = tokenizer.apply_chat_template(conv.messages + [{"role": "user", "content": conv.user_turns[0]}],
                                            add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
        if len(prompts) == num_requests:
            return prompts
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

    from kvdiag.collectors.transformers_cb import install
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.demo.smollm import ensure_model

    torch.set_num_threads(1)
    model_dir = ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    prompts = demo_prompts(tokenizer, args.requests, args.seed)
    gen = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=-1)

    def run_once(hooked: bool, log_path: Path) -> tuple[float, float]:
        cb = ContinuousBatchingConfig(page_size=32, num_blocks=256, max_batch_tokens=256)
        writer = adapter = None
        if hooked:
            writer = LogWriter(log_path, make_header(engine="transformers-cb", model=str(model_dir)))
            adapter = install(writer)
        try:
            start, cpu_start = time.perf_counter(), time.process_time()
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=False)
            wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        finally:
            if adapter is not None:
                adapter.uninstall()
            if writer is not None:
                writer.close()
        tokens = sum(len(o.generated_tokens) for o in out.values())
        return tokens / wall_s, tokens / cpu_s

    run_once(False, Path("/dev/null"))  # warm-up, not counted
    plain, hooked = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            plain.append(run_once(False, Path(tmp) / "unused"))
            hooked.append(run_once(True, Path(tmp) / f"hooked-{i}.kvlog"))
            print(f"round {i}: without hooks {plain[-1][0]:.2f} tok/s ({plain[-1][1]:.2f} tok/cpu-s), "
                  f"with hooks {hooked[-1][0]:.2f} tok/s ({hooked[-1][1]:.2f} tok/cpu-s)")
    print(f"prompts {len(prompts)} (tokens {sum(map(len, prompts))}), {args.max_tokens} new tokens each")
    for label, k in (("tokens/s (wall)", 0), ("tokens/cpu-s", 1)):
        ratio = statistics.median(h[k] for h in hooked) / statistics.median(p[k] for p in plain)
        print(f"{label} with hooks / without = {ratio:.3f} ({(1 - ratio) * 100:+.1f}% slower)")


if __name__ == "__main__":
    main()
