"""A larger trace from the public Mooncake one (tests/data/mooncake): its requests ``copies``
times over, each later copy shifted in time past the previous one and given keys of its own, so
the copies share nothing. For tests and benchmarks that need a trace of ~12k requests."""

from __future__ import annotations

import json
from pathlib import Path

COPY_SHIFT_MS = 1_100_000  # past the end of the trace (its timestamps are in ms)
COPY_KEY_OFFSET = 10**6  # above every hash id of the trace


def repeat_mooncake(trace: Path, out: Path, copies: int = 3) -> int:
    """Write ``trace`` ``copies`` times over into ``out``; the number of requests written."""
    lines = Path(trace).read_text().splitlines()
    with open(out, "w") as f:
        for copy in range(copies):
            for line in lines:
                req = json.loads(line)
                req["timestamp"] += copy * COPY_SHIFT_MS
                req["hash_ids"] = [h + copy * COPY_KEY_OFFSET for h in req["hash_ids"]]
                f.write(json.dumps(req) + "\n")
    return copies * len(lines)
