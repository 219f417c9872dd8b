"""The event-time bin of ``kvdiag top``'s state: what the views count per ``bin_s`` of event
time (latencies and tokens of the requests finished in it, events, evictions, KV read), so
that a replay at any speed gives the same histories."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Bin:
    ttft_ns: list = field(default_factory=list)
    tpot_ns: list = field(default_factory=list)
    queue_ns: list = field(default_factory=list)  # queue waits of requests finished in the bin
    generated_tokens: int = 0
    finished_output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    events: int = 0
    kv_read_bytes: float = 0.0  # KV blocks held at each engine step x block bytes, summed
    step_ns: int = 0  # durations of those steps, summed
