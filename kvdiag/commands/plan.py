"""`kvdiag plan`: how much KV memory a workload needs on a model, and how many GPUs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from kvdiag.commands._logs import add_input_arguments, skipped_lines, tell_skipped

DESCRIPTION = """\
Plan KV cache capacity: simulate the requests of a workload (arrivals, prompt and output
lengths) on a model and print the KV memory live requests hold (peak and P99), the GPUs that
holds, and the same with prefix sharing and with compression. Every assumption is printed.

  KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element

A request holds its prompt from arrival, then one more token per decode step until it
finishes, rounded up to blocks. Workloads: --qps with --prompt-tokens / --output-tokens
(N, fixed:N, lognormal:MEDIAN,SIGMA), or --trace (Mooncake JSONL, token-id JSONL, a kvdiag
log); --trace with --qps resamples the trace's (prompt, output) pairs at that QPS.
Models: gpt3-175b, llama3-8b, llama3-70b, smollm2-135m, or a config.json path.
Exit codes: 0 done, 2 bad input (a missing or unreadable file, a malformed line, a bad value).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="NAME|CONFIG",
                        help="built-in model name or an HF config.json (file or folder); "
                             "default for a kvdiag log: the shape its kv_pool_info states")
    parser.add_argument("--dtype", help="KV dtype: fp32, fp16, bf16, fp8, int8 (default: the "
                                        "model's, or the log's pool dtype)")
    parser.add_argument("--trace", metavar="FILE", help="Mooncake, token-id or kvdiag log trace")
    parser.add_argument("--format", choices=("mooncake", "tokens", "kvdiag"),
                        help="trace format (default: detected from its first line)")
    parser.add_argument("--qps", type=float, help="requests per second (Poisson arrivals)")
    parser.add_argument("--requests", type=int, default=20000,
                        help="synthetic requests to simulate with --qps (default 20000)")
    parser.add_argument("--prompt-tokens", default="512", metavar="DIST",
                        help="prompt lengths with --qps: N, fixed:N or lognormal:MEDIAN,SIGMA "
                             "(default 512)")
    parser.add_argument("--output-tokens", default=None, metavar="DIST",
                        help="output lengths with --qps (default 128), or for token-id traces "
                             "without output_tokens")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--block-size", type=int, metavar="TOKENS",
                        help="KV block size in tokens (default 16, or the log's)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="memory per GPU in GiB (default 80)")
    parser.add_argument("--kv-share", type=float, default=0.5,
                        help="fraction of each GPU's memory given to KV (default 0.5)")
    parser.add_argument("--gpus-per-server", type=int, default=8, help="default 8")
    parser.add_argument("--decode-ms-per-token", type=float,
                        help="time between two output tokens of one request (default 20, or "
                             "measured on a kvdiag log's requests)")
    parser.add_argument("--prefill-ms-per-token", type=float,
                        help="time to first token per prompt token (default 0, or measured "
                             "on a kvdiag log's requests)")
    parser.add_argument("--timing", choices=("recorded", "model"),
                        help="recorded: a log's own first-token and finish times (default for "
                             "a kvdiag log); model: the decode/prefill rates above")
    parser.add_argument("--sharing-hit-rate", type=float, metavar="H",
                        help="measured prefix-sharing token hit rate in [0, 1) (default: exact "
                             "from the trace's prompt content, or a log's shadow_sharing)")
    parser.add_argument("--compression-ratio", type=float, metavar="R",
                        help="KV compression ratio >= 1 (default: the recommendation from a "
                             "log's shadow_compression events, if any)")
    parser.add_argument("--pool-blocks", type=int, metavar="N",
                        help="what-if: replay the demand against a KV pool of N blocks (time "
                             "over it, requests preempted or OOM, headroom needed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_input_arguments(parser)


class _BadInput(ValueError):
    """A bad option value or input; the message names it."""


def _check_options(args) -> None:
    checks = [
        (args.qps is not None and not (args.qps > 0 and args.qps < float("inf")),
         f"--qps {args.qps}: expected a positive number of requests per second"),
        (args.requests < 1, f"--requests {args.requests}: expected at least 1"),
        (args.block_size is not None and args.block_size < 1,
         f"--block-size {args.block_size}: expected at least 1 token"),
        (not args.gpu_memory_gib > 0, f"--gpu-memory-gib {args.gpu_memory_gib}: expected > 0"),
        (not 0 < args.kv_share <= 1, f"--kv-share {args.kv_share}: expected a fraction in (0, 1]"),
        (args.gpus_per_server < 1, f"--gpus-per-server {args.gpus_per_server}: expected >= 1"),
        (args.decode_ms_per_token is not None and not args.decode_ms_per_token >= 0,
         f"--decode-ms-per-token {args.decode_ms_per_token}: expected >= 0"),
        (args.prefill_ms_per_token is not None and not args.prefill_ms_per_token >= 0,
         f"--prefill-ms-per-token {args.prefill_ms_per_token}: expected >= 0"),
        (args.sharing_hit_rate is not None and not 0 <= args.sharing_hit_rate < 1,
         f"--sharing-hit-rate {args.sharing_hit_rate}: expected a fraction in [0, 1)"),
        (args.compression_ratio is not None and not args.compression_ratio >= 1,
         f"--compression-ratio {args.compression_ratio}: expected a ratio >= 1"),
        (args.pool_blocks is not None and args.pool_blocks < 0,
         f"--pool-blocks {args.pool_blocks}: expected >= 0"),
        (args.trace is None and args.qps is None, "expected --qps or --trace (a workload)"),
    ]
    for bad, message in checks:
        if bad:
            raise _BadInput(message)


def run(args: argparse.Namespace) -> int:
    from kvdiag.pool.kv_shape import ModelConfigError
    from kvdiag.traces.lines import ReadOptions, TraceFormatError
    from kvdiag.traces.workload import WorkloadError
    from kvdiag.events.eventlog import LogFormatError

    read = ReadOptions(strict=args.strict, partial=args.partial)
    try:
        _check_options(args)
        plan = _build_plan(args, read)
    except (_BadInput, ModelConfigError, WorkloadError, TraceFormatError, LogFormatError) as exc:
        print(f"kvdiag plan: {exc}", file=sys.stderr)
        return 2
    tell_skipped("plan", read.problems)
    try:
        if args.json:
            from kvdiag.simulation.capacity_plan import to_json

            out = to_json(plan)
            out["skipped_lines"] = skipped_lines(read.problems)
            print(json.dumps(out, indent=1))
        else:
            from kvdiag.commands._plan_table import print_plan

            print_plan(plan)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _detect(path: str) -> str:
    from kvdiag.traces.detect import detect_format

    fmt = detect_format(path)
    if fmt not in ("mooncake", "tokens", "kvdiag"):
        raise _BadInput(f"{path}:1: expected a Mooncake, token-id or kvdiag trace, found a "
                        f"{fmt} trace (no request lengths in it)")
    return fmt


def _build_plan(args, read):
    from kvdiag.traces import workload as W
    from kvdiag.pool.kv_shape import resolve_model, shape_from_pool
    from kvdiag.simulation.capacity_plan import PlanSettings, derived_timing, make_plan

    model = resolve_model(args.model) if args.model else None
    logs = None
    block_size = args.block_size
    fmt = None
    if args.trace is not None:
        if not os.path.exists(args.trace):
            raise _BadInput(f"{args.trace}: no such file")
        fmt = args.format or _detect(args.trace)
    if fmt == "kvdiag":
        logs = _read_log(args, read)
        node = logs.nodes[0]
        block_size = block_size or logs.block_size_tokens(node) or 16
        if model is None:
            model = _log_model(logs, shape_from_pool)
    block_size = block_size or 16
    if model is None:
        raise _BadInput("expected --model (a built-in name or a config.json)")
    dtype = args.dtype or model.dtype
    settings = PlanSettings(dtype=dtype, block_size_tokens=block_size,
                            gpu_memory_gib=args.gpu_memory_gib, kv_share=args.kv_share,
                            gpus_per_server=args.gpus_per_server, pool_blocks=args.pool_blocks)
    output_dist = args.output_tokens or "128"
    if fmt == "mooncake":
        work = W.load_mooncake(args.trace, block_size, read)
    elif fmt == "tokens":
        work = W.load_tokens(args.trace, block_size, args.output_tokens, args.seed, read)
    elif fmt == "kvdiag":
        work = W.from_logs(logs, block_size, args.trace)
    else:
        work = W.synthetic(args.qps, args.requests, args.prompt_tokens, output_dist, args.seed)
    if fmt is not None and args.qps is not None:
        work = W.resampled(work, args.qps, args.requests, args.seed)
    _set_timing(args, settings, work, derived_timing)
    _set_sharing(args, settings, logs, work)
    _set_compression(args, settings, logs, model)
    return make_plan(work, model, settings)


def _read_log(args, read):
    from kvdiag.commands._logs import read_logs

    logs, problems = read_logs([args.trace], quiet=args.json, allow_truncated=args.partial,
                               strict=args.strict)
    read.problems.extend(problems)
    return logs


def _log_model(logs, shape_from_pool):
    info = logs.frame("kv_pool_info")
    if info.empty:
        raise _BadInput("expected --model: the log has no kv_pool_info event stating the "
                        "model's KV shape")
    row = info.iloc[-1]
    header = logs.headers[logs.nodes[0]]
    name = os.path.basename(header.model.rstrip("/")) if header.model else None
    return shape_from_pool(int(row["num_layers"]), int(row["num_kv_heads"]), int(row["head_dim"]),
                           str(row["dtype"]), name)


def _set_timing(args, settings, work, derived_timing) -> None:
    recorded = work.recorded_timing and args.qps is None
    mode = args.timing or ("recorded" if recorded else "model")
    if mode == "recorded" and not recorded:
        raise _BadInput("--timing recorded: expected a kvdiag log (with request_first_token/"
                        "finished times) and no --qps")
    settings.timing = mode
    decode, prefill = (derived_timing(work) if work.recorded_timing else (None, None))
    if args.decode_ms_per_token is not None:
        settings.decode_s_per_token, settings.decode_source = args.decode_ms_per_token / 1e3, "--decode-ms-per-token"
    elif decode is not None:
        settings.decode_s_per_token = decode
        settings.decode_source = "median over the log's requests of (finish - first token) / output tokens"
    else:
        settings.decode_s_per_token, settings.decode_source = 0.02, "assumed default: 50 tokens/s per request"
    if args.prefill_ms_per_token is not None:
        settings.prefill_s_per_token = args.prefill_ms_per_token / 1e3
    elif prefill is not None:
        settings.prefill_s_per_token = prefill


def _set_sharing(args, settings, logs, work) -> None:
    """Sharing from, in order: --sharing-hit-rate; the trace's prompt content (exact); a
    log's last shadow_sharing event (unbounded capacity preferred)."""
    if args.sharing_hit_rate is not None:
        settings.sharing_hit_rate, settings.sharing_source = args.sharing_hit_rate, "--sharing-hit-rate"
        return
    if logs is None or work.prompt_keys is not None:
        return
    events = logs.frame("shadow_sharing")
    if events.empty:
        return
    unbounded = events[events["capacity_blocks"].isna()]
    last = (unbounded if len(unbounded) else events).iloc[-1]
    settings.sharing_hit_rate = float(last["token_hit_rate"])
    settings.sharing_source = (f"the log's last shadow_sharing event, {last['policy']} at "
                               f"capacity {last['capacity_blocks'] if len(unbounded) == 0 else 'unbounded'}")


def _set_compression(args, settings, logs, model) -> None:
    if args.compression_ratio is not None:
        settings.compression_ratio, settings.compression_source = args.compression_ratio, "--compression-ratio"
        return
    if logs is None or logs.frame("shadow_compression").empty:
        return
    ratio = _recommended_ratio(logs.frame("shadow_compression"), model.num_layers)
    if ratio is not None:
        settings.compression_ratio = ratio
        settings.compression_source = ("the log's shadow_compression recommendation per layer "
                                       "group (1-6, 7-12, 13+), bytes weighted by layers")


def _recommended_ratio(events, num_layers: int) -> Optional[float]:
    """Overall ratio of the recommended method per layer group: layers / sum(layers_g / r_g)."""
    from kvdiag.diagnosis.compression import ARTICLE_GROUPS, compression_table, parse_groups, recommend

    rec = recommend(compression_table(events))
    if rec.empty:
        return None
    ratios = dict(zip(rec["group"], rec["ratio"]))
    layers_total, stored = 0, 0.0
    for label, first, last in parse_groups(ARTICLE_GROUPS, num_layers):
        n = max(0, min(last, num_layers) - first + 1)
        layers_total += n
        stored += n / float(ratios.get(label, 1.0))
    return layers_total / stored if stored > 0 else None
