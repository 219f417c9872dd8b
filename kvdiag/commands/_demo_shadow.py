"""The shadow parts of `kvdiag demo`: flags, what the server gets, and the closing tables.

``--shadow`` runs shadow compression and locality inside the demo server (passed through
``python -m kvdiag.run --shadow ...``); at the end the per-layer-group table and the
recommendation are computed from the ShadowCompression events of the log.
``--shadow-logits`` loads the model in the demo process after the traffic, runs the
teacher-forced comparison (:func:`kvdiag.shadow.hf_decoder.shadow_logits`) on a fixed text,
appends the ShadowLogits events to the log and prints them.
"""

from __future__ import annotations

import sys
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--shadow", action="store_true",
                        help="shadow KV compression and attention locality on sampled decode steps of the "
                             "server's live paged KV; prints the per-layer-group table at the end")
    parser.add_argument("--shadow-methods", metavar="M", help="comma-separated compression methods "
                        "(default: fp16,bf16,fp8_e4m3,fp8_e5m2,int8,int4,int2,topk_norm,h2o,streaming)")
    parser.add_argument("--shadow-rate", type=float, default=0.05, metavar="R",
                        help="most share of decode steps sampled (default 0.05, so that a short demo shows "
                             "figures; a server's default is 0.005, which keeps sampled steps out of P99; "
                             "the CPU budget lowers it as needed)")
    parser.add_argument("--shadow-budget", type=float, default=0.01, metavar="F",
                        help="shadow CPU budget, fraction of the server's own CPU time (default 0.01; 0: none)")
    parser.add_argument("--shadow-layers", type=int, metavar="N",
                        help="layers measured per sampled step, spread over the depth and rotating "
                             "(default 3; 0: all)")
    parser.add_argument("--shadow-logits", action="store_true",
                        help="after the traffic, teacher-forced KL / top-1 agreement per method on a fixed "
                             "text (model loaded in the demo process)")


def check(args) -> str | None:
    """An error message for bad shadow flags, or None."""
    from kvdiag.kernels.methods import parse_methods

    if args.shadow_methods:
        try:
            parse_methods(args.shadow_methods)
        except ValueError as exc:
            return f"--shadow-methods: {exc}"
    if not 0.0 <= args.shadow_rate <= 1.0:
        return "--shadow-rate: expected a number in [0, 1]"
    if not 0.0 <= args.shadow_budget <= 1.0:
        return "--shadow-budget: expected a number in [0, 1]"
    if args.shadow_layers is not None and args.shadow_layers < 0:
        return "--shadow-layers: expected 0 (all) or more"
    return None


def agent_args(args) -> list[str]:
    """Options for ``python -m kvdiag.run``."""
    if not args.shadow:
        return []
    out = ["--shadow", "--shadow-rate", str(args.shadow_rate), "--shadow-budget", str(args.shadow_budget)]
    if args.shadow_layers is not None:
        out += ["--shadow-layers", str(args.shadow_layers)]
    if args.shadow_methods:
        out += ["--shadow-methods", args.shadow_methods]
    return out


def vllm_env(args) -> dict[str, str]:
    """The same options for vLLM's worker shadow (its environment variables,
    :func:`kvdiag.collectors.vllm_worker.shadow_options`); ``--shadow-budget 0`` is none."""
    if not args.shadow:
        return {}
    env = {"KVDIAG_SHADOW": "1", "KVDIAG_SHADOW_RATE": str(args.shadow_rate),
           "KVDIAG_SHADOW_BUDGET": str(args.shadow_budget)}
    if args.shadow_layers is not None:
        env["KVDIAG_SHADOW_LAYERS"] = str(args.shadow_layers)
    if args.shadow_methods:
        env["KVDIAG_SHADOW_METHODS"] = args.shadow_methods
    return env


def _methods(args) -> list[str]:
    from kvdiag.kernels.methods import DEFAULT_METHODS

    return args.shadow_methods.split(",") if args.shadow_methods else list(DEFAULT_METHODS)


