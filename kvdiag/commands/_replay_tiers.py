"""`kvdiag replay --tiers SPEC`: a trace through a stack of LRU tiers (GPU, CPU, disk...),
each with its capacity and read bandwidth (:mod:`kvdiag.simulation.tiers`, docs/tiers.md)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from kvdiag.commands._logs import skipped_lines, tell_skipped
from kvdiag.commands._replay_common import need_requests, pct, progress, write_stdout
from kvdiag.events.units import format_bytes


def run(args: argparse.Namespace, read) -> int:
    """``--tiers``: the trace through a stack of LRU tiers (kvdiag.simulation.tiers)."""
    from kvdiag.simulation import tiers as T
    from kvdiag.simulation.prefill_rate import prefill_s_per_token_of_log
    from kvdiag.simulation.tier_spec import parse_tiers
    from kvdiag.traces.detect import detect_format
    from kvdiag.traces.lines import TraceFormatError
    from kvdiag.traces.loaders import load_trace

    clash = [flag for flag, on in (("--policy", args.policy), ("--policy-file", args.policy_file),
                                   ("--capacity", args.capacity), ("--curve", args.curve)) if on]
    if clash:
        print(f"kvdiag replay: --tiers replaces {', '.join(clash)} (each tier is LRU with its own "
              "capacity)", file=sys.stderr)
        return 2
    try:
        stack = parse_tiers(args.tiers)
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
        need_requests(args.trace, trace.requests, read.problems)
    except TraceFormatError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    tell_skipped("replay", read.problems)
    prefill, source = args.prefill_s_per_token, "--prefill-s-per-token"
    if prefill is None and fmt == "kvdiag":
        prefill = prefill_s_per_token_of_log(args.trace)
        source = "engine steps of the log (least-squares marginal cost per prefill token)"
    bpt = args.bytes_per_token or trace.bytes_per_token
    bar, tick = progress(trace.block_refs, args.json)
    try:
        res = T.simulate_tiers(trace, stack, args.tier_write, bytes_per_token=bpt,
                               prefill_s_per_token=prefill, prefill_source=source, progress=tick)
    except ValueError as exc:
        print(f"kvdiag replay: --tiers: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.stop()
    if args.json:
        obj = {"source": trace.source, "format": trace.format, **res.to_json(),
               "skipped_lines": skipped_lines(read.problems)}
        write_stdout(lambda: print(json.dumps(obj, indent=1, default=float)))
    else:
        write_stdout(lambda: _print_tiers(trace, res))
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
        table.add_row(r["tier"], cap, pct(r["block_hit_rate"]), pct(r["token_hit_rate"]),
                      _rate(r["promote(B/s)"]), _rate(r["demote_in(B/s)"]),
                      _rate(r["write(B/s)"]), pct(r["link_busy"]), str(r["dropped_blocks"]),
                      _ms(r["prefill_saved(s/request)"]), _ms(r["transfer(s/request)"]),
                      _ms(r["net_ttft(s/request)"]))
    console.print(table)
    console.print(f"all tiers: block hit {pct(res.block_hit_rate)}, token hit "
                  f"{pct(res.token_hit_rate)}; rates per second over the trace's span "
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
