"""Prefix-sharing replay speed and memory, measured side by side in one run.

    python benchmarks/bench_sharing.py [MOONCAKE_TRACE]

Prints:
1. the full LRU hit-rate curve (all capacities, one pass) vs a straightforward
   ``collections.OrderedDict`` LRU prefix replay of ONE capacity, same trace (ratio < 1 wanted);
2. single-capacity simulator throughput, block references per second, per policy (>= 2M for LRU);
3. peak RSS of load + LRU replay + curve for the trace and for the trace repeated 10x;
4. chunk hashing throughput, fast vs blake2b vs sha256.

Times are the best of several runs in process CPU time (single-threaded code on a shared
machine, where wall time mostly measures other processes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from _common import DEFAULT_TRACE, best_cpu_seconds


def ordered_dict_replay(requests, capacity):
    """LRU with prefix-match semantics, one capacity, the obvious way."""
    cache: OrderedDict = OrderedDict()
    hits = 0
    for ids in requests:
        h = 0
        while h < len(ids) and ids[h] in cache:
            h += 1
        hits += h
        for b in ids:
            if b in cache:
                cache.move_to_end(b)
            else:
                while len(cache) >= capacity:
                    cache.popitem(last=False)
                cache[b] = None
    return hits


RSS_SCRIPT = """
import resource, sys, psutil
from kvdiag.traces.loaders import load_trace
from kvdiag.traces.request_traces import iter_requests
from kvdiag.simulation.lru_curve import lru_curve
from kvdiag.simulation.sharing import simulate
from kvdiag.simulation.streamed_replay import replay_stream
import kvdiag.simulation._simkernels
before = psutil.Process().memory_info().rss
if sys.argv[2] == "streamed":  # what `kvdiag replay` does for Mooncake and token-id traces
    bs, records = iter_requests(sys.argv[1])
    r = replay_stream(records, bs, ["lru"], [5000], curve=True)
    refs, distinct = r.block_refs, r.distinct_blocks
else:  # the whole trace as arrays (needed by OPT)
    t = load_trace(sys.argv[1])
    simulate(t, "lru", 5000)
    lru_curve(t)
    refs, distinct = t.block_refs, t.num_blocks
after = psutil.Process().memory_info().rss
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, refs, distinct, after - before)
"""


def main() -> None:
    from kvdiag.simulation.lru_curve import lru_curve
    from kvdiag.simulation.sharing import POLICIES, simulate
    from kvdiag.traces.loaders import load_trace
    from kvdiag.pool.hashing import chunk_hashes

    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_TRACE
    trace = load_trace(path)
    with open(path) as f:
        requests = [json.loads(line)["hash_ids"] for line in f]
    capacity = 10_000
    lru_curve(trace)  # compile (or load numba's cache) outside the timed region
    for p in POLICIES:
        simulate(trace, p, capacity)

    t_od = best_cpu_seconds(lambda: ordered_dict_replay(requests, capacity), 3)
    t_curve = best_cpu_seconds(lambda: lru_curve(trace))
    curve = lru_curve(trace)
    assert curve.block_hits[capacity] == ordered_dict_replay(requests, capacity)
    print(f"trace: {trace.requests} requests, {trace.block_refs} block refs, "
          f"{trace.num_blocks} distinct blocks")
    print(f"[1] full LRU curve ({trace.num_blocks + 1} capacities, one pass): {t_curve * 1e3:.1f} ms; "
          f"OrderedDict LRU replay of one capacity: {t_od * 1e3:.1f} ms; "
          f"ratio curve/one-replay = {t_curve / t_od:.3f}")

    big = trace.repeated(10)
    print(f"[2] single-capacity simulator on the trace x10 ({big.block_refs} refs), capacity {capacity}:")
    for p in POLICIES:
        t = best_cpu_seconds(lambda: simulate(big, p, capacity), 3)
        print(f"    {p:7s} {big.block_refs / t / 1e6:6.2f} M block refs/s"
              f"  ({big.block_refs / t / (trace.block_refs / t_od):.0f}x the OrderedDict replay)")

    with tempfile.TemporaryDirectory() as tmp:
        x10 = Path(tmp) / "x10.jsonl"
        text = path.read_text()
        x10.write_text(text * 10)
        for mode in ("streamed", "in-memory"):
            rss = []
            for p in (path, x10):
                out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(p), mode],
                                     capture_output=True, text=True, check=True).stdout.split()
                rss.append((int(out[0]), int(out[3])))
                print(f"[3] {mode} LRU replay + curve of {p.name} ({out[1]} refs, {out[2]} distinct "
                      f"blocks): peak RSS {int(out[0]) / 2**20:.1f} MiB, grown after imports "
                      f"{int(out[3]) / 2**20:.1f} MiB")
            print(f"    {mode}: peak RSS x10 / x1 = {rss[1][0] / rss[0][0]:.3f}; growth after imports "
                  f"x10 / x1 = {rss[1][1] / max(rss[0][1], 1):.2f} "
                  f"({(rss[1][1] - rss[0][1]) / (9 * trace.block_refs):.1f} B per extra reference)")

    tokens = np.random.default_rng(0).integers(0, 49152, size=1 << 20)
    for block in (16, 64):
        rates = {}
        for algo in ("fast", "blake2b", "sha256"):
            t = best_cpu_seconds(lambda: chunk_hashes(tokens, block, algorithm=algo), 3)
            rates[algo] = len(tokens) // block / t
        print(f"[4] chunk hashing, {block}-token chunks: " + ", ".join(
            f"{a} {r / 1e6:.2f} M chunks/s" for a, r in rates.items())
            + f"; fast/blake2b = {rates['fast'] / rates['blake2b']:.1f}x")


if __name__ == "__main__":
    main()
