"""`kvdiag report LOG [LOG ...]`: recorded logs -> one self-contained HTML or Markdown report."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvdiag.commands._logs import (add_input_arguments, expand, fail, read_logs,
                                   tell_skipped, write_atomic)
from kvdiag.events.eventlog import LogFormatError

DESCRIPTION = """Turn recorded event logs into one report: findings first, then memory over time
and where it goes, block occupancy and fragmentation, prefix sharing, compression, attention
locality, latency percentiles and P99 regressions, per-request KV, collector health.

Several logs (one per node) merge into one report with a node column. A Parquet dataset
of `kvdiag export` (a folder) reads as the logs it was made from, and adds a per-node fleet
table computed by DuckDB over its files. --baseline compares
latency against another log instead of against the log's own earlier part. The HTML opens
offline (plotly.js is embedded once); --format md writes the same content as Markdown tables.
The output file is written whole or not at all."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG",
                        help="event logs (.jsonl or .jsonl.gz) or Parquet datasets of `kvdiag export` (folders, or a quoted glob)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="output file (default report.html, or report.md with --format md)")
    parser.add_argument("--format", choices=("html", "md"), default=None,
                        help="html (default; inferred from -o's suffix) or md")
    parser.add_argument("--baseline", metavar="LOG", nargs="+", default=None,
                        help="log(s) to compare latency against (P99 regression detection)")
    add_input_arguments(parser)
    parser.add_argument("--title", default="kvdiag report")
    parser.add_argument("--fleet", action="store_true",
                        help="only the fleet tables (per node and totals) and block occupancy by "
                             "node, computed with DuckDB: straight over the files of Parquet "
                             "datasets (no event loaded into memory), or over logs read as usual")


def run(args: argparse.Namespace) -> int:
    fmt = args.format or ("md" if args.output is not None and args.output.suffix == ".md" else "html")
    out = args.output or Path("report.md" if fmt == "md" else "report.html")
    if not out.parent.exists():
        return fail("report", f"{out.parent}: no such folder for the report")
    if args.fleet:
        return _fleet(args, fmt, out)
    try:
        logs, problems = read_logs(args.logs, allow_truncated=args.partial, strict=args.strict)
        baseline = None
        if args.baseline:
            baseline, more = read_logs(args.baseline, allow_truncated=args.partial,
                                       strict=args.strict)
            problems += more
    except LogFormatError as exc:
        return fail("report", str(exc))
    tell_skipped("report", problems)
    import contextlib
    import sys

    from rich.console import Console

    from kvdiag.reports import sections  # imported after reading: bad input fails fast
    if fmt == "md":
        from kvdiag.reports.markdown import render
    else:
        from kvdiag.reports.html import render
    busy = (Console(stderr=True).status(f"analysing {logs.num_events():,} events")
            if sys.stderr.isatty() else contextlib.nullcontext())
    with busy:
        from kvdiag.diagnosis.fleet import fleet_for
        fleet = fleet_for(expand(args.logs), logs.nodes)
        report, findings = sections.build(logs, baseline, problems, title=args.title, fleet=fleet)
        write_atomic(out, render(report))
    n_fail = sum(f.status == "fail" for f in findings)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {len(logs.nodes)} log(s), "
          f"{logs.num_events():,} events, {n_fail} failing check(s)")
    return 0


def _fleet(args: argparse.Namespace, fmt: str, out: Path) -> int:
    """``--fleet``: DuckDB over the datasets' files when every input is a dataset, else over
    the logs as read."""
    from kvdiag.diagnosis import fleet
    from kvdiag.events.dataset import is_dataset, read_headers

    if args.baseline:
        return fail("report", "--fleet compares nodes, not a baseline: leave out --baseline")
    paths = expand(args.logs)
    try:
        if all(is_dataset(p) for p in paths):
            from kvdiag.diagnosis.frames import distinct_names
            order = distinct_names([n for p in paths for n in read_headers(p)["node"]])
            src = fleet.from_datasets(*fleet.dataset_names(paths, order))
            inputs = f"{len(paths)} Parquet dataset(s)"
        else:
            logs, problems = read_logs(args.logs, allow_truncated=args.partial, strict=args.strict,
                                       every_type=True)  # every event counts in `events`
            tell_skipped("report", problems)
            src, inputs = fleet.from_logs(logs), f"{len(paths)} input(s) read as logs"
    except LogFormatError as exc:
        return fail("report", str(exc))
    from kvdiag.reports.fleet import build
    if fmt == "md":
        from kvdiag.reports.markdown import render
    else:
        from kvdiag.reports.html import render
    built = build(src, args.title, inputs)
    write_atomic(out, render(built.report))
    nodes = built.nodes
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): fleet of {len(nodes)} node(s), "
          f"{int(nodes['events'].sum()):,} events")
    return 0
