"""Replay of streamed requests, batch by batch as they are read: what
:func:`~kvdiag.simulation.sharing.simulate`, :func:`~kvdiag.simulation.lru_curve.lru_curve` and
:func:`~kvdiag.simulation.footprint.memory_footprint` compute on a whole trace, with memory
that grows with distinct blocks and requests, not with block references."""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from kvdiag.simulation.footprint import MemoryFootprint
from kvdiag.simulation.lru_curve import HitRateCurve, StackState
from kvdiag.simulation.replay_common import CHUNK_REFS
from kvdiag.simulation.sharing import PrefixCacheSim, SharingResult


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
        self._stack = StackState() if curve else None
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
                  batch_refs: int = CHUNK_REFS,
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
