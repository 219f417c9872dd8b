"""`kvdiag shadow`: run the embedded model in-process with shadow compression and locality.

Generates greedy answers to a few chat prompts on a DynamicCache, runs every configured
compressor on copies of the KV of sampled decode steps, then prints the per-layer-group table,
the recommendation, a locality summary and (with ``--logits``) teacher-forced KL / top-1
agreement per method. ``--log FILE`` records every event.

``--delta``: instead, play the demo's chat traffic (shared system prompts, multi-turn) on the
model with prefix sharing, write each conversation's KV blocks out after every turn and
measure what a writer needs per block (full, deduplicated, quantized delta against the most
similar stored block, delta against the block's previous version): ShadowDelta events and
the per-layer-group table (kvdiag.diagnosis.delta_writes).
"""

from __future__ import annotations

import json
import sys

from kvdiag.diagnosis.rules import COMPRESSION_ERROR_BUDGET
from kvdiag.commands._frame_table import COMPRESSION_COLUMNS, frame_table, table_console

DESCRIPTION = __doc__

PROMPTS = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a cat sleeping in the sun.",
    "List three uses of a paperclip.",
)

LOGITS_TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the centrepiece "
    "of the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution. "
    "Although initially criticised by some of France's leading artists and intellectuals for its "
    "design, it has since become a global cultural icon of France and one of the most "
    "recognisable structures in the world."
)


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="converted model folder (default: the kvdiag cache; `kvdiag fetch-model`)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many built-in prompts")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--document", help="a text file put in front of every prompt (long contexts, "
                                           "e.g. /usr/share/common-licenses/Apache-2.0)")
    parser.add_argument("--context-tokens", type=int, default=1024,
                        help="keep at most this many tokens of --document (default 1024)")
    parser.add_argument("--methods", default=None, help="comma-separated methods (default: all)")
    parser.add_argument("--sample-rate", type=float, default=0.25)
    parser.add_argument("--budget", type=float, default=None,
                        help="shadow CPU budget as a fraction of the process's other CPU time (default: none)")
    parser.add_argument("--groups", default="1-6,7-12,13+", help="1-based layer groups")
    parser.add_argument("--error-budget", type=float, default=COMPRESSION_ERROR_BUDGET,
                        help="attention-output relative error a recommended method may reach")
    parser.add_argument("--sparse-min-tokens", type=int, default=512)
    parser.add_argument("--logits", action="store_true", help="also teacher-forced KL / top-1 per method")
    parser.add_argument("--log", help="write every event to this event log")
    parser.add_argument("--json", action="store_true", help="print the tables as JSON")
    g = parser.add_argument_group("differential KV writes (--delta)")
    g.add_argument("--delta", action="store_true", help="measure differential KV block writes on demo chat "
                                                        "traffic instead of compression")
    g.add_argument("--turns", type=int, default=16, help="chat turns of the demo traffic plan (default 16)")
    g.add_argument("--seed", type=int, default=0, help="traffic plan seed (default 0)")
    g.add_argument("--block-tokens", type=int, default=32, help="tokens per KV block (default 32)")
    g.add_argument("--delta-bound", type=float, default=0.01,
                   help="delta error bound per element, as a fraction of the rms of its (K/V, head) "
                        "(default 0.01)")
    g.add_argument("--no-share", action="store_true", help="no prefix sharing: prefill every turn from scratch")


def run(args) -> int:
    """Check the options, load the model, then measure shadow compression (or, with --delta,
    differential KV writes)."""
    import torch

    from kvdiag.events.sinks import FanoutSink, ListSink

    methods = _methods(args)
    if methods is None:
        return 2
    torch.set_num_threads(1)
    loaded = _load_model(args)
    if isinstance(loaded, int):
        return loaded
    path, model, tokenizer = loaded
    memory = ListSink()
    writer = _open_log(args, model, path)
    sink = FanoutSink([memory] + ([writer] if writer else []))
    if args.delta:
        return _run_delta(args, model, tokenizer, sink, memory, writer)
    return _run_compression(args, methods, model, tokenizer, sink, memory, writer)


