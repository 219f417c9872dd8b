"""The trace every loader produces: requests as chained block keys over dense block ids (CSR
layout), built incrementally by :class:`TraceBuilder`, or from block keys or token ids given
in memory."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.pool.hashing import chunk_hashes

DEFAULT_BLOCK_TOKENS = 16  # vLLM's default block size


@dataclass
class Trace:
    """Requests as block-reference sequences (CSR layout over dense block ids).

    ``block_ids[offsets[r]:offsets[r+1]]`` are request ``r``'s blocks in prompt order;
    ``block_tokens[i]`` = prompt tokens the block at reference ``i`` holds
    (``min(block_size, remaining prompt)``), which a hit on it saves.
    """

    block_ids: np.ndarray  # int32 [refs]
    offsets: np.ndarray  # int64 [requests + 1]
    block_tokens: np.ndarray  # int32 [refs]
    prompt_tokens: np.ndarray  # int64 [requests]
    num_blocks: int  # distinct blocks
    block_size_tokens: int
    format: str
    source: str = ""
    arrival_ns: Optional[np.ndarray] = None  # int64 [requests]
    finish_ns: Optional[np.ndarray] = None  # int64 [requests], -1 unknown
    engine_cached_tokens: Optional[np.ndarray] = None  # int64 [requests], -1 unknown or not counted
    bytes_per_token: Optional[int] = None
    notes: list[str] = field(default_factory=list)
    # rows that are requests (1) or the blocks a request adds when it finishes (0: prompt and
    # generated tokens, as engines cache them); None = every row is a request
    counted: Optional[np.ndarray] = None  # uint8 [rows]

    @property
    def rows(self) -> int:
        return len(self.prompt_tokens)

    @property
    def counted_rows(self) -> np.ndarray:
        return np.ones(self.rows, np.uint8) if self.counted is None else self.counted

    @property
    def requests(self) -> int:
        return self.rows if self.counted is None else int(self.counted.sum())

    @property
    def block_refs(self) -> int:
        """Block references of requests' prompts (not the blocks added at finish)."""
        if self.counted is None:
            return len(self.block_ids)
        return int((np.diff(self.offsets) * self.counted).sum())

    def requests_only(self) -> "Trace":
        """The trace without the rows of blocks added at finish."""
        if self.counted is None:
            return self
        keep = np.nonzero(self.counted)[0]
        lens = np.diff(self.offsets)[keep]
        take = np.concatenate([np.arange(self.offsets[r], self.offsets[r + 1]) for r in keep]) \
            if len(keep) else np.zeros(0, np.int64)
        pick = (lambda a: None if a is None else a[keep])
        return Trace(self.block_ids[take], np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                     self.block_tokens[take], self.prompt_tokens[keep], self.num_blocks,
                     self.block_size_tokens, self.format, self.source, pick(self.arrival_ns),
                     pick(self.finish_ns), pick(self.engine_cached_tokens), self.bytes_per_token,
                     list(self.notes))

    def plain(self) -> "Trace":
        """Plain cache semantics: every block reference becomes a request of one block, so a
        lookup no longer depends on the blocks before it (what libCacheSim simulates)."""
        n = self.block_refs
        return Trace(self.block_ids, np.arange(n + 1, dtype=np.int64), self.block_tokens,
                     self.block_tokens.astype(np.int64), self.num_blocks,
                     self.block_size_tokens, self.format + "+plain", self.source,
                     bytes_per_token=self.bytes_per_token)

    def repeated(self, times: int) -> "Trace":
        """The trace played ``times`` times back to back (same blocks)."""
        n = self.block_refs
        offsets = np.concatenate([self.offsets[:-1] + k * n for k in range(times)] + [[n * times]])
        return Trace(np.tile(self.block_ids, times), offsets.astype(np.int64),
                     np.tile(self.block_tokens, times), np.tile(self.prompt_tokens, times),
                     self.num_blocks, self.block_size_tokens, self.format, self.source,
                     bytes_per_token=self.bytes_per_token)


