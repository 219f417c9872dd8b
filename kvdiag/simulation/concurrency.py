"""Event simulation of what live requests hold over time: sequences and KV blocks.

The hold model (one request, ``p`` prompt tokens, ``o`` output tokens, block size ``B``):

- it holds its prompt from ``start_s`` (arrival): ``ceil(p / B)`` blocks;
- decoding starts at ``first_token_s``, one token every ``d = (finish_s - first_token_s) / o``
  seconds: during ``[first_token_s + k d, first_token_s + (k + 1) d)`` it holds ``p + k``
  tokens, k = 1 .. o - 1 (the last sampled token's KV is never written, as in vLLM), i.e.
  ``ceil((p + k) / B)`` blocks;
- at ``finish_s`` it frees everything. Where events tie, frees come first.

With prompt keys (:class:`kvdiag.traces.workload.PromptKeys`) a prompt block is held once
however many live requests reference its key, as long as any of them is live (prefix sharing
among live requests; blocks kept only by an engine's prefix cache are not counted, as an
engine's ``blocks_used`` does not count them). Everything is vectorised: sort the events,
take cumulative sums.

Statistics of a level over time (:class:`Timeline`) are over ``[first event, last event]``:
``peak`` is the highest level at any instant; ``quantile(q)`` is time-weighted (the smallest
level the simulation stays at or under for a fraction ``q`` of the time); ``mean`` is the
time average.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvdiag.traces.workload import PromptKeys


@dataclass
class HoldSchedule:
    """When each request holds KV: ``start_s`` .. ``finish_s``, decoding from
    ``first_token_s`` (module docstring)."""

    start_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray


@dataclass
class Timeline:
    """A level (sequences, blocks) after each event, at sorted event times."""

    times_s: np.ndarray
    level: np.ndarray

    @property
    def peak(self) -> int:
        return int(self.level.max()) if len(self.level) else 0

    def _durations(self) -> np.ndarray:
        return np.diff(self.times_s, append=self.times_s[-1]) if len(self.times_s) else self.times_s

    def quantile(self, q: float) -> int:
        """Smallest level held for at least a fraction ``q`` of the time (the peak when the
        timeline has no duration)."""
        dt = self._durations()
        total = dt.sum()
        if total <= 0:
            return self.peak
        order = np.argsort(self.level, kind="stable")
        cum = np.cumsum(dt[order])
        return int(self.level[order][min(np.searchsorted(cum, q * total), len(cum) - 1)])

    def mean(self) -> float:
        dt = self._durations()
        total = dt.sum()
        return float((self.level * dt).sum() / total) if total > 0 else float(self.peak)

    def binned_max(self, bins: int = 100) -> list[tuple[float, int]]:
        """(bin start in s, highest level in the bin) over the timeline's span."""
        if not len(self.times_s):
            return []
        edges = np.linspace(self.times_s[0], self.times_s[-1], bins + 1)
        idx = np.searchsorted(self.times_s, edges, side="right")
        out = []
        for j in range(bins):
            lo, hi = max(idx[j] - 1, 0), max(idx[j + 1], idx[j])
            out.append((float(edges[j]), int(self.level[lo:hi].max()) if hi > lo else 0))
        return out


def timeline(times_s: np.ndarray, deltas: np.ndarray) -> Timeline:
    """Level after each event of ``deltas`` at ``times_s`` (ties: decrements first)."""
    order = np.lexsort((deltas, times_s))
    return Timeline(times_s[order], np.cumsum(deltas[order]))


def sequences(schedule: HoldSchedule) -> Timeline:
    """Live requests over time: +1 at start, -1 at finish."""
    n = len(schedule.start_s)
    return timeline(np.concatenate([schedule.start_s, schedule.finish_s]),
                    np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)]))


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


