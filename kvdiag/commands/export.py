"""`kvdiag export LOG... --parquet DIR`: logs -> a Parquet dataset for columnar engines."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvdiag.commands._logs import LogFormatError, add_input_arguments, fail, tell_skipped

DESCRIPTION = """Write the events of recorded logs to a Parquet dataset, partitioned by event type
and node (DIR/type=TYPE/node=NODE/part-0.parquet, hive style), with each log's header in
DIR/_headers.parquet. Columns are the events' fields from kvdiag's schema, units in their
names. JSONL stays the crash-safe recording format; the dataset is for analysis:
`kvdiag report DIR` and `kvdiag doctor DIR` read it (and add a per-node fleet table computed
with DuckDB), as can DuckDB, Spark or pandas. Logs are read one at a time; DIR must be new
or empty."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG", help="event logs (.jsonl or .jsonl.gz)")
    parser.add_argument("--parquet", required=True, type=Path, metavar="DIR",
                        help="the dataset folder to create")
    add_input_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvdiag.analysis.logs import load, node_names
    from kvdiag.dataset import DatasetWriter
    from kvdiag.eventlog import read_header

    try:
        for p in args.logs:
            if Path(p).is_dir():
                raise LogFormatError(f"{p}: is a folder, expected a kvdiag log")
        names = node_names([read_header(p) for p in args.logs], args.logs)
        writer = DatasetWriter(args.parquet)
    except (LogFormatError, OSError) as exc:
        return fail("export", str(exc))
    total, skipped = 0, []
    try:
        for path, name in zip(args.logs, names):  # one log in memory at a time
            logs, problems = load([path], skip=frozenset(), allow_truncated=args.partial,
                                  strict=args.strict)
            total += writer.add(name, logs.headers[logs.nodes[0]], logs.frames, str(path), problems)
            skipped += problems
        writer.close()
    except LogFormatError as exc:
        return fail("export", f"{exc} ({args.parquet} is left incomplete)")
    tell_skipped("export", skipped)
    size = sum(f.stat().st_size for f in args.parquet.rglob("*.parquet"))
    print(f"wrote {args.parquet} ({size / 2**20:.1f} MiB): {len(names)} log(s), {total:,} events")
    return 0
