"""`kvdiag replay --similarity`: K/V cosine similarity at the first positions of a trace's
prompts, with and without a shared system prompt, on the real model."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvdiag.commands._logs import skipped_lines, tell_skipped


def run(args: argparse.Namespace, read) -> int:
    """K/V cosine similarity of the trace's prompts on the real model (module docstring of
    kvdiag.diagnosis.similarity has the definition)."""
    import msgspec

    from kvdiag.diagnosis.similarity import kv_similarity
    from kvdiag.traces.lines import TraceFormatError
    from kvdiag.traces.loaders import prompt_token_ids
    from kvdiag.demo.smollm import load_model

    try:
        prompts = prompt_token_ids(args.trace, args.format, read)
    except TraceFormatError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    tell_skipped("replay", read.problems)
    from kvdiag.commands.fetch_model import resolve_with_progress
    from kvdiag.demo.smollm import ModelFetchError

    try:
        model, tokenizer = load_model(resolve_with_progress(None))
    except (ModelFetchError, OSError) as exc:
        print(f"kvdiag replay --similarity: the real model is not available ({exc})", file=sys.stderr)
        return 1
    res = kv_similarity(model, tokenizer, prompts, positions=args.positions, offset=args.offset,
                        min_shared_tokens=args.min_shared_tokens)
    events = res.events(time.time_ns())
    if args.json:
        print(json.dumps({"similarity": msgspec.to_builtins(events),
                          "skipped_lines": skipped_lines(read.problems)}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    f = res.frame
    table = Table(show_edge=False, title=f"K/V cosine similarity at positions {args.offset}.."
                  f"{args.offset + args.positions - 1} (mean over KV heads, positions and pairs)")
    for col in ("layer", "same prompt K", "same prompt V", "different K", "different V"):
        table.add_column(col, justify="right")
    for layer in sorted(f.layer.unique()):
        row = [str(layer)]
        for same in (True, False):
            g = f[(f.layer == layer) & (f.same_prompt == same)]
            if g.empty:
                row += ["-", "-"]
            else:
                row += [f"{g.k_cosine.item():.3f}", f"{g.v_cosine.item():.3f}"]
        table.add_row(*row)
    console = Console()
    console.print(table)
    pairs = f.groupby("same_prompt").pairs.first().to_dict()
    console.print(f"pairs: {pairs.get(True, 0)} sharing >= {res.min_shared_tokens} leading tokens "
                  f"(a system prompt), {pairs.get(False, 0)} not")
    return 0
