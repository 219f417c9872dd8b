"""Missed prompt tokens counted by cause: the causes, one request's misses, their cumulative
tally (tokens per cause, evicted tokens by log2 bin of reuse distance and of time since last
use) and a log's tally per time window. The causes are defined in
:mod:`kvdiag.diagnosis.miss_causes`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

CAUSES = ("cold", "evicted", "hash_domain", "below_block", "preemption", "in_flight", "engine_skip", "unknown")
"""Every cause, in the order tables list them."""
COLD, EVICTED, HASH_DOMAIN, BELOW_BLOCK, PREEMPTION, IN_FLIGHT, ENGINE_SKIP, UNKNOWN = range(len(CAUSES))
REUSE_BINS = 48  # log2 bins: [k] holds values 2^(k-1) .. 2^k - 1 ([0]: 0)


@dataclass(frozen=True, slots=True)
class RequestMisses:
    """One finished request's missed tokens by cause (``tokens[i]`` for ``CAUSES[i]``);
    ``evicted``: (reuse distance in block references or None, time since last use in ns or
    None, missed tokens) per evicted block; ``shadow_hit_tokens``: the shadow's hit blocks at
    arrival x block size (None: unknown); ``status`` that of its ``RequestFinished``;
    ``held_evicted_tokens``: the part of its ``evicted`` tokens that the shadow held at arrival
    (the engine's own eviction, seen in its events: the pool under pressure)."""

    ts_ns: int
    request_id: str
    prompt_tokens: int
    cached_prompt_tokens: int
    missed_tokens: int
    tokens: tuple[int, ...]
    evicted: tuple[tuple[Optional[int], Optional[int], int], ...] = ()
    shadow_hit_tokens: Optional[int] = None
    status: str = "finished"
    held_evicted_tokens: int = 0

    @property
    def explained_tokens(self) -> int:
        """:func:`explained_tokens` of this request."""
        return explained_tokens(self.tokens, self.held_evicted_tokens)


def explained_tokens(tokens, held_evicted_tokens: int) -> int:
    """Missed tokens that the shadow at the engine's settings held at arrival and that the
    engine's own events say why it missed: it had let them go (``held_evicted_tokens``), it
    preempted the request (``preemption``) or no block held them yet when it looked the request
    up (``in_flight``). What ``sharing.consistency`` does not count against the engine
    (:func:`kvdiag.diagnosis.rules.unexplained_gap`)."""
    return held_evicted_tokens + tokens[PREEMPTION] + tokens[IN_FLIGHT]


@dataclass
class MissTally:
    """Cumulative counts over finished requests: tokens per cause (sum = ``missed_tokens``),
    evicted tokens by log2 bin of reuse distance (block references) and of time since last use
    (ms), unknown distances in ``evicted_unknown_tokens``."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    missed_tokens: int = 0
    tokens: list[int] = field(default_factory=lambda: [0] * len(CAUSES))
    reuse_hist: list[int] = field(default_factory=lambda: [0] * REUSE_BINS)
    age_ms_hist: list[int] = field(default_factory=lambda: [0] * REUSE_BINS)
    evicted_unknown_tokens: int = 0
    held_evicted_tokens: int = 0

    def add(self, r: RequestMisses) -> None:
        self.count(r.prompt_tokens, r.cached_prompt_tokens, r.missed_tokens, r.tokens, r.evicted,
                   r.held_evicted_tokens)

    def count(self, prompt_tokens: int, cached_tokens: int, missed_tokens: int, tokens, evicted,
              held_evicted_tokens: int = 0) -> None:
        """:meth:`add` of a request given by its fields (as :class:`RequestMisses` names them)."""
        self.requests += 1
        self.held_evicted_tokens += held_evicted_tokens
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.missed_tokens += missed_tokens
        mine = self.tokens
        for i, n in enumerate(tokens):
            mine[i] += n
        last = REUSE_BINS - 1
        for reuse, age_ns, n in evicted:
            if reuse is None:
                self.evicted_unknown_tokens += n
            else:  # the log2 bin (REUSE_BINS)
                self.reuse_hist[min(int(reuse).bit_length(), last)] += n
                self.age_ms_hist[min(int(age_ns // 1_000_000).bit_length(), last)] += n

    def by_cause(self) -> dict[str, int]:
        return dict(zip(CAUSES, self.tokens))

    def shares(self) -> dict[str, Optional[float]]:
        """Each cause's share of the missed tokens (None without missed tokens)."""
        m = self.missed_tokens
        return {c: (n / m if m else None) for c, n in zip(CAUSES, self.tokens)}


class ExplainedLog:
    """The finished requests with :func:`explained_tokens`: each one's finish time (its
    ``RequestFinished.ts_ns``) and those tokens, in arrival order (two int64 arrays: 16 bytes a
    row, none for the requests without any). ``sharing.consistency`` sums them over its window
    (:func:`explained_between`), live (``kvdiag top``, handed over) and over a log."""

    __slots__ = ("ts_ns", "tokens")

    def __init__(self) -> None:
        self.ts_ns = array("q")
        self.tokens = array("q")

    def add(self, ts_ns: int, tokens: int) -> None:
        self.ts_ns.append(ts_ns)
        self.tokens.append(tokens)

    def copy(self) -> "ExplainedLog":
        out = ExplainedLog()
        out.ts_ns, out.tokens = array("q", self.ts_ns), array("q", self.tokens)
        return out

    def between(self, start_ns: Optional[int], end_ns: Optional[int]) -> int:
        """:func:`explained_between` over these rows."""
        return explained_between(np.frombuffer(self.ts_ns, np.int64) if self.ts_ns else np.zeros(0, np.int64),
                                 np.frombuffer(self.tokens, np.int64) if self.tokens else np.zeros(0, np.int64),
                                 start_ns, end_ns)


def explained_between(ts_ns: np.ndarray, tokens: np.ndarray, start_ns: Optional[int],
                      end_ns: Optional[int]) -> int:
    """The explained tokens of the requests that finished in ``(start_ns, end_ns]`` (None: open
    at that end): the requests ``sharing.consistency`` compares."""
    keep = np.ones(len(ts_ns), bool)
    if start_ns is not None:
        keep &= ts_ns > start_ns
    if end_ns is not None:
        keep &= ts_ns <= end_ns
    return int(tokens[keep].sum())


def hist_median(hist: list[int]) -> Optional[int]:
    """Upper bound of the log2 bin holding the weighted median (None when empty)."""
    total = sum(hist)
    if not total:
        return None
    acc = 0
    for k, n in enumerate(hist):
        acc += n
        if 2 * acc >= total:
            return (1 << k) - 1 if k else 0
    return None


# ---------------------------------------------------------------- offline: windows


@dataclass(frozen=True)
class MissWindow:
    """Requests that finished in ``[start_ns, end_ns)``: their missed tokens by cause."""

    start_ns: int
    end_ns: int
    tally: MissTally

    def to_dict(self) -> dict:
        t = self.tally
        return {"start_ns": self.start_ns, "end_ns": self.end_ns, "requests": t.requests,
                "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                "missed_tokens": t.missed_tokens, "tokens": t.by_cause(), "shares": t.shares(),
                "evicted_median_reuse_refs": hist_median(t.reuse_hist),
                "evicted_median_age_ms": hist_median(t.age_ms_hist),
                "evicted_unknown_distance_tokens": t.evicted_unknown_tokens}


@dataclass(frozen=True)
class MissCauses:
    """A log's misses: the totals, one :class:`MissWindow` per ``window_ns`` (from the first
    finish) and every request's :class:`RequestMisses`."""

    total: MissTally
    windows: list[MissWindow]
    requests: list[RequestMisses]
    window_ns: int
    block_size_tokens: Optional[int]
    capacity_blocks: Optional[int]

    def cut(self, window_s: float) -> "MissCauses":
        """The same requests in ``window_s`` windows, from the first finish."""
        window_ns = max(int(window_s * 1e9), 1)
        windows: list[MissWindow] = []
        if self.requests:
            t0 = min(r.ts_ns for r in self.requests)
            by: dict[int, MissTally] = {}
            for r in self.requests:
                by.setdefault((r.ts_ns - t0) // window_ns, MissTally()).add(r)
            windows = [MissWindow(t0 + k * window_ns, t0 + (k + 1) * window_ns, by[k]) for k in sorted(by)]
        return MissCauses(self.total, windows, self.requests, window_ns, self.block_size_tokens,
                          self.capacity_blocks)

    def to_dict(self) -> dict:
        whole = MissWindow(self.windows[0].start_ns if self.windows else 0,
                           self.windows[-1].end_ns if self.windows else 0, self.total)
        return {"block_size_tokens": self.block_size_tokens, "capacity_blocks": self.capacity_blocks,
                "window_s": self.window_ns / 1e9, "total": whole.to_dict(),
                "windows": [w.to_dict() for w in self.windows]}
