"""`kvdiag export LOG... --parquet DIR`: logs -> a Parquet dataset for columnar engines;
`kvdiag export LOG --strip-tokens -o OUT`: a token-id log -> the same log with hashed prompts."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvdiag.commands._logs import add_input_arguments, fail, tell_skipped
from kvdiag.events.eventlog import LogFormatError

DESCRIPTION = """Write the events of recorded logs to a Parquet dataset, partitioned by event type
and node (DIR/type=TYPE/node=NODE/part-0.parquet, hive style), with each log's header in
DIR/_headers.parquet. Columns are the events' fields from kvdiag's schema, units in their
names. JSONL stays the crash-safe recording format; the dataset is for analysis:
`kvdiag report DIR` and `kvdiag doctor DIR` read it (and add a per-node fleet table computed
with DuckDB), as can DuckDB, Spark or pandas. Logs are read one at a time; DIR must be new
or empty.

With --strip-tokens -o OUT, one log recorded with --record-tokens is written to OUT (a new
file; .gz for gzip) with every prompt's token ids replaced by salted chained hashes of its
16-token chunks under a fresh salt, as a default recording holds them; nothing else changes.
Replay and the shadow what-ifs give the same numbers from OUT."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG", help="event logs (.jsonl or .jsonl.gz)")
    parser.add_argument("--parquet", type=Path, metavar="DIR",
                        help="the dataset folder to create")
    parser.add_argument("--strip-tokens", action="store_true",
                        help="write one log to -o OUT with its token ids replaced by salted hashes")
    parser.add_argument("-o", "--out", type=Path, metavar="OUT",
                        help="--strip-tokens: the log to create")
    add_input_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvdiag.diagnosis.frames import load, node_names
    from kvdiag.events.dataset import DatasetWriter
    from kvdiag.events.eventlog import read_header

    if args.strip_tokens or args.out is not None:
        return _strip_tokens(args)
    if args.parquet is None:
        return fail("export", "expected --parquet DIR or --strip-tokens -o OUT")
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


def _strip_tokens(args: argparse.Namespace) -> int:
    """The log with token ids replaced by salted chunk hashes (kvdiag.pool.hashing.ContentHasher)."""
    import msgspec

    from kvdiag.events.eventlog import ReadOutcome, iter_events, read_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.pool.hashing import CONTENT_CHUNK_TOKENS, ContentHasher
    from kvdiag.events.schema import SCHEMA_VERSION

    if not args.strip_tokens or args.out is None or args.parquet is not None or len(args.logs) != 1:
        return fail("export", "expected one LOG with --strip-tokens -o OUT (and no --parquet)")
    src, out = Path(args.logs[0]), args.out
    if out.exists():
        return fail("export", f"{out}: exists, expected a new file")
    try:
        if src.is_dir():
            raise LogFormatError(f"{src}: is a folder, expected a kvdiag log")
        header = read_header(src)
    except (LogFormatError, OSError) as exc:
        return fail("export", str(exc))
    if header.content == "hashes":
        return fail("export", f"{src}: holds hashes already, no token ids to strip")
    hasher = ContentHasher()
    writer = LogWriter(out, msgspec.structs.replace(
        header, schema_version=SCHEMA_VERSION, content="hashes", content_salt=hasher.salt,
        content_chunk_tokens=CONTENT_CHUNK_TOKENS))
    outcome, n = ReadOutcome(), 0
    try:
        for n, ev in enumerate(iter_events(src, strict=args.strict, outcome=outcome), 1):
            writer.record(hasher(ev))
            if n % 1000 == 0:
                writer.flush()
    except LogFormatError as exc:
        writer.close()
        out.unlink(missing_ok=True)
        return fail("export", str(exc))
    writer.close()
    if outcome.cut and not args.partial:
        out.unlink(missing_ok=True)
        return fail("export", f"{outcome.cut}; expected a complete log (pass --partial to "
                              "use the events before the cut)")
    tell_skipped("export", outcome.problems)
    print(f"wrote {out}: {n:,} events, prompts as salted hashes (no token ids)")
    return 0
