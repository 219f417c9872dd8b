"""The engine's prefix hit rate: the one definition every view, report and rule calls.

``engine token hit rate = sum(cached_prompt_tokens) / sum(prompt_tokens)`` over the
``RequestFinished`` events whose ``status`` is ``"finished"`` (:data:`COUNTED_STATUS`).
Aborted and failed requests are left out: their ``cached_prompt_tokens`` may be cut short (an
abort during prefill) or never reported, and they would count prompt tokens on both sides of a
comparison with the shadow, which counts requests that finished normally too. Without any
such request the engine's own metric counters (hit tokens / query tokens) stand in, else the
rate is unknown (None). Pure arithmetic on counts or on a frame's columns: no imports.
"""

from __future__ import annotations

from typing import Any, Optional

COUNTED_STATUS = "finished"
"""``RequestFinished.status`` of the requests the hit rate counts (finished normally)."""


def counts_toward_hit_rate(status: Optional[str]) -> bool:
    """Whether a request that left with ``status`` counts toward the engine's hit rate."""
    return status == COUNTED_STATUS


def engine_token_hit_rate(prompt_tokens: float, cached_prompt_tokens: float,
                          metrics_queries_tokens: Optional[float] = None,
                          metrics_hits_tokens: Optional[float] = None) -> Optional[float]:
    """The engine's own prefix hit rate: cached prompt tokens / prompt tokens of requests that
    finished normally; without them, its metrics' hit / query token counters; else None."""
    if prompt_tokens:
        return cached_prompt_tokens / prompt_tokens
    if metrics_queries_tokens:
        return (metrics_hits_tokens or 0.0) / metrics_queries_tokens
    return None


def counted(finished: Any) -> Any:
    """The rows of a ``request_finished`` (or per-request) frame that count: status
    ``"finished"``; a frame without a status column counts every row."""
    if "status" not in finished:
        return finished
    return finished[finished["status"] == COUNTED_STATUS]


def frame_hit_rate(finished: Any) -> Optional[float]:
    """:func:`engine_token_hit_rate` of a frame with ``prompt_tokens``,
    ``cached_prompt_tokens`` and ``status`` columns (rows: requests), None when it counts no
    prompt tokens."""
    rows = counted(finished)
    if len(rows) == 0:
        return None
    return engine_token_hit_rate(float(rows["prompt_tokens"].sum()),
                                 float(rows["cached_prompt_tokens"].sum()))
