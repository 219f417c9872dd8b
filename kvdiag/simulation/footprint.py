"""Memory held by live requests: peak KV blocks of the requests live at once, with and without
sharing blocks (the "memory reduction" of prefix sharing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvdiag.simulation._footprintkernels import live_peaks
from kvdiag.traces.trace import Trace


@dataclass
class MemoryFootprint:
    """Peak KV held by concurrently live requests, with and without sharing blocks.

    Without sharing every live request holds its own ``ceil(prompt / block)`` blocks; with
    sharing, live requests hold one copy of each distinct chained block (their unhashed prompt
    tails stay private). Reduction = 1 - shared peak / unshared peak (the article's "memory
    reduction"; cached-but-idle blocks are not counted in either).
    """

    block_size_tokens: int
    peak_unshared_blocks: int
    peak_shared_blocks: int
    concurrency_model: str
    bytes_per_block: Optional[int] = None

    @property
    def reduction(self) -> float:
        if not self.peak_unshared_blocks:
            return 0.0
        return 1.0 - self.peak_shared_blocks / self.peak_unshared_blocks

    @property
    def peak_unshared_bytes(self) -> Optional[int]:
        if self.bytes_per_block is None:
            return None
        return self.peak_unshared_blocks * self.bytes_per_block

    @property
    def peak_shared_bytes(self) -> Optional[int]:
        if self.bytes_per_block is None:
            return None
        return self.peak_shared_blocks * self.bytes_per_block


def memory_footprint(trace: Trace, concurrency: int = 8,
                     bytes_per_token: Optional[int] = None) -> MemoryFootprint:
    """Peak blocks held by live requests with and without sharing.

    A request is live from its arrival to its finish when the trace has both (kvdiag logs);
    otherwise from its arrival until ``concurrency`` later requests have arrived.
    """
    trace = trace.requests_only()
    n = trace.requests
    timed = trace.arrival_ns is not None and trace.finish_ns is not None
    if timed and (trace.finish_ns >= 0).all():
        times = np.concatenate([trace.arrival_ns, trace.finish_ns])
        model = "arrival to finish"
    else:
        times = np.concatenate([np.arange(n), np.arange(n) + concurrency]).astype(np.int64)
        model = f"arrival until {concurrency} later arrivals"
    kinds = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)])
    reqs = np.concatenate([np.arange(n), np.arange(n)])
    order = np.lexsort((kinds, times))  # at equal times, finishes (-1) before arrivals
    pages = -(-trace.prompt_tokens // trace.block_size_tokens)
    private = pages - np.diff(trace.offsets)
    unshared, shared = live_peaks(trace.block_ids, trace.offsets, np.maximum(private, 0),
                                  pages, reqs[order], kinds[order], trace.num_blocks)
    bpt = bytes_per_token or trace.bytes_per_token
    return MemoryFootprint(trace.block_size_tokens, int(unshared), int(shared), model,
                           None if not bpt else bpt * trace.block_size_tokens)
