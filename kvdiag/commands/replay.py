"""`kvdiag replay`: a recorded trace through shadow prefix caches."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Optional

from kvdiag.commands._logs import add_input_arguments, skipped_lines, tell_skipped
from kvdiag.pool.hit_rate import engine_token_hit_rate
from kvdiag.events.units import BYTE_UNITS, format_bytes

DESCRIPTION = """\
Replay a trace through shadow prefix caches and print hit rates per policy and capacity.

A request reuses the longest run of its leading blocks that are cached (chained content keys:
equal keys = equal prefixes) and stops at the first miss; then all its blocks are touched or
inserted and the cache evicts to its capacity.

  block hit rate   = prefix-hit blocks / referenced blocks
  token hit rate   = hit tokens / prompt tokens (a hit block counts min(block size,
                     remaining prompt) tokens; prompt tails shorter than a block never hit)
  request hit rate = mean over requests of (request's hit tokens / its prompt tokens)
  bytes saved      = hit tokens x KV bytes per token (KV not recomputed)
  memory reduction = 1 - peak blocks held by live requests with sharing / without

Policies: lru, fifo, lfu, s3fifo, opt (Belady, the upper bound); plug-ins written in Python:
lecar (regret-weighted LRU/LFU), prefix-lru (evicts chain tails first), lru-plugin,
fifo-plugin, lfu-plugin (the classics in the plug-in API), and your own with --policy-file
(docs/policies.md).
Formats (auto-detected): kvdiag (event log), mooncake, tokens ({"timestamp", "token_ids"}
JSONL), vllm (KV events JSONL). A kvdiag log recorded by default holds salted hashes of
16-token chunks instead of token ids: --block-size must then be a multiple of 16, and the
rows are those the token ids would give.
"""



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE", help="trace file (.gz too)")
    parser.add_argument("--format", choices=("kvdiag", "mooncake", "tokens", "vllm"),
                        help="input format (default: detected from the first line)")
    parser.add_argument("--block-size", type=int, metavar="N",
                        help="block size in tokens to re-chunk token ids at (default: the "
                             "engine's, 16 for token-id traces, 512 for Mooncake)")
    parser.add_argument("--policy", action="append", metavar="P",
                        choices=("lru", "fifo", "lfu", "s3fifo", "opt", "lecar", "prefix-lru",
                                 "lru-plugin", "fifo-plugin", "lfu-plugin"),
                        help="eviction policy; repeat for several (default: lru, or lru, "
                             "s3fifo and opt beside --policy-file)")
    parser.add_argument("--policy-file", action="append", metavar="FILE",
                        help="a Python file defining kvdiag.simulation.policies.Policy subclasses "
                             "to replay too (it is code and runs as you: see docs/policies.md); "
                             "repeat for several")
    parser.add_argument("--capacity", action="append", metavar="C",
                        help="cache capacity: blocks (1000), bytes (4GiB, 500MB) or "
                             "'unbounded'; repeat for several (default: unbounded)")
    parser.add_argument("--bytes-per-token", type=int, metavar="B",
                        help="KV bytes per token over all layers, K and V (default: the log "
                             "header's); needed for capacities in bytes and bytes saved")
    parser.add_argument("--hash", choices=("fast", "blake2b", "sha256"), default="fast",
                        help="chunk hash for token ids (default: fast; a hashed log keeps its own)")
    parser.add_argument("--concurrency", type=int, default=8, metavar="N",
                        help="for traces without finish times: a request holds its blocks "
                             "until N later requests arrived (memory reduction; default 8)")
    parser.add_argument("--curve", action="store_true",
                        help="hit rate vs capacity (LRU in one pass; other policies per point)")
    parser.add_argument("--similarity", action="store_true",
                        help="cosine similarity of K/V at the first positions of requests "
                             "with and without a shared prompt, on the real model (kvdiag logs "
                             "recorded with --record-tokens: it needs the token ids)")
    parser.add_argument("--positions", type=int, default=10, metavar="N",
                        help="positions compared by --similarity (default 10)")
    parser.add_argument("--offset", type=int, default=0, metavar="N",
                        help="--similarity compares positions N..N+positions-1 (default 0)")
    parser.add_argument("--min-shared-tokens", type=int, default=16, metavar="N",
                        help="--similarity: two requests share a system prompt when their first "
                             "N tokens are equal (default 16)")
    parser.add_argument("--tiers", metavar="SPEC",
                        help="tiered what-if instead of policies: NAME=CAP[,BW],... top tier "
                             "first, e.g. gpu=2000,cpu=40GiB,25GB/s,disk=unbounded,3GB/s; CAP in "
                             "blocks, bytes (needs the bytes per token) or unbounded; BW = bytes/s "
                             "of reading the tier into the top one (docs/tiers.md)")
    parser.add_argument("--tier-write", choices=("back", "through"), default="back",
                        help="lower tiers: write-back (a block goes down only when evicted; "
                             "default) or write-through (every new block is stored below at once)")
    parser.add_argument("--prefill-s-per-token", type=float, metavar="S",
                        help="--tiers: prefill seconds per prompt token (default: fitted on a "
                             "kvdiag log's engine steps)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of a table: the trace's counts, "
                             "\"rows\" (one per policy and capacity, or curve point) and "
                             "\"skipped_lines\" ({\"count\", \"first\"})")
    add_input_arguments(parser)


def parse_capacity(text: str) -> tuple[Optional[int], Optional[int]]:
    """'1000' -> (1000 blocks, None); '4GiB' -> (None, bytes); 'unbounded' -> (None, None)."""
    t = text.strip().lower()
    if t in ("unbounded", "none", "inf", "infinite"):
        return None, None
    if re.fullmatch(r"\d+", t):
        return int(t), None
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmgt]i?b|b)", t)
    if not m:
        raise ValueError(f"expected a capacity like 1000 (blocks), 4GiB, 500MB or unbounded, "
                         f"got {text!r}")
    return None, int(float(m.group(1)) * BYTE_UNITS[m.group(2)])


def _grid(distinct: int, points: int = 24) -> list[int]:
    """Log-spaced capacities 0..distinct (exact integers, deduplicated)."""
    if distinct <= 0:
        return [0]
    raw = [0] + [round(math.exp(math.log(distinct) * k / (points - 1))) for k in range(points)]
    return sorted(set(raw))


def _curve_grid(args, capacities, distinct: int) -> list[int]:
    """The capacities a curve is printed at: those given, else log-spaced up to all blocks."""
    if args.capacity:
        return [c for c in capacities if c is not None]
    return _grid(distinct)


def _progress(total: Optional[int], quiet: bool):
    """A rich progress bar on stderr for long work (a no-op callback when quiet); ``total``
    None = unknown (a streamed trace): the bar counts block references."""
    if quiet or (total is not None and total < 2_000_000) or not sys.stderr.isatty():
        return None, (lambda n: None)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("replay"), BarColumn(), TextColumn("{task.completed:,} block refs"),
                   TimeRemainingColumn(), transient=True, console=Console(stderr=True))
    bar.start()
    task = bar.add_task("replay", total=total)
    return bar, (lambda n: bar.advance(task, n))


def _policies(args) -> list:
    """The policies to replay, in order: built-in names (str) and plug-in classes (the names of
    shipped plug-ins, then every policy of each --policy-file)."""
    from kvdiag.simulation.policy_replay import load_policy_file, plugin_by_name

    names = args.policy or (["lru", "s3fifo", "opt"] if args.policy_file else ["lru"])
    out = [plugin_by_name(n) or n for n in names]
    for path in args.policy_file or []:
        out += load_policy_file(path)
    return out


def _streamable(args, fmt: str, policies: list) -> bool:
    """Mooncake and token-id traces replay while being read (memory ~ distinct blocks), except
    for OPT (needs the future), plug-ins (replayed in Python over the loaded trace) and curves
    of other policies (need the distinct count first)."""
    if fmt not in ("mooncake", "tokens") or "opt" in policies or \
            not all(isinstance(p, str) for p in policies):
        return False
    return not args.curve or set(policies) == {"lru"}


def run(args: argparse.Namespace) -> int:
    from kvdiag.simulation.policy_replay import PolicyError
    from kvdiag.traces.loaders import ReadOptions, TraceFormatError, detect_format

    read = ReadOptions(strict=args.strict, partial=args.partial)
    try:
        caps = [parse_capacity(c) for c in (args.capacity or ["unbounded"])]
    except ValueError as exc:
        print(f"kvdiag replay: {exc}", file=sys.stderr)
        return 2
    if args.similarity:
        return _run_similarity(args, read)
    if args.tiers:
        return _run_tiers(args, read)
    try:
        policies = _policies(args)
    except PolicyError as exc:
        print(f"kvdiag replay: {exc}", file=sys.stderr)
        return 2
    try:
        fmt = args.format or detect_format(args.trace)
        if _streamable(args, fmt, policies):
            rows, info = _replay_streamed(args, fmt, policies, caps, read)
        else:
            rows, info = _replay_loaded(args, fmt, policies, caps, read)
        if read.problems and not info["requests"]:
            raise TraceFormatError(f"{args.trace}: expected at least one readable request, found "
                                   f"only unreadable lines (first: {read.problems[0]})")
    except TraceFormatError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except _Usage as exc:
        print(f"{args.trace}:1: {exc}", file=sys.stderr)
        return 2
    except PolicyError as exc:
        print(f"kvdiag replay: {exc}", file=sys.stderr)
        return 2
    tell_skipped("replay", read.problems)
    try:
        if args.json:
            print(json.dumps(_json_object(info, rows, read.problems), indent=1, default=float))
        else:
            _print_table(info, rows, args.curve)
        sys.stdout.flush()
    except BrokenPipeError:  # `kvdiag replay ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _json_object(info: dict, rows: list[dict], problems: list[str]) -> dict:
    """``replay --json``: the trace's counts, one row per policy and capacity (or curve
    point), and the lines skipped."""
    keys = ("source", "format", "requests", "block_refs", "distinct_blocks",
            "block_size_tokens", "engine_hit_rate", "notes")
    out = {k: info[k] for k in keys}
    fp = info["footprint"]
    out["memory_footprint"] = {"concurrency_model": fp.concurrency_model,
                               "peak_unshared_blocks": fp.peak_unshared_blocks,
                               "peak_shared_blocks": fp.peak_shared_blocks,
                               "reduction": fp.reduction}
    out["rows"] = rows
    out["skipped_lines"] = skipped_lines(problems)
    return out


class _Usage(ValueError):
    """An option the trace cannot honour."""


def _capacities(caps, block_size: int, bpt: Optional[int]) -> list[Optional[int]]:
    out = []
    for blocks, nbytes in caps:
        if nbytes is not None:
            if not bpt:
                raise _Usage("expected --bytes-per-token (or a log header with bytes_per_token) "
                             "for a capacity in bytes")
            blocks = nbytes // (block_size * bpt)
        out.append(blocks)
    return out


def _replay_streamed(args, fmt, policies, caps, read):
    from kvdiag.simulation import sharing
    from kvdiag.traces.loaders import iter_requests

    block_size, records = iter_requests(args.trace, fmt, args.block_size, args.hash, read)
    bpt = args.bytes_per_token
    capacities = _capacities(caps, block_size, bpt)
    bar, tick = _progress(None, args.json)
    try:
        replay = sharing.replay_stream(records, block_size, policies,
                                       [] if args.curve else capacities, curve=args.curve,
                                       concurrency=args.concurrency, bytes_per_token=bpt,
                                       progress=tick)
    finally:
        if bar is not None:
            bar.stop()
    if args.curve:
        curve = replay.curve()
        grid = _curve_grid(args, capacities, curve.distinct_blocks)
        rows = [curve.at(c) for c in grid]
    else:
        rows = [r.to_json() for r in replay.results()]
    info = {"source": str(args.trace), "format": fmt, "requests": replay.requests,
            "block_refs": replay.block_refs, "distinct_blocks": replay.distinct_blocks,
            "block_size_tokens": block_size, "footprint": replay.footprint(),
            "engine_hit_rate": None, "notes": []}
    return rows, info


def _replay_loaded(args, fmt, policies, caps, read):
    from kvdiag.simulation import sharing
    from kvdiag.traces.loaders import load_trace

    trace = load_trace(args.trace, format=fmt, block_size_tokens=args.block_size,
                       hash_algorithm=args.hash, read=read)
    bpt = args.bytes_per_token or trace.bytes_per_token
    capacities = _capacities(caps, trace.block_size_tokens, bpt)
    if args.curve:
        grid = _curve_grid(args, capacities, trace.num_blocks)
        rows = _curve_rows(trace, policies, grid, bpt, args.json)
    else:
        bar, tick = _progress(trace.block_refs * len(policies) * len(capacities), args.json)
        try:
            results = [r for p in policies
                       for r in _simulate(trace, p, capacities, bpt, tick)]
        finally:
            if bar is not None:
                bar.stop()
        rows = [r.to_json() for r in results]
    engine = None
    if trace.engine_cached_tokens is not None:
        known = trace.engine_cached_tokens >= 0
        engine = engine_token_hit_rate(int(trace.prompt_tokens[known].sum()),
                                       int(trace.engine_cached_tokens[known].sum())) or 0.0
    info = {"source": trace.source, "format": trace.format, "requests": trace.requests,
            "block_refs": trace.block_refs, "distinct_blocks": trace.num_blocks,
            "block_size_tokens": trace.block_size_tokens,
            "footprint": sharing.memory_footprint(trace, args.concurrency, bpt),
            "engine_hit_rate": engine, "notes": trace.notes}
    return rows, info


def _run_similarity(args: argparse.Namespace, read) -> int:
    """K/V cosine similarity of the trace's prompts on the real model (module docstring of
    kvdiag.diagnosis.similarity has the definition)."""
    import msgspec

    from kvdiag.diagnosis.similarity import kv_similarity
    from kvdiag.traces.loaders import TraceFormatError, prompt_token_ids
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
    import time

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


def _curve_rows(trace, policies, grid, bpt, quiet) -> list[dict]:
    from kvdiag.simulation import sharing

    rows: list[dict] = []
    curve = sharing.lru_curve(trace, bytes_per_token=bpt)
    for policy in policies:
        if policy == "lru":
            rows += [curve.at(c) for c in grid]
        else:
            rows += [r.to_json() for r in _simulate(trace, policy, grid, bpt)]
    return rows


def _simulate(trace, policy, capacities, bpt, progress=None) -> list:
    """One policy (a built-in name or a plug-in class) at every capacity."""
    from kvdiag.simulation import sharing
    from kvdiag.simulation.policy_replay import simulate_plugins

    if isinstance(policy, str):
        return sharing.simulate_many(trace, [policy], capacities, bytes_per_token=bpt,
                                     progress=progress)
    out = simulate_plugins(trace, [policy], capacities, bytes_per_token=bpt)
    if progress is not None:
        progress(trace.block_refs * len(capacities))
    return out


def _pct(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:5.1f}%"


def _print_table(info: dict, rows, curve: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{info['source']}[/] ({info['format']}): {info['requests']} requests, "
                  f"{info['block_refs']} block refs, {info['distinct_blocks']} distinct blocks of "
                  f"{info['block_size_tokens']} tokens")
    if not curve:
        table = Table(show_edge=False)
        for col in ("policy", "capacity (blocks)", "block hit", "token hit", "request hit",
                    "bytes saved"):
            table.add_column(col, justify="left" if col == "policy" else "right")
        for r in rows:
            cap = "unbounded" if r["capacity_blocks"] is None else str(r["capacity_blocks"])
            table.add_row(r["policy"], cap, _pct(r["block_hit_rate"]), _pct(r["token_hit_rate"]),
                          _pct(r["request_hit_rate"]), format_bytes(r["bytes_saved"]))
        console.print(table)
    else:
        for policy in dict.fromkeys(r["policy"] for r in rows):
            console.print(f"\n[bold]{policy}[/] token hit rate vs capacity (blocks)")
            for r in rows:
                if r["policy"] == policy:
                    bar = "#" * round(40 * r["token_hit_rate"])
                    rate = _pct(r["token_hit_rate"])
                    console.print(f"{r['capacity_blocks']:>9} |{bar:<40}| {rate}",
                                  markup=False, highlight=False)
    fp = info["footprint"]
    console.print(f"memory held by live requests ({fp.concurrency_model}): peak "
                  f"{fp.peak_unshared_blocks} blocks without sharing, {fp.peak_shared_blocks} "
                  f"with sharing: {100 * fp.reduction:.1f}% reduction")
    if info["engine_hit_rate"] is not None:
        console.print(f"engine's own token hit rate: {_pct(info['engine_hit_rate'])} "
                      "(cached_prompt_tokens / prompt tokens of finished requests)")
    for note in info["notes"]:
        console.print(f"note: {note}")


# ---------------------------------------------------------------- tiered what-if


def _run_tiers(args: argparse.Namespace, read) -> int:
    """``--tiers``: the trace through a stack of LRU tiers (kvdiag.simulation.tiers)."""
    from kvdiag.simulation import tiers as T
    from kvdiag.traces.loaders import TraceFormatError, detect_format, load_trace

    clash = [flag for flag, on in (("--policy", args.policy), ("--policy-file", args.policy_file),
                                   ("--capacity", args.capacity), ("--curve", args.curve)) if on]
    if clash:
        print(f"kvdiag replay: --tiers replaces {', '.join(clash)} (each tier is LRU with its own "
              "capacity)", file=sys.stderr)
        return 2
    try:
        stack = T.parse_tiers(args.tiers)
    except ValueError as exc:
        print(f"kvdiag replay: --tiers: {exc}", file=sys.stderr)
        return 2
    if args.prefill_s_per_token is not None and not args.prefill_s_per_token >= 0:
        print("kvdiag replay: --prefill-s-per-token: expected a number >= 0", file=sys.stderr)
        return 2
    try:
        fmt = args.format or detect_format(args.trace)
        trace = load_trace(args.trace, format=fmt, block_size_tokens=args.block_size,
                           hash_algorithm=args.hash, read=read)
        if read.problems and not trace.requests:
            raise TraceFormatError(f"{args.trace}: expected at least one readable request, found "
                                   f"only unreadable lines (first: {read.problems[0]})")
    except TraceFormatError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    tell_skipped("replay", read.problems)
    prefill, source = args.prefill_s_per_token, "--prefill-s-per-token"
    if prefill is None and fmt == "kvdiag":
        prefill = T.prefill_s_per_token_of_log(args.trace)
        source = "engine steps of the log (least-squares marginal cost per prefill token)"
    bpt = args.bytes_per_token or trace.bytes_per_token
    bar, tick = _progress(trace.block_refs, args.json)
    try:
        res = T.simulate_tiers(trace, stack, args.tier_write, bytes_per_token=bpt,
                               prefill_s_per_token=prefill, prefill_source=source, progress=tick)
    except ValueError as exc:
        print(f"kvdiag replay: --tiers: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.stop()
    try:
        if args.json:
            obj = {"source": trace.source, "format": trace.format, **res.to_json(),
                   "skipped_lines": skipped_lines(read.problems)}
            print(json.dumps(obj, indent=1, default=float))
        else:
            _print_tiers(trace, res)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _rate(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "N/A"
    return format_bytes(x) + "/s"


def _ms(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "N/A"
    return f"{1e3 * x:+.2f}"


def _print_tiers(trace, res) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{trace.source}[/] ({trace.format}): {res.requests} requests, "
                  f"{res.block_refs} block refs of {res.block_size_tokens} tokens; tiers LRU, "
                  f"write-{res.write}")
    table = Table(show_edge=False)
    for col in ("tier", "capacity (blocks)", "block hit", "token hit", "promote", "demote in",
                "write", "link busy", "dropped (blocks)", "saved ms/req", "transfer ms/req", "net TTFT saved ms/req"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for r in res.per_tier().to_dict("records"):
        cap = r["capacity_blocks"]
        cap = "unbounded" if cap is None or (isinstance(cap, float) and math.isnan(cap)) \
            else str(int(cap))
        table.add_row(r["tier"], cap, _pct(r["block_hit_rate"]), _pct(r["token_hit_rate"]),
                      _rate(r["promote(B/s)"]), _rate(r["demote_in(B/s)"]),
                      _rate(r["write(B/s)"]), _pct(r["link_busy"]), str(r["dropped_blocks"]),
                      _ms(r["prefill_saved(s/request)"]), _ms(r["transfer(s/request)"]),
                      _ms(r["net_ttft(s/request)"]))
    console.print(table)
    console.print(f"all tiers: block hit {_pct(res.block_hit_rate)}, token hit "
                  f"{_pct(res.token_hit_rate)}; rates per second over the trace's span "
                  f"({'N/A' if res.span_s is None else f'{res.span_s:.1f} s'}); block "
                  f"{format_bytes(res.block_bytes)}")
    if res.prefill_s_per_token is None:
        console.print("prefill cost: N/A (give --prefill-s-per-token, or a kvdiag log with "
                      "engine steps)")
    else:
        console.print(f"prefill cost: {1e6 * res.prefill_s_per_token:.2f} us/token "
                      f"({res.prefill_source})")
    q = res.request_quantiles()
    if q is not None:
        console.print("net TTFT saved by all tiers per request: " +
                      ", ".join(f"{k} {_ms(v)} ms" for k, v in q.items()))
    vs = res.versus_top_alone_s_per_request()
    console.print(f"net TTFT saved vs the top tier alone (LRU, {res.top_alone_hit_tokens} hit "
                  f"tokens): {_ms(vs)} ms per request (positive = faster; transfers are "
                  f"promotions only: demotions "
                  f"and writes are asynchronous)" if vs is not None else
                  "net TTFT saved vs the top tier alone: N/A (needs the prefill cost, the bytes per "
                  "token and every lower tier's bandwidth)")