class TraceBuilder:
    """Accumulates requests (raw 64-bit keys) compactly; :meth:`build` remaps keys to dense ids."""

    def __init__(self, block_size_tokens: int, fmt: str, source: str) -> None:
        self.block_size_tokens = block_size_tokens
        self.format = fmt
        self.source = source
        self._keys = array("q")
        self._tokens = array("i")
        self._offsets = array("q", [0])
        self._prompt = array("q")
        self._arrival = array("q")
        self._finish = array("q")
        self._cached = array("q")
        self._counted = array("B")

    def add(self, keys, prompt_tokens: int, *, block_tokens=None, arrival_ns: int = -1,
            finish_ns: int = -1, engine_cached_tokens: int = -1, counted: bool = True) -> None:
        """One request: its block keys in prompt order. ``block_tokens`` defaults to
        ``min(block_size, remaining prompt)`` per block. ``counted=False``: not a request but
        the blocks one adds to the cache when it finishes (no lookup, no tokens)."""
        keys = np.asarray(keys, dtype=np.int64)
        if block_tokens is None:
            starts = np.arange(len(keys), dtype=np.int64) * self.block_size_tokens
            block_tokens = np.clip(prompt_tokens - starts, 0, self.block_size_tokens)
        self._keys.frombytes(keys.tobytes())
        self._tokens.frombytes(np.asarray(block_tokens, dtype=np.int32).tobytes())
        self._offsets.append(self._offsets[-1] + len(keys))
        self._prompt.append(int(prompt_tokens))
        self._arrival.append(int(arrival_ns))
        self._finish.append(int(finish_ns))
        self._cached.append(int(engine_cached_tokens))
        self._counted.append(1 if counted else 0)

    def build(self, bytes_per_token: Optional[int] = None) -> Trace:
        keys = np.frombuffer(self._keys, dtype=np.int64)
        if len(keys):
            codes, uniques = pd.factorize(keys, sort=False)
        else:
            codes, uniques = np.empty(0, np.int64), []
        arrival = np.frombuffer(self._arrival, dtype=np.int64).copy()
        finish = np.frombuffer(self._finish, dtype=np.int64).copy()
        cached = np.frombuffer(self._cached, dtype=np.int64).copy()
        counted = np.frombuffer(self._counted, dtype=np.uint8).copy()
        return Trace(
            block_ids=codes.astype(np.int32),
            offsets=np.frombuffer(self._offsets, dtype=np.int64).copy(),
            block_tokens=np.frombuffer(self._tokens, dtype=np.int32).copy(),
            prompt_tokens=np.frombuffer(self._prompt, dtype=np.int64).copy(),
            num_blocks=len(uniques),
            block_size_tokens=self.block_size_tokens,
            format=self.format,
            source=self.source,
            arrival_ns=arrival if (arrival >= 0).any() else None,
            finish_ns=finish if (finish >= 0).any() else None,
            engine_cached_tokens=cached if (cached >= 0).any() else None,
            bytes_per_token=bytes_per_token,
            counted=None if counted.all() else counted,
        )


def trace_from_blocks(requests: list[list[int]], block_size_tokens: int = 1,
                      prompt_tokens: Optional[list[int]] = None, fmt: str = "blocks") -> Trace:
    """A trace from per-request lists of block keys (prompt = whole blocks unless given)."""
    b = TraceBuilder(block_size_tokens, fmt, "")
    for i, keys in enumerate(requests):
        n = len(keys) * block_size_tokens if prompt_tokens is None else prompt_tokens[i]
        b.add(np.asarray(keys, dtype=np.int64), n)
    return b.build()


def trace_from_tokens(requests: list[list[int]], block_size_tokens: int,
                      hash_algorithm: str = "fast") -> Trace:
    """A trace from per-request token ids, chunked and chain-hashed like the ``tokens`` format."""
    b = TraceBuilder(block_size_tokens, "tokens", "")
    for tokens in requests:
        b.add(chunk_hashes(tokens, block_size_tokens, algorithm=hash_algorithm), len(tokens))
    return b.build()
