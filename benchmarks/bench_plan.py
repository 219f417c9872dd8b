"""`kvdiag plan` speed: loading a 12k-request trace and making the capacity plan.

    python benchmarks/bench_plan.py [MOONCAKE_TRACE]

The public Mooncake trace three times over (tests/trace_copies.py: 11,979 requests), written
to a temp folder; prints the best CPU seconds of five
runs of ``load_mooncake`` + ``make_plan`` (llama3-70b, bf16) against the goal (< 1 s of one
core), and the machine load. Process CPU time: the work is single-threaded and the machine
is shared, so wall time would mostly measure other processes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import DEFAULT_TRACE, best_cpu_seconds  # noqa: E402
from trace_copies import repeat_mooncake  # noqa: E402

from kvdiag.pool.kv_shape import BUILTIN_MODELS  # noqa: E402
from kvdiag.simulation.capacity_plan import PlanSettings, make_plan  # noqa: E402
from kvdiag.traces.workload import load_mooncake  # noqa: E402

GOAL_CPU_S = 1.0


def main() -> None:
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_TRACE
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "mooncake_x3.jsonl"
        n = repeat_mooncake(trace, path, copies=3)

        def plan():
            make_plan(load_mooncake(path, 16), BUILTIN_MODELS["llama3-70b"], PlanSettings(dtype="bf16"))

        load_before = os.getloadavg()
        cpu_s = best_cpu_seconds(plan)
        load_after = os.getloadavg()
    print(f"plan of {n:,} requests: {cpu_s:.2f} s of CPU (best of 5), goal < {GOAL_CPU_S:.0f} s: "
          f"{'met' if cpu_s < GOAL_CPU_S else 'NOT met'} (x{cpu_s / GOAL_CPU_S:.2f} of the goal)")
    print(f"load before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