def run_logits(model_dir: Path, log_path: Path, args) -> int:
    """Teacher-forced ShadowLogits per method; appended to the log, printed."""
    import msgspec
    import torch

    from kvdiag.commands.shadow import LOGITS_TEXT
    from kvdiag.shadow.hf_decoder import shadow_logits
    from kvdiag.demo.smollm import load_model
    from kvdiag.events.sinks import ListSink

    torch.set_num_threads(max(1, args.threads))
    model, tokenizer = load_model(model_dir)
    sink = ListSink()
    ids = tokenizer(LOGITS_TEXT, return_tensors="pt")["input_ids"]
    shadow_logits(model, ids, _methods(args), sink)
    encoder = msgspec.json.Encoder()
    if log_path.exists():
        from kvdiag.events.log_writer import open_for_append

        with open_for_append(log_path) as f:
            f.write(b"".join(encoder.encode(ev) + b"\n" for ev in sink.events))
    return len(sink.events)


def print_tables(log_path: Path, shadow: bool, logits: bool) -> None:
    """The compression table + recommendation (``shadow``) and the logits table (``logits``)."""
    from kvdiag.diagnosis import compression, locality
    from kvdiag.diagnosis.rules import COMPRESSION_ERROR_BUDGET
    from kvdiag.commands._frame_table import COMPRESSION_COLUMNS, frame_table, table_console
    from kvdiag.events.eventlog import read_log

    log = read_log(log_path, types=["shadow_compression", "shadow_locality", "shadow_logits",
                                    "shadow_budget", "collector_error", "kv_pool_info"])
    console = table_console()

    def show(title, frame, columns=None):
        console.print(frame_table(title, frame, columns, digits=3))

    if shadow:
        comp = log.frame("shadow_compression")
        errors = log.frame("collector_error")
        errors = errors[errors["collector"].str.startswith("shadow")] if not errors.empty else errors
        steps = comp["ts_ns"].nunique() if not comp.empty else 0
        print(f"shadow: {steps} sampled decode steps measured, {len(errors)} shadow errors")
        sampling = compression.sampling_summary(log.frame("shadow_budget"))
        if sampling:
            print(f"shadow: {sampling}")
        if comp.empty:
            print("shadow: no sampled decode step yet (more traffic or a higher --shadow-rate)")
        else:
            table = compression.compression_table(comp)
            show("Shadow compression by layer group (1-based): mean relative errors (K, V, attention "
                 "output), attention TV distance, microseconds per layer-step", table, COMPRESSION_COLUMNS)
            show(f"Recommendation per layer group (attn_out_rel_error <= {COMPRESSION_ERROR_BUDGET:g})",
                 compression.recommend(table))
            line = _engine_line(log, table)
            if line:
                print(line)
        s = locality.summary(log.frame("shadow_locality"))
        if s:
            print(f"attention locality: recent-20% mass {s['recent_mass']:.3f}, sinks {s['sink_mass']:.3f}, "
                  f"other {s['other_mass']:.3f}")
    if logits:
        show("Teacher-forced next-token agreement with compressed prefix KV",
             compression.logits_table(log.frame("shadow_logits")))
    sys.stdout.flush()


def _engine_line(log, table) -> str | None:
    """On vLLM: the one ``--kv-cache-dtype`` that realises the recommendation for every layer
    and the pool capacity it frees (:func:`kvdiag.diagnosis.compression.engine_recommendation`)."""
    from kvdiag.diagnosis import compression

    if log.header.engine != "vllm":
        return None
    rec = compression.engine_recommendation_on_pool(table, "vllm", log.frame("kv_pool_info"))
    if rec.empty:
        return None
    row = rec.iloc[0]
    if row["setting"] is None:
        return f"in vLLM's terms: {row['reason']}"
    frees = (f", frees {row['frees_bytes'] / 2**20:.1f} MiB of the {row['kv_bytes'] / 2**20:.1f} MiB pool "
             f"(or holds {row['extra_tokens']:,.0f} more tokens)" if row["frees_bytes"] is not None else "")
    return (f"in vLLM's terms: {row['setting']} for every layer (ratio {row['ratio']:.2f}, worst "
            f"{row['error']:.3g} in layers {row['worst_group']}){frees}")
