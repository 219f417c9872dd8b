"""numba replays of the learned plug-ins (:mod:`kvdiag.simulation.learned_policies`), exactly.

Each function is the plug-in replay loop of :func:`kvdiag.simulation.policy_replay._replay` with
one policy's hooks inlined, over integer arrays. They reproduce the Python plug-ins decision
for decision (the tests compare hits per request, evictions, peak and the age histogram):

- ``prefix-lru``: the Python policy's lazily cleaned heap of (last used, block) returns the
  least recently used cached block with no cached successor, and last-used times are unique
  (one block per clock tick), so an indexed heap of the current leaves keyed by last use gives
  the same victims. ``kids[b]`` counts b's cached successors (blocks whose chain parent is b).
- ``lecar``: by_recency = the cached block used least recently, by_frequency = the cached block
  of smallest (count, last used) (both indexed heaps); the expert draws are the Python
  policy's own ``random.Random(seed).random()`` sequence, computed beforehand by numpy's
  MT19937 started from that generator's state (same algorithm and the same 53-bit
  conversion); weights, regrets and normalisation use the same float operations in the same
  order. Each expert's history is a FIFO of (block, eviction time) with lazy deletion.

Return value: (evictions, peak cached blocks, status); status 1 means the Python policy would
have raised (no leaf to evict); the caller then replays in Python for its error message.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from kvdiag.simulation._heapkernels import _heap_pop, _heap_push, _heap_update, _sift_down, _sift_up
from kvdiag.simulation._simkernels import _bin, leading_held_jit
from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()

_SHIFT = 1 << 40  # lecar frequency key = count * _SHIFT + last used (times < 2^40 refs)


@njit(cache=True, inline="always")
def _heap_remove(x, n, heap, hpos, hkey):
    i = hpos[x]
    hpos[x] = -1
    last = heap[n - 1]
    if i != n - 1:
        heap[i] = last
        hpos[last] = i
        _sift_up(i, heap, hpos, hkey)
        _sift_down(hpos[last], n - 1, heap, hpos, hkey)


@njit(cache=True)
def run_prefix_lru(capacity, ids, offsets, num_blocks, hits_out, age_hist):
    """The ``prefix-lru`` plug-in's replay (module docstring). Long: one compiled hot loop whose
    steps share local state (list ends, counters, heaps) that helper calls would pass back and
    forth at every block."""
    n = max(num_blocks, 1)
    cached = np.zeros(n, np.uint8)
    last_used = np.zeros(n, np.int64)
    last_req = np.zeros(n, np.int64)
    parent = np.full(n, -2, np.int64)
    kids = np.zeros(n, np.int64)
    heap = np.zeros(n, np.int64)
    hpos = np.full(n, -1, np.int64)
    hkey = np.zeros(n, np.int64)
    size = 0
    held = 0
    evictions = 0
    peak = 0
    clock = 0
    for r in range(len(offsets) - 1):
        s, e = offsets[r], offsets[r + 1]
        h = leading_held_jit(ids, s, e, cached)
        hits_out[r] = h
        before = -1
        for i in range(s, e):
            x = ids[i]
            clock += 1
            if parent[x] == -2:
                parent[x] = before if before != x else -1
            before = x
            if cached[x]:
                last_used[x] = clock
                last_req[x] = r
                if hpos[x] >= 0:
                    _heap_update(x, clock, size, heap, hpos, hkey)
                continue
            if capacity == 0:
                continue
            if capacity > 0:
                while held >= capacity:
                    if size == 0:
                        return evictions, peak, 1
                    v = _heap_pop(size, heap, hpos, hkey)
                    size -= 1
                    cached[v] = 0
                    held -= 1
                    evictions += 1
                    age_hist[_bin(r - last_req[v])] += 1
                    p = parent[v]
                    if p >= 0:
                        kids[p] -= 1
                        if cached[p] and kids[p] == 0:
                            _heap_push(p, last_used[p], size, heap, hpos, hkey)
                            size += 1
            cached[x] = 1
            held += 1
            last_used[x] = clock
            last_req[x] = r
            p = parent[x]
            if p >= 0:
                kids[p] += 1
                if hpos[p] >= 0:
                    _heap_remove(p, size, heap, hpos, hkey)
                    size -= 1
            if kids[x] == 0:
                _heap_push(x, clock, size, heap, hpos, hkey)
                size += 1
            if held > peak:
                peak = held
    return evictions, peak, 0


@njit(cache=True)
def run_lecar(capacity, ids, offsets, num_blocks, draws, learning_rate, discount, hits_out, age_hist,
              weights):
    """The ``lecar`` plug-in's replay (module docstring). Long: one compiled hot loop whose
    steps share local state (list ends, counters, heaps) that helper calls would pass back and
    forth at every block."""
    n = max(num_blocks, 1)
    total_refs = len(ids)
    cached = np.zeros(n, np.uint8)
    last_used = np.zeros(n, np.int64)
    last_req = np.zeros(n, np.int64)
    count = np.zeros(n, np.int64)
    rheap = np.zeros(n, np.int64)
    rpos = np.full(n, -1, np.int64)
    rkey = np.zeros(n, np.int64)
    fheap = np.zeros(n, np.int64)
    fpos = np.full(n, -1, np.int64)
    fkey = np.zeros(n, np.int64)
    hist_at = np.full((2, n), -1, np.int64)
    hist_cnt = np.zeros((2, n), np.int64)
    q_block = np.zeros((2, total_refs + 1), np.int64)
    q_time = np.zeros((2, total_refs + 1), np.int64)
    q_head = np.zeros(2, np.int64)
    q_tail = np.zeros(2, np.int64)
    hist_len = np.zeros(2, np.int64)
    w0, w1 = weights[0], weights[1]
    size = 0
    held = 0
    evictions = 0
    peak = 0
    clock = 0
    draw = 0
    for r in range(len(offsets) - 1):
        s, e = offsets[r], offsets[r + 1]
        h = leading_held_jit(ids, s, e, cached)
        hits_out[r] = h
        for i in range(s, e):
            x = ids[i]
            clock += 1
            if cached[x]:
                last_used[x] = clock
                last_req[x] = r
                count[x] += 1
                _heap_update(x, clock, size, rheap, rpos, rkey)
                _heap_update(x, count[x] * _SHIFT + clock, size, fheap, fpos, fkey)
                continue
            if capacity == 0:
                continue
            if capacity > 0:
                while held >= capacity:
                    by_recency = rheap[0]
                    by_frequency = fheap[0]
                    expert = 0 if draws[draw] < w0 else 1
                    draw += 1
                    v = by_recency if expert == 0 else by_frequency
                    if by_recency != by_frequency:
                        hist_at[expert, v] = clock
                        hist_cnt[expert, v] = count[v]
                        q_block[expert, q_tail[expert]] = v
                        q_time[expert, q_tail[expert]] = clock
                        q_tail[expert] += 1
                        hist_len[expert] += 1
                        if hist_len[expert] > capacity:
                            while True:
                                b = q_block[expert, q_head[expert]]
                                t = q_time[expert, q_head[expert]]
                                q_head[expert] += 1
                                if hist_at[expert, b] == t:
                                    hist_at[expert, b] = -1
                                    hist_len[expert] -= 1
                                    break
                    _heap_remove(v, size, rheap, rpos, rkey)
                    _heap_remove(v, size, fheap, fpos, fkey)
                    size -= 1
                    cached[v] = 0
                    held -= 1
                    evictions += 1
                    age_hist[_bin(r - last_req[v])] += 1
            cached[x] = 1
            held += 1
            last_used[x] = clock
            last_req[x] = r
            c = 1
            for ex in range(2):
                at = hist_at[ex, x]
                if at >= 0:
                    c = hist_cnt[ex, x] + 1
                    hist_at[ex, x] = -1
                    hist_len[ex] -= 1
                    regret = discount ** float(clock - at)
                    if ex == 0:
                        w0 *= math.exp(-learning_rate * regret)
                    else:
                        w1 *= math.exp(-learning_rate * regret)
                    tot = w0 + w1
                    w0, w1 = w0 / tot, w1 / tot
            count[x] = c
            _heap_push(x, clock, size, rheap, rpos, rkey)
            _heap_push(x, c * _SHIFT + clock, size, fheap, fpos, fkey)
            size += 1
            if held > peak:
                peak = held
    weights[0], weights[1] = w0, w1
    return evictions, peak, 0


def python_draws(seed: int, n: int) -> np.ndarray:
    """The first ``n`` values of ``random.Random(seed).random()``, computed by numpy."""
    import random

    version, state, _ = random.Random(seed).getstate()
    rs = np.random.RandomState()
    rs.set_state(("MT19937", np.array(state[:-1], dtype=np.uint32), state[-1]))
    return rs.random_sample(n)
