"""KV demand of the active requests against the free blocks: ``forecast.memory_pressure``.

Defined once and evaluated in two places: by the doctor over a recorded log, at every pool
sample (:func:`kvdiag.diagnosis.pressure_rules.forecast_frame`, vectorised), and by the Prometheus
exporter over the live state (:meth:`kvdiag.live.state.LiveState.kv_demand`). The functions
take numbers or numpy arrays alike.

*Active requests* are those the scheduler has admitted (their first ``RequestScheduled``) and
that have not finished; with no scheduling events in the log, those arrived and not finished.
Waiting requests do not count: a scheduler admits a request when its blocks are free, and
preemption or OOM comes from admitted requests growing. A request's *expected blocks* are the blocks it will hold when it ends: ceil((prompt tokens +
expected output tokens) / block size) minus the blocks it has taken from the prefix cache so
far (a forecast knows only the hits that already happened), with
expected output = its ``max_new_tokens``, else the P90 output length of finished requests.
*Needed blocks* = expected blocks of the active requests - blocks already allocated to them
(never below 0); *free blocks* = free + evictable cached blocks of the latest pool sample.
"""

from __future__ import annotations

import numpy as np

EXPECTED_OUTPUT_QUANTILE = 0.9
"""Output length assumed for a request without ``max_new_tokens``: this quantile of the output
lengths of finished requests."""


def fallback_output_tokens(finished_output_tokens) -> float:
    """Expected output tokens of a request that did not say (0 before any request finished)."""
    outputs = np.asarray(finished_output_tokens, dtype="float64")
    return float(np.quantile(outputs, EXPECTED_OUTPUT_QUANTILE)) if outputs.size else 0.0


def expected_blocks(prompt_tokens, expected_output_tokens, prefix_hit_blocks, block_size_tokens):
    """Blocks a request will hold at its end (see the module docstring)."""
    return np.ceil((prompt_tokens + expected_output_tokens) / block_size_tokens) - prefix_hit_blocks


def needed_blocks(expected_blocks_total, allocated_blocks_total):
    """Blocks the active requests still need: expected - already allocated, never below 0."""
    return np.maximum(expected_blocks_total - allocated_blocks_total, 0)


def need_ratio(needed, free):
    """Needed / free blocks; inf when something is needed and nothing is free, 0 when neither."""
    needed, free = np.asarray(needed, dtype="float64"), np.asarray(free, dtype="float64")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(free > 0, needed / free, np.where(needed > 0, np.inf, 0.0))
    return float(ratio) if ratio.ndim == 0 else ratio
