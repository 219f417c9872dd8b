"""What the trace benchmarks share: the trace they default to and how they time a run."""

import time
from pathlib import Path

# the public Mooncake trace, kept in the repository as a test fixture (tests/data/mooncake/ABOUT.md)
DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "tests" / "data" / "mooncake" / "synthetic_trace.jsonl"


def best_cpu_seconds(fn, repeats: int = 5) -> float:
    """Best CPU time of this process over ``repeats`` calls of ``fn`` (the machine is shared:
    wall time includes waiting for it)."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)