def _methods(args):
    """The compression methods asked for, once --methods, --groups and the --delta options are
    checked; None (said) when one is not valid."""
    from kvdiag.diagnosis import compression
    from kvdiag.kernels.methods import DEFAULT_METHODS, parse_methods

    try:
        methods = parse_methods(args.methods or ",".join(DEFAULT_METHODS))
        compression.parse_groups(args.groups)
    except ValueError as exc:
        print(f"kvdiag shadow: {exc}", file=sys.stderr)
        return None
    if args.delta and not (args.turns >= 1 and args.block_tokens >= 1 and 0 < args.delta_bound < 1):
        print("kvdiag shadow: --turns and --block-tokens must be >= 1 and --delta-bound in (0, 1)",
              file=sys.stderr)
        return None
    return methods


def _load_model(args):
    """(folder, model, tokenizer) of --model (fetched when it is the default), or the exit code
    (said): 2 for a folder that is not a model, 1 when the default model cannot be fetched."""
    from kvdiag.commands.fetch_model import resolve_with_progress
    from kvdiag.demo.smollm import ModelFetchError, load_model

    try:
        path = str(resolve_with_progress(args.model))
    except ModelFetchError as exc:
        print(f"kvdiag shadow: {exc}", file=sys.stderr)
        return 2 if args.model else 1
    try:
        model, tokenizer = load_model(path)
    except (OSError, ValueError) as exc:
        print(f"kvdiag shadow: {path}: expected a converted model folder ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''})", file=sys.stderr)
        return 2
    return path, model, tokenizer


def _open_log(args, model, path: str):
    """The event log of --log (its header names the model and its fp32 KV bytes per token), or None."""
    if not args.log:
        return None
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter

    from kvdiag.pool.kv_bytes import kv_bytes_per_token

    cfg = model.config
    bytes_per_token = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                         cfg.head_dim, "fp32")  # the model runs in fp32 on the CPU
    return LogWriter(args.log, make_header(engine="transformers-inprocess", model=path,
                                           bytes_per_token=bytes_per_token))


