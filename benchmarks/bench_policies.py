"""Plug-in policy replay speed: plain-Python plug-ins vs the numba fast paths.

    python benchmarks/bench_policies.py [TRACE] [CAPACITY_BLOCKS]

Prints, for one capacity (default 5000 blocks) of a trace (default: the synthetic Mooncake
trace), block references replayed per second of process CPU time (best of 3; the machine is
shared, so wall time mostly measures other processes) for the numba LRU/S3-FIFO and for each
plug-in (the classics written in the plug-in API, LeCaR, prefix-LRU), and for the numba
replays of LeCaR and prefix-LRU (the default path of ``simulate_policy`` for those two, equal
decision for decision), with the machine's load average and CPU count beside them.
"""

from __future__ import annotations

import os
import sys

from kvdiag.simulation.learned_policies import LeCaRPolicy, PrefixLRUPolicy
from kvdiag.simulation.policies import FIFOPolicy, LFUPolicy, LRUPolicy
from kvdiag.simulation.policy_replay import simulate_policy
from kvdiag.simulation.sharing import simulate
from kvdiag.traces.loaders import load_trace
from _common import DEFAULT_TRACE, best_cpu_seconds


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_TRACE
    capacity = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    trace = load_trace(path)
    simulate(trace, "lru", capacity)  # compile (or load) the numba kernels first
    simulate(trace, "s3fifo", capacity)
    print(f"{path}: {trace.block_refs} block refs, capacity {capacity} blocks")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (before)")
    runs = [("lru (numba)", lambda: simulate(trace, "lru", capacity)),
            ("s3fifo (numba)", lambda: simulate(trace, "s3fifo", capacity))]
    runs += [(f"{p.name} (Python plug-in)", lambda p=p: simulate_policy(trace, p, capacity, fast=False))
             for p in (LRUPolicy, FIFOPolicy, LFUPolicy, LeCaRPolicy, PrefixLRUPolicy)]
    for p in (LeCaRPolicy, PrefixLRUPolicy):
        simulate_policy(trace, p, capacity)  # compile (or load) first
        runs.append((f"{p.name} (numba)", lambda p=p: simulate_policy(trace, p, capacity)))
    print(f"{'policy':<30} {'refs/s (CPU)':>14}")
    for name, fn in runs:
        seconds = best_cpu_seconds(fn)
        print(f"{name:<30} {trace.block_refs / seconds:>14,.0f}")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (after)")


if __name__ == "__main__":
    main()
