"""Tiered prefix-cache simulation speed, side by side with the single-tier LRU path, one run.

    python benchmarks/bench_tiers.py [MOONCAKE_TRACE] [--repeat N]

Replays the shared Mooncake trace (played N times back to back, default 20, so each timed run
is long enough to measure) through:

- the single-cache LRU simulator (``sharing.simulate``, the ``run_lru_fifo`` kernel) at the
  top tier's capacity;
- the tier kernel with one tier (same work as the line above), and with gpu/cpu and
  gpu/cpu/disk stacks, write-back and write-through.

Prints block references per second (best of 5 in process CPU time: single-threaded code on a
shared machine, where wall time mostly measures other processes), the ratio of each to the
single-tier LRU path, and the load average at start and end (``os.getloadavg()``). Goal:
tiered >= 5 M block refs/s. The first call compiles (numba, cached); it is not timed.
"""

from __future__ import annotations

import argparse
import os

from _common import DEFAULT_TRACE, best_cpu_seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    load0 = os.getloadavg()

    from kvdiag.simulation.sharing import simulate
    from kvdiag.simulation.tier_spec import Tier
    from kvdiag.simulation.tiers import simulate_tiers
    from kvdiag.traces.loaders import load_trace

    trace = load_trace(args.trace).repeated(args.repeat)
    refs = trace.block_refs
    top = 2000
    stacks = {
        "tiers: gpu (one tier)": ([Tier("gpu", top)], "back"),
        "tiers: gpu/cpu, write-back": ([Tier("gpu", top), Tier("cpu", 8000)], "back"),
        "tiers: gpu/cpu, write-through": ([Tier("gpu", top), Tier("cpu", 8000)], "through"),
        "tiers: gpu/cpu/disk, write-back": ([Tier("gpu", top), Tier("cpu", 8000),
                                             Tier("disk", None)], "back"),
        "tiers: gpu/cpu/disk, write-through": ([Tier("gpu", top), Tier("cpu", 8000),
                                                Tier("disk", None)], "through"),
    }
    simulate(trace, "lru", top)  # compile / load the cached kernels
    for tiers, write in stacks.values():
        simulate_tiers(trace, tiers, write, compare_top_alone=False)

    print(f"trace: {args.trace} x{args.repeat}: {trace.requests} requests, {refs:,} block refs, "
          f"{trace.num_blocks:,} distinct blocks")
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} "
          f"({os.cpu_count()} CPUs)")
    base = best_cpu_seconds(lambda: simulate(trace, "lru", top))
    print(f"{'single-tier LRU (sharing.simulate)':40s} {refs / base / 1e6:8.1f} M refs/s   1.00x")
    for name, (tiers, write) in stacks.items():
        t = best_cpu_seconds(lambda: simulate_tiers(trace, tiers, write, compare_top_alone=False))
        print(f"{name:40s} {refs / t / 1e6:8.1f} M refs/s   {base / t:.2f}x of single-tier LRU "
              f"speed")
    load1 = os.getloadavg()
    print(f"load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")


if __name__ == "__main__":
    main()
