"""`kvdiag report` over a large log: time, peak memory and HTML size (goal: HTML < 10 MB for a
1,000,000-event log).

The large log is a real recorded log repeated end to end: each copy is shifted in time by the
source's duration and its request ids get a copy suffix, so requests, blocks and samples keep
their recorded shapes. Measured side by side in one run, each in a fresh process:
- reading alone (read_log into DataFrames), the floor any report pays;
- the HTML report and the Markdown report of the same log.
Printed: events, log size, seconds, peak RSS, output size, and the ratios report/read.
Usage: python benchmarks/bench_report.py [SOURCE_LOG] [--events N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from kvdiag.events.eventlog import iter_events, read_header
from kvdiag.events.log_writer import LogWriter

DEFAULT_SOURCE = Path(__file__).resolve().parent.parent / "tests/data/demo_small"


def _source(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    logs = sorted(p for p in DEFAULT_SOURCE.glob("*.kvlog*") if "leak" not in p.name)
    if not logs:
        sys.exit("no source log: pass one, or record tests/data/demo_small/ first")
    return logs[0]


def build(source: Path, target: Path, n_events: int, node: str | None = None,
          shift_ns: int = 0) -> int:
    """Repeat ``source`` into ``target`` until it holds ``n_events`` events; ``node`` renames
    the header's node, ``shift_ns`` moves every timestamp further."""
    events = list(iter_events(source))
    t0, t1 = min(e.ts_ns for e in events), max(e.ts_ns for e in events)
    span = t1 - t0 + 1_000_000_000
    header = read_header(source)
    if node is not None:
        header = msgspec.structs.replace(header, node=node)
    written, copy = 0, 0
    with LogWriter(target, header, max_queue=len(events) + 10) as w:
        while written < n_events:
            for e in events:
                if written >= n_events:
                    break
                changes = {"ts_ns": e.ts_ns + copy * span + shift_ns}
                rid = getattr(e, "request_id", None)
                if rid is not None:
                    changes["request_id"] = f"{rid}~{copy}"
                w.record(msgspec.structs.replace(e, **changes))
                written += 1
            w.flush()
            copy += 1
    return written


_WRAP = """import resource, sys, time
t = time.perf_counter()
{body}
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"""


def measure(body: str) -> tuple[float, float]:
    """Seconds and peak RSS (MiB) of ``body`` run in a fresh Python process (imports included)."""
    p = subprocess.run([sys.executable, "-c", _WRAP.format(body=body)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt, kib = p.stderr.strip().splitlines()[-1].split()
    return float(dt), float(kib) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", nargs="?")
    ap.add_argument("--events", type=int, default=1_000_000)
    args = ap.parse_args()
    src = _source(args.source)
    with tempfile.TemporaryDirectory(prefix="kvdiag-bench-") as d:
        big = Path(d) / "big.jsonl"
        n = build(src, big, args.events)
        size = os.path.getsize(big) / 2**20
        print(f"log: {n:,} events from {src.name} repeated, {size:.0f} MiB")
        rt, rm = measure(f"from kvdiag.events.eventlog import read_log\nread_log({str(big)!r})")
        print(f"read_log alone:     {rt:6.1f} s, peak RSS {rm:6.0f} MiB")
        results = {}
        for fmt in ("html", "md"):
            out = Path(d) / f"big.{fmt}"
            argv = ["report", str(big), "-o", str(out), "--format", fmt]
            t, m = measure(f"from kvdiag.cli import main\nassert main({argv!r}) == 0")
            results[fmt] = (t, m, os.path.getsize(out) / 2**20)
            print(f"report --format {fmt:4}: {t:6.1f} s, peak RSS {m:6.0f} MiB, output {results[fmt][2]:.2f} MiB")
        t, m, s = results["html"]
        print(f"ratios: html report / read time {t / rt:.2f}x; peak RSS report / read {m / rm:.2f}x; "
              f"peak RSS / log size {m / size:.2f}x; HTML {s:.2f} MiB vs 10 MB goal "
              f"({'met' if s * 2**20 < 10e6 else 'MISSED'})")


if __name__ == "__main__":
    main()