def _growth_events(schedule: HoldSchedule, prompt_tokens: np.ndarray,
                   block_size_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Times of the decode steps at which a request takes one more block (k with
    ``(p + k - 1) % B == 0``, 1 <= k <= o - 1), and the request of each."""
    B = block_size_tokens
    p, o = prompt_tokens, schedule.output_tokens
    first_k = _ceil_div(p, B) * B - p + 1
    counts = np.where(first_k <= o - 1, (o - 1 - first_k) // B + 1, 0)
    counts = np.maximum(counts, 0)
    req = np.repeat(np.arange(len(p)), counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    k = first_k[req] + within * B
    step_s = (schedule.finish_s - schedule.first_token_s) / np.maximum(o, 1)
    return schedule.first_token_s[req] + k * step_s[req], req


def held_blocks(schedule: HoldSchedule, block_size_tokens: int,
                prompt_tokens: Optional[np.ndarray] = None,
                keys: Optional[PromptKeys] = None) -> Timeline:
    """KV blocks held by live requests over time (module docstring). ``prompt_tokens``
    replaces the schedule's (a prompt shortened by an assumed sharing hit rate); ``keys``
    counts each shared prompt block once while any request holding it is live."""
    B = block_size_tokens
    p = schedule.prompt_tokens if prompt_tokens is None else prompt_tokens
    o = schedule.output_tokens
    last_blocks = _ceil_div(p + np.maximum(o - 1, 0), B)
    keyed = np.zeros(len(p), np.int64)
    key_times, key_deltas = np.zeros(0), np.zeros(0, np.int64)
    if keys is not None:
        cum = np.concatenate([[0], np.cumsum(keys.key_blocks[keys.key_ids])])
        keyed = np.minimum(cum[keys.offsets[1:]] - cum[keys.offsets[:-1]], _ceil_div(p, B))
        key_times, key_deltas = _shared_key_events(schedule, keys)
    grow_t, _ = _growth_events(schedule, p, B)
    times = np.concatenate([schedule.start_s, grow_t, schedule.finish_s, key_times])
    deltas = np.concatenate([_ceil_div(p, B) - keyed, np.ones(len(grow_t), np.int64),
                             -(last_blocks - keyed), key_deltas])
    return timeline(times, deltas)


def _shared_key_events(schedule: HoldSchedule, keys: PromptKeys) -> tuple[np.ndarray, np.ndarray]:
    """+blocks when a key's first live holder starts, -blocks when its last live holder
    finishes: the union of its holders' [start, finish) intervals, merged where they overlap
    or touch."""
    lengths = np.diff(keys.offsets)
    req = np.repeat(np.arange(len(lengths)), lengths)
    key = keys.key_ids
    if not len(key):
        return np.zeros(0), np.zeros(0, np.int64)
    s, e = schedule.start_s[req], schedule.finish_s[req]
    order = np.lexsort((s, key))
    key, s, e = key[order], s[order], e[order]
    # Offsetting each key's times by key x span keeps a global running max inside each key.
    lo = min(s.min(), e.min())
    span = float(max(s.max(), e.max()) - lo) + 1.0
    so, eo = (s - lo) + key * span, (e - lo) + key * span
    run_end = np.maximum.accumulate(eo)
    new_segment = np.ones(len(key), bool)
    new_segment[1:] = (key[1:] != key[:-1]) | (so[1:] > run_end[:-1])
    seg_start = np.flatnonzero(new_segment)
    weight = keys.key_blocks[key[seg_start]]
    starts = s[seg_start]
    ends = np.maximum.reduceat(e, seg_start)
    return (np.concatenate([starts, ends]), np.concatenate([weight, -weight]))


@dataclass
class PoolOverflow:
    """What a pool of ``pool_blocks`` would have faced: the time the simulated demand spent
    above it (``over_s``, its fraction of the span), the requests live during such a time
    (preempted under recompute preemption, or out of memory without it, unless the scheduler
    had queued them), the first moment it overflows, and the headroom the peak asks for."""

    pool_blocks: int
    over_s: float
    over_fraction: float
    requests_affected: int
    first_overflow_s: Optional[float]
    headroom_blocks: int  # peak - pool (<= 0: the pool always suffices)


def pool_overflow(blocks: Timeline, schedule: HoldSchedule, pool_blocks: int) -> PoolOverflow:
    """Overflow of ``blocks`` (a :func:`held_blocks` timeline) over a pool (class docstring)."""
    t, level = blocks.times_s, blocks.level
    over = level > pool_blocks
    dt = blocks._durations()
    span = float(t[-1] - t[0]) if len(t) else 0.0
    # maximal runs of events after which the level is above the pool: [start, end)
    edges = np.diff(np.concatenate([[0], over.astype(np.int8), [0]]))
    run_start, run_end = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    starts = t[run_start]
    ends = t[np.minimum(run_end, len(t) - 1)]
    keep = ends > starts  # an instant above the pool (ties at one time) holds no memory
    starts, ends = starts[keep], ends[keep]
    nxt = np.searchsorted(ends, schedule.start_s, side="right")
    hit = (nxt < len(ends)) & (schedule.finish_s > schedule.start_s)  # zero-length: holds nothing
    hit[hit] = starts[nxt[hit]] < schedule.finish_s[hit]
    over_s = float(dt[over].sum())
    return PoolOverflow(pool_blocks, over_s, over_s / span if span > 0 else 0.0, int(hit.sum()),
                        float(starts[0]) if len(starts) else None, blocks.peak - pool_blocks)


def predicted_reservations(schedule: HoldSchedule, block_size_tokens: int) -> Timeline:
    """Blocks a scheduler would reserve if it admitted each request for its predicted final
    size, ``ceil((prompt + predicted output) / B)``, held from start to finish. The predicted
    output is the mean output of the requests that finished before it arrived (the workload's
    history; none yet: 0, the prompt alone)."""
    order = np.argsort(schedule.finish_s, kind="stable")
    done_finish = schedule.finish_s[order]
    done_output = np.concatenate([[0], np.cumsum(schedule.output_tokens[order])])
    seen = np.searchsorted(done_finish, schedule.start_s, side="right")
    predicted = np.where(seen > 0, done_output[seen] / np.maximum(seen, 1), 0.0)
    blocks = _ceil_div(schedule.prompt_tokens + np.ceil(predicted).astype(np.int64), block_size_tokens)
    n = len(blocks)
    return timeline(np.concatenate([schedule.start_s, schedule.finish_s]),
                    np.concatenate([blocks, -blocks]) if n else np.zeros(0, np.int64))
