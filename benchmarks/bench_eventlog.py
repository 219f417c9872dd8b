"""Events written and read per second by the event log (goal: >= 300,000/s each way).

Writes a realistic mix (block, request and step events, as the demo's adapter emits) through
LogWriter, then reads it back with read_log into DataFrames. Reports:
- record rate: LogWriter.record calls per second on the observed thread (the hot-path cost),
- write rate: events per second until close() has encoded and written everything,
- read rate: events per second from file to DataFrames, and iter_events streaming.
Usage: python benchmarks/bench_eventlog.py [--events N] [--gz]
"""

import argparse
import os
import tempfile
import time

from kvdiag.events.eventlog import iter_events, make_header, read_log
from kvdiag.events.log_writer import LogWriter
from kvdiag.events.schema import BlockAllocated, BlockReleased, BlockStored, EngineStep, PrefixHit


def make_events(n: int):
    events = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            events.append(BlockAllocated(ts_ns=i, request_id=f"req-{i // 50}", block_id=i % 256,
                                         num_blocks_free=100))
        elif kind == 1:
            events.append(BlockStored(ts_ns=i, block_id=i % 256, block_hash=(i * 2654435761) % 2**63,
                                      parent_hash=i, num_tokens=32, request_id=f"req-{i // 50}"))
        elif kind == 2:
            events.append(PrefixHit(ts_ns=i, request_id=f"req-{i // 50}", block_id=i % 256,
                                    block_hash=i, num_tokens=32))
        elif kind == 3:
            events.append(BlockReleased(ts_ns=i, request_id=f"req-{i // 50}", block_id=i % 256,
                                        cached=True))
        else:
            events.append(EngineStep(ts_ns=i, step_id=i, phase="decode", batch_size=8,
                                     num_tokens=8, duration_ns=12_000_000))
    return events


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--gz", action="store_true")
    args = parser.parse_args()
    events = make_events(args.events)
    path = os.path.join(tempfile.mkdtemp(), "bench.kvlog" + (".gz" if args.gz else ""))

    writer = LogWriter(path, make_header(engine="bench"), max_queue=len(events) + 1)
    t0 = time.perf_counter()
    for event in events:
        writer.record(event)
    t1 = time.perf_counter()
    writer.close()
    t2 = time.perf_counter()
    size = os.path.getsize(path)

    t3 = time.perf_counter()
    log = read_log(path)
    t4 = time.perf_counter()
    n_streamed = sum(1 for _ in iter_events(path))
    t5 = time.perf_counter()
    assert len(log) == len(events) == n_streamed, (len(log), n_streamed)

    n = len(events)
    print(f"events: {n:,}  file: {size / 2**20:.1f} MiB ({size / n:.0f} B/event)  gz={args.gz}")
    print(f"record (observed thread): {n / (t1 - t0):>12,.0f} events/s")
    print(f"write (record + encode + I/O): {n / (t2 - t0):>12,.0f} events/s   goal >= 300,000")
    print(f"read into DataFrames:     {n / (t4 - t3):>12,.0f} events/s   goal >= 300,000")
    print(f"iter_events (streaming):  {n / (t5 - t4):>12,.0f} events/s")


if __name__ == "__main__":
    main()
