"""Shadow prefix-cache simulation: what sharing would give on a recorded trace.

Semantics (those of vLLM's and transformers' prefix caches, one shared pool of blocks keyed by
chained content hashes): when a request arrives, it reuses the longest run of its leading
blocks that are in the cache and stops at the first miss (prefix match). Then each of its
blocks, in prompt order, is touched if cached, or inserted after evicting (by the policy) down
to room for it. ``plain`` traces (:meth:`Trace.plain`) make every block reference its own
lookup: ordinary cache semantics, as in libCacheSim.

Policies: ``lru`` (least recently used; the article's), ``fifo`` (first inserted), ``lfu``
(fewest references since insertion; ties: least recently used), ``s3fifo`` (S3-FIFO: a small
FIFO of 10% of the capacity filters one-hit blocks, blocks referenced twice there move to a
main FIFO with a 2-bit reinsertion counter, a ghost FIFO of evicted ids as large as the rest of
the cache sends re-referenced ones straight to main) and ``opt`` (Belady: evict the block
referenced furthest in the future; with chained keys a block is never needed before its
prefix, so this is the optimum of prefix-match hits too: the upper bound). Policies written
in Python replay with the same semantics through :mod:`kvdiag.simulation.policy_replay`; a stack
of LRU tiers (GPU, CPU, disk) with the same lookup through :mod:`kvdiag.simulation.tiers`. The
LRU curve over all capacities in one pass is :mod:`kvdiag.simulation.lru_curve`, the memory live
requests hold :mod:`kvdiag.simulation.footprint`, and the replay of a streamed trace
:mod:`kvdiag.simulation.streamed_replay`.

Rates, each with its denominator:

- block hit rate = prefix-hit blocks / referenced blocks (all requests' blocks);
- token hit rate = hit tokens / prompt tokens, a hit block counting
  ``min(block size, remaining prompt)`` tokens; prompt tails shorter than a block never hit;
- request hit rate = mean over requests with a prompt of (request's hit tokens / its prompt);
- bytes saved = hit tokens x KV bytes per token: KV not recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from kvdiag.simulation import _simkernels as K
from kvdiag.simulation.replay_common import CHUNK_REFS, log2_frame, request_chunks
from kvdiag.traces.trace import Trace

__all__ = ["POLICIES", "PrefixCacheSim", "SharingResult", "capacity_in_blocks", "hit_tokens_of",
           "next_references", "result_of_run", "s3fifo_sizes", "simulate", "simulate_many"]

POLICIES = ("lru", "fifo", "lfu", "s3fifo", "opt")
_CODES = {"lru": K.LRU, "fifo": K.FIFO, "lfu": K.LFU, "s3fifo": K.S3FIFO, "opt": K.OPT}
S3FIFO_SMALL_RATIO = 0.1


def s3fifo_sizes(capacity_blocks: int) -> tuple[int, int]:
    """(small FIFO target, ghost entries) of S3-FIFO at a capacity."""
    small = max(1, int(capacity_blocks * S3FIFO_SMALL_RATIO))
    return small, max(capacity_blocks - small, 1)


def next_references(block_ids: np.ndarray) -> np.ndarray:
    """``out[i]`` = position of the next reference to ``block_ids[i]``'s block, or
    ``len(block_ids)`` if there is none (vectorised: stable sort by block)."""
    n = len(block_ids)
    out = np.full(n, n, dtype=np.int64)
    if n < 2:
        return out
    order = np.argsort(block_ids, kind="stable")
    same = block_ids[order[1:]] == block_ids[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out


def capacity_in_blocks(trace: Trace, capacity_blocks: Optional[int] = None,
                       capacity_bytes: Optional[int] = None,
                       bytes_per_token: Optional[int] = None) -> Optional[int]:
    """A capacity as whole blocks: ``capacity_bytes // (block_size x bytes per token)``;
    None = unbounded."""
    if capacity_bytes is None:
        return capacity_blocks
    bpt = bytes_per_token or trace.bytes_per_token
    if not bpt:
        raise ValueError("a capacity in bytes needs the KV bytes per token (model or log header)")
    return int(capacity_bytes) // (trace.block_size_tokens * bpt)


@dataclass
class SharingResult:
    """One simulated (policy, capacity) run. See the module docstring for the definitions."""

    policy: str
    capacity_blocks: Optional[int]  # None = unbounded
    block_size_tokens: int
    requests: int
    block_refs: int
    distinct_blocks: int
    hit_blocks: int
    hit_tokens: int
    prompt_tokens: int
    evictions: int
    peak_cached_blocks: int
    bytes_per_token: Optional[int]
    request_hit_blocks: np.ndarray = field(repr=False)  # per request
    request_hit_tokens: np.ndarray = field(repr=False)
    request_prompt_tokens: np.ndarray = field(repr=False)
    eviction_age_hist: np.ndarray = field(repr=False)  # [k]: evictions idle 2^(k-1)..2^k-1 requests

    @property
    def block_hit_rate(self) -> float:
        """Prefix-hit blocks / referenced blocks."""
        return self.hit_blocks / self.block_refs if self.block_refs else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Hit tokens / prompt tokens (a hit block counts min(block, remaining prompt) tokens)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        """Mean over requests with a non-empty prompt of hit tokens / prompt tokens."""
        ok = self.request_prompt_tokens > 0
        if not ok.any():
            return 0.0
        return float(np.mean(self.request_hit_tokens[ok] / self.request_prompt_tokens[ok]))

    @property
    def bytes_saved(self) -> Optional[int]:
        """KV bytes not recomputed: hit tokens x bytes per token (None without bytes per token)."""
        return None if not self.bytes_per_token else self.hit_tokens * self.bytes_per_token

    def per_request(self) -> pd.DataFrame:
        """One row per request: prompt tokens, hit blocks and hit tokens."""
        return pd.DataFrame({"prompt_tokens": self.request_prompt_tokens,
                             "hit_blocks": self.request_hit_blocks,
                             "hit_tokens": self.request_hit_tokens})

    def eviction_ages(self) -> pd.DataFrame:
        """Evictions by idle age: requests between a block's last reference and its eviction,
        in power-of-two bins ``[age_min(requests), age_max(requests)]``."""
        return log2_frame(self.eviction_age_hist, "age", "requests", "evictions")

    def to_json(self) -> dict:
        """The ``kvdiag replay --json`` object of this run."""
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "block_hit_rate": self.block_hit_rate,
            "token_hit_rate": self.token_hit_rate,
            "request_hit_rate": self.request_hit_rate,
            "requests": self.requests,
            "block_refs": self.block_refs,
            "distinct_blocks": self.distinct_blocks,
            "bytes_saved": self.bytes_saved,
        }


def hit_tokens_of(trace: Trace, hit_blocks: np.ndarray) -> np.ndarray:
    """Per request: tokens of its first ``hit_blocks[r]`` blocks (vectorised via a cumsum)."""
    csum = np.concatenate([[0], np.cumsum(trace.block_tokens, dtype=np.int64)])
    return csum[trace.offsets[:-1] + hit_blocks] - csum[trace.offsets[:-1]]


class PrefixCacheSim:
    """A prefix cache of one policy and capacity, fed request batches of a trace in order.

    The offline :func:`simulate` runs it once over a whole trace; the live shadow mode keeps one
    and feeds it as requests arrive (block ids may grow between calls).
    """

    def __init__(self, policy: str, capacity_blocks: Optional[int], num_blocks: int = 1) -> None:
        if policy not in _CODES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError("capacity must be >= 0 blocks (None = unbounded)")
        self.policy = policy
        self.capacity_blocks = capacity_blocks
        cap = -1 if capacity_blocks is None else int(capacity_blocks)
        self._cap = cap
        self._small, self._ghost = s3fifo_sizes(max(cap, 1))
        self.state = K.new_state(num_blocks)

    def feed(self, block_ids: np.ndarray, offsets: np.ndarray, hits_out: np.ndarray,
             r_begin: int, r_end: int, next_ref: Optional[np.ndarray] = None,
             r_base: int = 0) -> None:
        """Replay requests ``r_begin..r_end-1``; ``hits_out[r]`` = their prefix-hit blocks.
        ``r_base`` = index of request 0 of this batch in the whole stream."""
        if self.policy == "opt" and next_ref is None:
            raise ValueError("OPT needs the future: next_ref of the whole trace")
        top = int(block_ids.max()) + 1 if len(block_ids) else 1
        self.state = K.grow_state(self.state, top)
        st = self.state
        if self.policy in ("lru", "fifo"):
            K.run_lru_fifo(self.policy == "lru", self._cap, block_ids, offsets, r_begin, r_end,
                           r_base, st["where"], st["prev"], st["nxt"], st["heads"], st["tails"],
                           st["sizes"], st["last_req"], st["counters"], st["age_hist"], hits_out)
            return
        nr = next_ref if next_ref is not None else np.empty(0, np.int64)
        K.run_requests(_CODES[self.policy], self._cap, self._small, self._ghost, block_ids,
                       offsets, nr, len(block_ids), r_begin, r_end, r_base, st["where"], st["prev"],
                       st["nxt"], st["heads"], st["tails"], st["sizes"], st["heap"], st["hpos"],
                       st["hkey"], st["freq"], st["last_req"], st["counters"], st["age_hist"],
                       hits_out)

    @property
    def evictions(self) -> int:
        return int(self.state["counters"][K.C_EVICTIONS])

    @property
    def peak_cached_blocks(self) -> int:
        return int(self.state["counters"][K.C_PEAK_BLOCKS])

    def cached_blocks(self) -> int:
        """Blocks held now."""
        return int(self.state["sizes"][K.L_MAIN] + self.state["sizes"][K.L_SMALL])


def simulate(trace: Trace, policy: str = "lru", capacity_blocks: Optional[int] = None, *,
             capacity_bytes: Optional[int] = None, bytes_per_token: Optional[int] = None,
             progress: Optional[Callable[[int], None]] = None,
             next_ref: Optional[np.ndarray] = None) -> SharingResult:
    """Replay ``trace`` through one prefix cache (``capacity_blocks`` None = unbounded).

    ``progress(refs)`` is called with the references done after each chunk of requests.
    """
    cap = capacity_in_blocks(trace, capacity_blocks, capacity_bytes, bytes_per_token)
    sim = PrefixCacheSim(policy, cap, trace.num_blocks)
    if policy == "opt" and next_ref is None:
        next_ref = next_references(trace.block_ids)
    hits = np.zeros(trace.rows, dtype=np.int64)
    for r0, r1 in request_chunks(trace.offsets, CHUNK_REFS):
        sim.feed(trace.block_ids, trace.offsets, hits, r0, r1, next_ref)
        if progress is not None:
            progress(int(trace.offsets[r1] - trace.offsets[r0]))
    return result_of_run(trace, policy, cap, hits, sim.evictions, sim.peak_cached_blocks,
                         sim.state["age_hist"].copy(), bytes_per_token)


def result_of_run(trace: Trace, policy: str, cap: Optional[int], hits: np.ndarray,
                  evictions: int, peak_cached_blocks: int, age_hist: np.ndarray,
                  bytes_per_token: Optional[int] = None) -> SharingResult:
    """The :class:`SharingResult` of a finished run from its per-row prefix-hit blocks."""
    hit_tokens = hit_tokens_of(trace, hits)
    prompt = trace.prompt_tokens
    if trace.counted is not None:  # drop the rows of blocks added at finish
        keep = trace.counted.astype(bool)
        hits, hit_tokens, prompt = hits[keep], hit_tokens[keep], prompt[keep]
    return SharingResult(
        policy=policy, capacity_blocks=cap, block_size_tokens=trace.block_size_tokens,
        requests=trace.requests, block_refs=trace.block_refs, distinct_blocks=trace.num_blocks,
        hit_blocks=int(hits.sum()), hit_tokens=int(hit_tokens.sum()),
        prompt_tokens=int(trace.prompt_tokens.sum()), evictions=evictions,
        peak_cached_blocks=peak_cached_blocks,
        bytes_per_token=bytes_per_token or trace.bytes_per_token,
        request_hit_blocks=hits, request_hit_tokens=hit_tokens, request_prompt_tokens=prompt,
        eviction_age_hist=age_hist)


def simulate_many(trace: Trace, policies: Sequence[str], capacities: Iterable[Optional[int]], *,
                  bytes_per_token: Optional[int] = None,
                  progress: Optional[Callable[[int], None]] = None) -> list[SharingResult]:
    """:func:`simulate` for every (policy, capacity) pair, policy-major order."""
    capacities = list(capacities)
    next_ref = next_references(trace.block_ids) if "opt" in policies else None
    return [simulate(trace, p, c, bytes_per_token=bytes_per_token, progress=progress,
                     next_ref=next_ref) for p in policies for c in capacities]
