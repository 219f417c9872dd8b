"""Fleet logs: the JSONL path against DuckDB over a Parquet dataset, side by side in one run.

The fleet is made from one real recorded log (tests/data/demo_small by default): node i's log
is that log repeated end to end until it holds events/nodes events (each copy shifted in
time by the source's duration plus 1 s, request ids suffixed ``~copy``), under the header
node name ``node-i``, with every timestamp further shifted by i x 1 s. Each measurement runs
in a fresh process (imports included); peak memory is that process's ru_maxrss.
Measured: `kvdiag export --parquet` (once); the per-node table from the JSONL logs (read
every log, then pandas) against ``diagnosis.fleet.fleet_table`` (DuckDB over the files);
`kvdiag report --fleet --format md` from the logs (read and checked by kvdiag's reader, then
the same DuckDB queries over the frames) and from the dataset (DuckDB over the files);
with --whole-report, also the whole report both ways; Parquet bytes / JSONL bytes. The goal (issue 15) is >= 20 nodes and >= 10M events; the default is 1M events
(--events) so that it runs in minutes on a small machine.
Usage: python benchmarks/bench_fleet.py [--nodes 20] [--events 1000000] [SOURCE_LOG]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from bench_report import DEFAULT_SOURCE, build, measure  # the same repeated log, the same probe

_JSONL_FLEET = """from kvdiag.diagnosis.frames import load
from kvdiag.diagnosis.memory import pool_occupancy
logs, _ = load({logs!r})
fin = logs.frame("request_finished")
fin = fin[fin["status"] == "finished"]
occ = pool_occupancy(logs)
g = fin.groupby("node")
table = [g["cached_prompt_tokens"].sum() / g["prompt_tokens"].sum(), g["ttft_ns"].quantile(0.99),
         occ.groupby("node")["block_occupancy"].max()]"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", nargs="?")
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--events", type=int, default=1_000_000, help="events over all nodes")
    ap.add_argument("--whole-report", action="store_true",
                    help="also the whole report (every section, all events in pandas) both ways")
    args = ap.parse_args()
    src = Path(args.source) if args.source else sorted(DEFAULT_SOURCE.glob("*.kvlog*"))[0]
    with tempfile.TemporaryDirectory(prefix="kvdiag-bench-fleet-") as d:
        logs = [str(Path(d) / f"node-{i}.jsonl") for i in range(args.nodes)]
        n = sum(build(src, Path(p), args.events // args.nodes, node=f"node-{i}", shift_ns=i * 10**9)
                for i, p in enumerate(logs))
        jsonl_b = sum(os.path.getsize(p) for p in logs)
        ds = Path(d) / "ds"
        print(f"fleet: {args.nodes} nodes, {n:,} events from {src.name}, JSONL {jsonl_b / 2**20:.0f} MiB; "
              f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        argv = ["export", *logs, "--parquet", str(ds)]
        et, em = measure(f"from kvdiag.cli import main\nassert main({argv!r}) == 0")
        pq_b = sum(f.stat().st_size for f in ds.rglob("*.parquet"))
        print(f"export --parquet:            {et:7.1f} s, peak RSS {em:6.0f} MiB; Parquet "
              f"{pq_b / 2**20:.1f} MiB = {pq_b / jsonl_b:.3f} of the JSONL bytes")
        jt, jm = measure(_JSONL_FLEET.format(logs=logs))
        dt, dm = measure(f"from kvdiag.diagnosis.fleet import fleet_table\nfleet_table([{str(ds)!r}])")
        print(f"per-node table, JSONL+pandas: {jt:7.1f} s, peak RSS {jm:6.0f} MiB")
        print(f"per-node table, DuckDB:       {dt:7.1f} s, peak RSS {dm:6.0f} MiB  -> {jt / dt:.0f}x faster")
        reports = [("fleet report", ["--fleet"])] + ([("whole report", [])] if args.whole_report else [])
        for what, flags in reports:
            out = {}
            for name, inputs in (("JSONL", logs), ("Parquet", [str(ds)])):
                argv = ["report", *inputs, *flags, "-o", str(Path(d) / f"{name}.md"), "--format", "md"]
                out[name] = measure(f"from kvdiag.cli import main\nassert main({argv!r}) == 0")
                print(f"{what} from {name:7}: {out[name][0]:7.1f} s, peak RSS {out[name][1]:6.0f} MiB")
            print(f"{what}: Parquet {out['JSONL'][0] / out['Parquet'][0]:.1f}x faster, peak RSS "
                  f"{out['Parquet'][1] / out['JSONL'][1]:.2f}x; load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
