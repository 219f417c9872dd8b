"""`kvdiag replay TRACE`: a recorded trace through shadow prefix caches, one policy and
capacity a row (or a hit-rate curve): the definitions are in ``replay.DESCRIPTION``."""

from __future__ import annotations

import argparse
import json
import math
import sys

from kvdiag.commands._logs import skipped_lines, tell_skipped
from kvdiag.commands._replay_common import (Usage, capacities_blocks, need_requests, pct, progress,
                                            write_stdout)
from kvdiag.events.units import format_bytes
from kvdiag.pool.hit_rate import engine_token_hit_rate


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


def run(args: argparse.Namespace, read, caps) -> int:
    """``kvdiag replay TRACE``: the trace through each policy at each capacity (``caps``:
    parsed capacities), or its hit-rate curve; a table or ``--json``."""
    from kvdiag.simulation.policy_replay import PolicyError
    from kvdiag.traces.detect import detect_format
    from kvdiag.traces.lines import TraceFormatError

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
        need_requests(args.trace, info["requests"], read.problems)
    except TraceFormatError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except Usage as exc:
        print(f"{args.trace}:1: {exc}", file=sys.stderr)
        return 2
    except PolicyError as exc:
        print(f"kvdiag replay: {exc}", file=sys.stderr)
        return 2
    tell_skipped("replay", read.problems)
    if args.json:
        write_stdout(lambda: print(json.dumps(_json_object(info, rows, read.problems), indent=1,
                                              default=float)))
    else:
        write_stdout(lambda: _print_table(info, rows, args.curve))
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


def _replay_streamed(args, fmt, policies, caps, read):
    from kvdiag.simulation.streamed_replay import replay_stream
    from kvdiag.traces.request_traces import iter_requests

    block_size, records = iter_requests(args.trace, fmt, args.block_size, args.hash, read)
    bpt = args.bytes_per_token
    capacities = capacities_blocks(caps, block_size, bpt)
    bar, tick = progress(None, args.json)
    try:
        replay = replay_stream(records, block_size, policies,
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
    from kvdiag.simulation.footprint import memory_footprint
    from kvdiag.traces.loaders import load_trace

    trace = load_trace(args.trace, format=fmt, block_size_tokens=args.block_size,
                       hash_algorithm=args.hash, read=read)
    bpt = args.bytes_per_token or trace.bytes_per_token
    capacities = capacities_blocks(caps, trace.block_size_tokens, bpt)
    if args.curve:
        grid = _curve_grid(args, capacities, trace.num_blocks)
        rows = _curve_rows(trace, policies, grid, bpt, args.json)
    else:
        bar, tick = progress(trace.block_refs * len(policies) * len(capacities), args.json)
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
            "footprint": memory_footprint(trace, args.concurrency, bpt),
            "engine_hit_rate": engine, "notes": trace.notes}
    return rows, info


def _curve_rows(trace, policies, grid, bpt, quiet) -> list[dict]:
    from kvdiag.simulation.lru_curve import lru_curve

    rows: list[dict] = []
    curve = lru_curve(trace, bytes_per_token=bpt)
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
            table.add_row(r["policy"], cap, pct(r["block_hit_rate"]), pct(r["token_hit_rate"]),
                          pct(r["request_hit_rate"]), format_bytes(r["bytes_saved"]))
        console.print(table)
    else:
        for policy in dict.fromkeys(r["policy"] for r in rows):
            console.print(f"\n[bold]{policy}[/] token hit rate vs capacity (blocks)")
            for r in rows:
                if r["policy"] == policy:
                    bar = "#" * round(40 * r["token_hit_rate"])
                    rate = pct(r["token_hit_rate"])
                    console.print(f"{r['capacity_blocks']:>9} |{bar:<40}| {rate}",
                                  markup=False, highlight=False)
    fp = info["footprint"]
    console.print(f"memory held by live requests ({fp.concurrency_model}): peak "
                  f"{fp.peak_unshared_blocks} blocks without sharing, {fp.peak_shared_blocks} "
                  f"with sharing: {100 * fp.reduction:.1f}% reduction")
    if info["engine_hit_rate"] is not None:
        console.print(f"engine's own token hit rate: {pct(info['engine_hit_rate'])} "
                      "(cached_prompt_tokens / prompt tokens of finished requests)")
    for note in info["notes"]:
        console.print(f"note: {note}")