def _prompts(args, tokenizer):
    """The built-in prompts, each after the first --context-tokens tokens of --document when
    given; None (said) when the document cannot be read."""
    prompts = list(PROMPTS[: args.prompts])
    if args.document:
        try:
            text = open(args.document, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as exc:
            print(f"kvdiag shadow: {args.document}: expected a readable UTF-8 text file ({exc})", file=sys.stderr)
            return None
        doc = tokenizer.decode(tokenizer(text)["input_ids"][: args.context_tokens])
        prompts = [f"{doc}\n\n{p}" for p in prompts]
    return prompts


def _run_compression(args, methods, model, tokenizer, sink, memory, writer) -> int:
    """Generate answers with the shadow runner on sampled decode steps (and --logits), then print
    the per-group table, the recommendation, locality and logit agreement (or their JSON)."""
    from kvdiag.diagnosis import compression, locality
    from kvdiag.events.schema import ShadowCompression, ShadowLocality, ShadowLogits
    from kvdiag.shadow.hf_decoder import shadow_generate, shadow_logits
    from kvdiag.shadow.runner import ShadowRunner

    runner = ShadowRunner(sink, methods, sample_rate=args.sample_rate, budget_frac=args.budget)
    prompts = _prompts(args, tokenizer)
    if prompts is None:
        return 2
    result = shadow_generate(model, tokenizer, prompts, runner, args.max_new_tokens)
    if args.logits:
        shadow_logits(model, tokenizer(LOGITS_TEXT, return_tensors="pt")["input_ids"], methods, sink)
    if writer:
        writer.close()
    comp = compression.frame_of(memory.events, ShadowCompression)
    table = compression.compression_table(comp, args.groups)
    rec = compression.recommend(table, args.error_budget, sparse_min_tokens=args.sparse_min_tokens)
    loc = compression.frame_of(memory.events, ShadowLocality)
    logits = compression.logits_table(compression.frame_of(memory.events, ShadowLogits))
    if args.json:
        print(json.dumps({"table": table.to_dict("records"), "recommendation": rec.to_dict("records"),
                          "locality": locality.summary(loc), "top_heads": locality.top_heads(loc).to_dict("records"),
                          "logits": logits.to_dict("records"), "shadow_runs": runner.runs,
                          "shadow_errors": dict(runner.errors)}, default=str))
        return 0
    _print(result, runner, table, rec, loc, logits)
    return 0


def _print(result, runner, table, rec, loc, logits) -> None:
    from kvdiag.diagnosis import locality

    console = table_console()
    console.print(f"generated {result.decode_tokens} tokens at {result.tokens_per_s():.1f} tok/s; "
                  f"shadow ran on {runner.runs} steps, errors {dict(runner.errors) or 0}")
    console.print(frame_table("Shadow compression by layer group: means of relative errors (K, V, attention "
                              "output), attention TV distance, microseconds per layer-step", table,
                              COMPRESSION_COLUMNS))
    console.print(frame_table("Recommendation per layer group", rec))
    s = locality.summary(loc)
    if s:
        console.print(f"attention locality: recent-20% mass {s['recent_mass']:.3f}, sinks {s['sink_mass']:.3f}, "
                      f"other {s['other_mass']:.3f}; heads with recent mass >= 0.8: {s['heads_recent_ge_threshold']:.0%}")
        top = locality.top_heads(loc)
        console.print("top-3 heads' share of non-recent attention, layers 12+ (1-based): " + ", ".join(
            f"L{r.layer + 1}:{r.top_share:.2f}" for r in top.itertuples() if r.layer + 1 >= 12))
    if not logits.empty:
        console.print(frame_table("Teacher-forced next-token agreement with compressed prefix KV", logits))


def _run_delta(args, model, tokenizer, sink, memory, writer) -> int:
    from rich.progress import Progress

    from kvdiag.diagnosis import compression, delta_writes as delta
    from kvdiag.kernels.delta import DeltaWriter
    from kvdiag.shadow.delta_traffic import delta_traffic, demo_turns
    from kvdiag.events.schema import ShadowDelta

    dw = DeltaWriter(sink, bound=args.delta_bound)
    turns = demo_turns(args.turns, seed=args.seed)
    with Progress(transient=True, disable=args.json) as progress:
        task = progress.add_task("chat turns", total=len(turns))
        run = delta_traffic(model, tokenizer, dw, turns, max_new_tokens=args.max_new_tokens,
                            block_tokens=args.block_tokens, share_prefixes=not args.no_share,
                            on_turn=lambda r: progress.update(task, completed=r.turns))
    if writer:
        writer.close()
    table = delta.delta_table(compression.frame_of(memory.events, ShadowDelta), args.groups)
    info = {"turns": run.turns, "prompt_tokens": run.prompt_tokens, "reused_prompt_tokens": run.reused_tokens,
            "decode_tokens": run.decode_tokens, "blocks_seen": run.blocks_seen,
            "blocks_written": run.blocks_written, "model_s": run.model_ns / 1e9, "writer_s": run.writer_ns / 1e9,
            "block_tokens": args.block_tokens, "error_bound": args.delta_bound, "share_prefixes": not args.no_share}
    if args.json:
        print(json.dumps({"run": info, "table": table.to_dict("records")}, default=str))
        return 0
    console = table_console()
    console.print(f"{run.turns} turns, {run.prompt_tokens} prompt tokens ({run.reused_tokens} from shared "
                  f"blocks), {run.decode_tokens} generated; {run.blocks_written} of {run.blocks_seen} blocks "
                  f"written out; model {run.model_ns / 1e9:.1f} s, writer (shadow) {run.writer_ns / 1e9:.1f} s")
    cols = {"group": "group", "writes": "writes", "full_mib": "full MiB", "dedup_saving": "dedup",
            "delta_saving": "delta", "quant_saving": "quant only", "prev_saving": "prev-version",
            "delta_saving_rewrites": "delta (rewrites)", "attn_out_rel_error": "out err",
            "attn_out_rel_error_p95": "out err p95", "encode_us": "enc us", "decode_us": "dec us"}
    console.print(frame_table(f"Differential KV writes by layer group (1-based): savings vs full bytes; delta "
                              f"within {args.delta_bound:g} x rms per element", table, cols))
    return 0
