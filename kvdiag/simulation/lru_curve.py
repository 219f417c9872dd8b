"""The LRU hit-rate curve: hit rates at every capacity from one pass of LRU stack distances
(a reference whose request-prefix maximum stack distance is m hits at every capacity >= m),
equal capacity by capacity to :func:`kvdiag.simulation.sharing.simulate` with ``"lru"``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd

from kvdiag.simulation import _simkernels as K
from kvdiag.simulation._stackkernels import compact, stack_distances
from kvdiag.simulation.replay_common import CHUNK_REFS, log2_frame, request_chunks
from kvdiag.traces.trace import Trace


@dataclass
class HitRateCurve:
    """LRU hit rates at every capacity ``0..distinct_blocks`` from one pass (stack distances).

    ``block_hits[c]`` / ``token_hits[c]`` = prefix-hit blocks / tokens of LRU with capacity ``c``
    blocks; ``request_rate[c]`` = its request hit rate. Capacities ``>= distinct_blocks`` behave
    as unbounded. Equal, capacity by capacity, to :func:`simulate` with ``"lru"``.
    """

    block_size_tokens: int
    requests: int
    block_refs: int
    prompt_tokens: int
    distinct_blocks: int
    block_hits: np.ndarray  # int64 [distinct_blocks + 1]
    token_hits: np.ndarray  # int64 [distinct_blocks + 1]
    request_rate: np.ndarray  # float64 [distinct_blocks + 1]
    reuse_hist: np.ndarray = field(repr=False)  # LRU stack distances of re-references, log2 bins
    bytes_per_token: Optional[int] = None

    def _index(self, capacity_blocks: Optional[int]) -> int:
        if capacity_blocks is None:
            return self.distinct_blocks
        return min(int(capacity_blocks), self.distinct_blocks)

    def at(self, capacity_blocks: Optional[int]) -> dict:
        """The replay JSON object (see :meth:`SharingResult.to_json`) of LRU at one capacity."""
        k = self._index(capacity_blocks)
        hit_tokens = int(self.token_hits[k])
        return {
            "policy": "lru",
            "capacity_blocks": capacity_blocks,
            "block_hit_rate": self.block_hits[k] / self.block_refs if self.block_refs else 0.0,
            "token_hit_rate": hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "request_hit_rate": float(self.request_rate[k]),
            "requests": self.requests,
            "block_refs": self.block_refs,
            "distinct_blocks": self.distinct_blocks,
            "bytes_saved": hit_tokens * self.bytes_per_token if self.bytes_per_token else None,
        }

    def frame(self, capacities: Optional[Sequence[int]] = None) -> pd.DataFrame:
        """Rates at ``capacities`` (default: all ``0..distinct_blocks``)."""
        caps = np.arange(self.distinct_blocks + 1) if capacities is None else \
            np.minimum(np.asarray(capacities, dtype=np.int64), self.distinct_blocks)
        return pd.DataFrame({
            "capacity_blocks": caps if capacities is None else np.asarray(capacities),
            "block_hit_rate": self.block_hits[caps] / max(self.block_refs, 1),
            "token_hit_rate": self.token_hits[caps] / max(self.prompt_tokens, 1),
            "request_hit_rate": self.request_rate[caps],
        })

    def reuse_distances(self) -> pd.DataFrame:
        """Re-references by LRU stack distance (distinct blocks referenced in between, + 1)."""
        return log2_frame(self.reuse_hist, "distance", "blocks", "references")


class StackState:
    """LRU stack-distance state and histograms over a growing set of block ids."""

    def __init__(self, num_blocks: int = 1) -> None:
        n = max(int(num_blocks), 1)
        self.last_time = np.full(n, -1, dtype=np.int64)
        self.owner = np.full(2 * n + 64, -1, dtype=np.int64)
        self.tree = np.zeros(2 * n + 65, dtype=np.int64)
        self.state = np.zeros(2, dtype=np.int64)  # next time slot, live blocks
        self.hist_blocks = np.zeros(n + 2, dtype=np.int64)
        self.hist_tokens = np.zeros(n + 2, dtype=np.int64)
        self.hist_req = np.zeros(n + 2, dtype=np.float64)
        self.reuse = np.zeros(K.AGE_BINS, dtype=np.int64)
        self.requests_with_prompt = 0

    def _grow(self, num_blocks: int) -> None:
        old = len(self.last_time)
        if num_blocks <= old:
            return
        n = max(num_blocks, 2 * old)
        last_time = np.full(n, -1, dtype=np.int64)
        last_time[:old] = self.last_time
        owner = np.full(2 * n + 64, -1, dtype=np.int64)
        owner[:len(self.owner)] = self.owner
        tree = np.zeros(2 * n + 65, dtype=np.int64)
        self.state[0] = compact(last_time, owner, tree, int(self.state[0]))
        self.last_time, self.owner, self.tree = last_time, owner, tree
        for name in ("hist_blocks", "hist_tokens", "hist_req"):
            h = getattr(self, name)
            grown = np.zeros(n + 2, dtype=h.dtype)
            grown[:old + 1] = h[:old + 1]  # finite distances are <= old
            grown[-1] = h[-1]  # never a hit
            setattr(self, name, grown)

    def feed(self, ids, offsets, block_tokens, prompt_tokens, counted, r0, r1) -> None:
        if offsets[r1] > offsets[r0]:
            self._grow(int(ids[offsets[r0]:offsets[r1]].max()) + 1)
        stack_distances(ids, offsets, block_tokens, prompt_tokens, counted, r0, r1,
                        self.last_time, self.owner, self.tree, self.state, self.hist_blocks,
                        self.hist_tokens, self.hist_req, self.reuse)
        self.requests_with_prompt += int((prompt_tokens[r0:r1] > 0).sum())

    def curve(self, distinct, block_size, requests, refs, prompt, bpt) -> "HitRateCurve":
        d = distinct
        return HitRateCurve(
            block_size_tokens=block_size, requests=requests, block_refs=refs,
            prompt_tokens=prompt, distinct_blocks=d,
            block_hits=np.cumsum(self.hist_blocks[: d + 1]),
            token_hits=np.cumsum(self.hist_tokens[: d + 1]),
            request_rate=np.cumsum(self.hist_req[: d + 1]) / max(self.requests_with_prompt, 1),
            reuse_hist=self.reuse.copy(), bytes_per_token=bpt)


def lru_curve(trace: Trace, *, bytes_per_token: Optional[int] = None,
              progress: Optional[Callable[[int], None]] = None) -> HitRateCurve:
    """The LRU hit-rate curve over all capacities from one pass of stack distances: a
    reference whose request-prefix maximum stack distance is m hits at every capacity >= m."""
    stack = StackState(trace.num_blocks)
    for r0, r1 in request_chunks(trace.offsets, CHUNK_REFS):
        stack.feed(trace.block_ids, trace.offsets, trace.block_tokens, trace.prompt_tokens,
                   trace.counted_rows, r0, r1)
        if progress is not None:
            progress(int(trace.offsets[r1] - trace.offsets[r0]))
    return stack.curve(trace.num_blocks, trace.block_size_tokens, trace.requests,
                       trace.block_refs, int(trace.prompt_tokens.sum()),
                       bytes_per_token or trace.bytes_per_token)
