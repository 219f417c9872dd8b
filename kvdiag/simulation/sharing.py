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
of LRU tiers (GPU, CPU, disk) with the same lookup through :mod:`kvdiag.simulation.tiers`.

Rates, each with its denominator:

- block hit rate = prefix-hit blocks / referenced blocks (all requests' blocks);
- token hit rate = hit tokens / prompt tokens, a hit block counting
  ``min(block size, remaining prompt)`` tokens; prompt tails shorter than a block never hit;
- request hit rate = mean over requests with a prompt of (request's hit tokens / its prompt);
- bytes saved = hit tokens x KV bytes per token: KV not recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from kvdiag.simulation import _simkernels as K
from kvdiag.traces.trace import Trace

POLICIES = ("lru", "fifo", "lfu", "s3fifo", "opt")
_CODES = {"lru": K.LRU, "fifo": K.FIFO, "lfu": K.LFU, "s3fifo": K.S3FIFO, "opt": K.OPT}
S3FIFO_SMALL_RATIO = 0.1
_CHUNK_REFS = 1 << 16  # progress granularity


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
        return _log2_frame(self.eviction_age_hist, "age", "requests", "evictions")

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


def _log2_frame(hist: np.ndarray, what: str, unit: str, count: str) -> pd.DataFrame:
    bins = np.nonzero(hist)[0]
    lo = np.where(bins == 0, 0, 1 << np.maximum(bins - 1, 0))
    hi = np.where(bins == 0, 0, (1 << bins) - 1)
    return pd.DataFrame({f"{what}_min({unit})": lo, f"{what}_max({unit})": hi,
                         count: hist[bins]})


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


def _request_chunks(offsets: np.ndarray, refs_per_chunk: int) -> list[tuple[int, int]]:
    """Split requests into consecutive ranges of about ``refs_per_chunk`` references."""
    r = len(offsets) - 1
    if r <= 0:
        return []
    cuts = np.searchsorted(offsets, np.arange(refs_per_chunk, offsets[-1], refs_per_chunk))
    bounds = np.unique(np.concatenate([[0], np.clip(cuts, 1, r), [r]]))
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


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
    for r0, r1 in _request_chunks(trace.offsets, _CHUNK_REFS):
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


# ---------------------------------------------------------------- one-pass LRU curve


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
        return _log2_frame(self.reuse_hist, "distance", "blocks", "references")


class _StackState:
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
        self.state[0] = K.compact(last_time, owner, tree, int(self.state[0]))
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
        K.stack_distances(ids, offsets, block_tokens, prompt_tokens, counted, r0, r1,
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
    stack = _StackState(trace.num_blocks)
    for r0, r1 in _request_chunks(trace.offsets, _CHUNK_REFS):
        stack.feed(trace.block_ids, trace.offsets, trace.block_tokens, trace.prompt_tokens,
                   trace.counted_rows, r0, r1)
        if progress is not None:
            progress(int(trace.offsets[r1] - trace.offsets[r0]))
    return stack.curve(trace.num_blocks, trace.block_size_tokens, trace.requests,
                       trace.block_refs, int(trace.prompt_tokens.sum()),
                       bytes_per_token or trace.bytes_per_token)


# ---------------------------------------------------------------- memory held by live requests


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
    unshared, shared = K.live_peaks(trace.block_ids, trace.offsets, np.maximum(private, 0),
                                    pages, reqs[order], kinds[order], trace.num_blocks)
    bpt = bytes_per_token or trace.bytes_per_token
    return MemoryFootprint(trace.block_size_tokens, int(unshared), int(shared), model,
                           None if not bpt else bpt * trace.block_size_tokens)


# ---------------------------------------------------------------- streamed replay


def _block_tokens(prompt: np.ndarray, lens: np.ndarray, offsets: np.ndarray, bs: int) -> np.ndarray:
    """min(block size, remaining prompt) for every block of a batch of requests."""
    pos = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], lens)
    return np.clip(np.repeat(prompt, lens) - pos * bs, 0, bs).astype(np.int32)


class StreamingReplay:
    """Replays requests batch by batch as they are read: what :func:`simulate`,
    :func:`lru_curve` and :func:`memory_footprint` (request-window model) compute on a whole
    trace, with memory that grows with distinct blocks and requests, not block references.
    OPT needs the future and is not streamed."""

    def __init__(self, block_size_tokens: int, policies: Sequence[str],
                 capacities: Sequence[Optional[int]], *, curve: bool = False,
                 concurrency: int = 8, bytes_per_token: Optional[int] = None) -> None:
        if "opt" in policies:
            raise ValueError("OPT needs the whole trace: use simulate()")
        self.block_size_tokens = block_size_tokens
        self.bytes_per_token = bytes_per_token
        self.runs = [(p, c, PrefixCacheSim(p, c)) for p in policies for c in capacities]
        self._hits: list[list[np.ndarray]] = [[] for _ in self.runs]
        self._hit_tokens: list[list[np.ndarray]] = [[] for _ in self.runs]
        self._prompt: list[np.ndarray] = []
        self._keys: dict[int, int] = {}
        self.requests = 0
        self.block_refs = 0
        self._stack = _StackState() if curve else None
        self.concurrency = concurrency
        self._window: deque = deque()
        self._count = np.zeros(1, dtype=np.int64)
        self._held = [0, 0]  # unshared, shared blocks of the live window
        self.peaks = [0, 0]

    def feed(self, records: Sequence) -> None:
        """Replay a batch of :class:`~kvdiag.traces.request_traces.RequestRecord`."""
        if not records:
            return
        bs = self.block_size_tokens
        lens = np.array([len(r.keys) for r in records], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        keys = np.concatenate([r.keys for r in records]).tolist()
        table = self._keys
        ids = np.fromiter((table.setdefault(k, len(table)) for k in keys), dtype=np.int32,
                          count=len(keys))
        prompt = np.array([r.prompt_tokens for r in records], dtype=np.int64)
        tokens = _block_tokens(prompt, lens, offsets, bs)
        csum = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)])
        n = len(records)
        for k, (_, _, sim) in enumerate(self.runs):
            hits = np.zeros(n, dtype=np.int64)
            sim.feed(ids, offsets, hits, 0, n, r_base=self.requests)
            self._hits[k].append(hits)
            self._hit_tokens[k].append(csum[offsets[:-1] + hits] - csum[offsets[:-1]])
        if self._stack is not None:
            self._stack.feed(ids, offsets, tokens, prompt, np.ones(n, np.uint8), 0, n)
        self._window_feed(ids, offsets, prompt, lens)
        self._prompt.append(prompt)
        self.requests += n
        self.block_refs += len(ids)

    def _window_feed(self, ids, offsets, prompt, lens) -> None:
        if len(self._count) < len(self._keys):
            grown = np.zeros(max(len(self._keys), 2 * len(self._count)), dtype=np.int64)
            grown[:len(self._count)] = self._count
            self._count = grown
        count = self._count
        pages = -(-prompt // self.block_size_tokens)
        for r in range(len(prompt)):
            if len(self._window) == self.concurrency:  # the oldest finishes as this one arrives
                u_old, pages_old, private_old = self._window.popleft()
                count[u_old] -= 1
                self._held[0] -= pages_old
                self._held[1] -= int((count[u_old] == 0).sum()) + private_old
            u = np.unique(ids[offsets[r]:offsets[r + 1]])
            private = max(int(pages[r]) - int(lens[r]), 0)
            self._held[0] += int(pages[r])
            self._held[1] += int((count[u] == 0).sum()) + private
            count[u] += 1
            self._window.append((u, int(pages[r]), private))
            self.peaks = [max(self.peaks[0], self._held[0]), max(self.peaks[1], self._held[1])]

    @property
    def distinct_blocks(self) -> int:
        return len(self._keys)

    def results(self) -> list[SharingResult]:
        """One result per (policy, capacity), as :func:`simulate` returns on the whole trace."""
        prompt = np.concatenate(self._prompt) if self._prompt else np.zeros(0, np.int64)
        out = []
        for k, (policy, cap, sim) in enumerate(self.runs):
            hits = np.concatenate(self._hits[k]) if self._hits[k] else np.zeros(0, np.int64)
            hit_tokens = np.concatenate(self._hit_tokens[k]) if self._hit_tokens[k] else hits
            out.append(SharingResult(
                policy=policy, capacity_blocks=cap, block_size_tokens=self.block_size_tokens,
                requests=self.requests, block_refs=self.block_refs,
                distinct_blocks=self.distinct_blocks, hit_blocks=int(hits.sum()),
                hit_tokens=int(hit_tokens.sum()), prompt_tokens=int(prompt.sum()),
                evictions=sim.evictions, peak_cached_blocks=sim.peak_cached_blocks,
                bytes_per_token=self.bytes_per_token, request_hit_blocks=hits,
                request_hit_tokens=hit_tokens, request_prompt_tokens=prompt,
                eviction_age_hist=sim.state["age_hist"].copy()))
        return out

    def curve(self) -> HitRateCurve:
        """The one-pass LRU curve (needs ``curve=True``)."""
        if self._stack is None:
            raise ValueError("StreamingReplay(curve=True) computes the curve")
        prompt = sum(int(p.sum()) for p in self._prompt)
        return self._stack.curve(self.distinct_blocks, self.block_size_tokens, self.requests,
                                 self.block_refs, prompt, self.bytes_per_token)

    def footprint(self) -> MemoryFootprint:
        """:func:`memory_footprint` with the request-window model."""
        bpb = None if not self.bytes_per_token else self.bytes_per_token * self.block_size_tokens
        return MemoryFootprint(self.block_size_tokens, self.peaks[0], self.peaks[1],
                               f"arrival until {self.concurrency} later arrivals", bpb)


def replay_stream(records: Iterable, block_size_tokens: int, policies: Sequence[str],
                  capacities: Sequence[Optional[int]], *, curve: bool = False,
                  concurrency: int = 8, bytes_per_token: Optional[int] = None,
                  batch_refs: int = _CHUNK_REFS,
                  progress: Optional[Callable[[int], None]] = None) -> StreamingReplay:
    """Feed streamed requests (:func:`~kvdiag.traces.request_traces.iter_requests`) to a
    :class:`StreamingReplay` in batches of about ``batch_refs`` block references."""
    replay = StreamingReplay(block_size_tokens, policies, capacities, curve=curve,
                             concurrency=concurrency, bytes_per_token=bytes_per_token)
    batch, refs = [], 0
    for rec in records:
        batch.append(rec)
        refs += len(rec.keys)
        if refs >= batch_refs:
            replay.feed(batch)
            if progress is not None:
                progress(refs)
            batch, refs = [], 0
    replay.feed(batch)
    if progress is not None and refs:
        progress(refs)
    return replay
