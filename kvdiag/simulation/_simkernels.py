"""The eviction-policy simulator (LRU, FIFO, LFU, S3-FIFO, OPT) over a prefix cache, compiled
with numba; the simulator state, its linked lists and the helpers the other kernels share
(:func:`leading_held`, the age bins).

Cache simulation and stack distances are inherently sequential, so they are written as plain
loops over integer arrays (block ids remapped to ``0..D-1``) that numba compiles. With
``NUMBA_DISABLE_JIT=1`` the very same functions run as pure Python: that is the fallback the
tests compare the compiled code against. Compiled code is cached under kvdiag's cache folder
(``<cache dir>/numba``, or ``$NUMBA_CACHE_DIR`` when set), never inside the installed package:
files there would survive ``pip uninstall`` and turn ``kvdiag`` into a namespace package.

State lives in arrays owned by the caller, so a run can be continued request by request (the
live shadow mode) or done in one call over a whole trace (offline replay).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvdiag.simulation._heapkernels import _heap_pop, _heap_push, _heap_update
from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each function is decorated

LRU, FIFO, LFU, S3FIFO, OPT = 0, 1, 2, 3, 4

# where[x]: which structure holds block x
NOWHERE, MAIN, SMALL, GHOST = 0, 1, 2, 3
# list slots in heads/tails/sizes
L_MAIN, L_SMALL, L_GHOST = 0, 1, 2

# counters[...]
C_EVICTIONS, C_PEAK_BLOCKS, C_CLOCK, C_REQUESTS = 0, 1, 2, 3
N_COUNTERS = 4
AGE_BINS = 64
_DEAD = 1 << 50  # OPT: keys of blocks never referenced again sort after every real position


def new_state(num_blocks: int) -> dict:
    """Zeroed simulator state for block ids ``0..num_blocks-1``."""
    n = max(int(num_blocks), 1)
    return {
        "where": np.zeros(n, np.int8),
        "prev": np.full(n, -1, np.int32),
        "nxt": np.full(n, -1, np.int32),
        "heads": np.full(3, -1, np.int64),
        "tails": np.full(3, -1, np.int64),
        "sizes": np.zeros(3, np.int64),
        "heap": np.zeros(n, np.int32),
        "hpos": np.full(n, -1, np.int32),
        "hkey": np.zeros(n, np.int64),
        "freq": np.zeros(n, np.int32),
        "last_req": np.zeros(n, np.int64),
        "counters": np.zeros(N_COUNTERS, np.int64),
        "age_hist": np.zeros(AGE_BINS, np.int64),
    }


def grow_state(state: dict, num_blocks: int) -> dict:
    """The same state with room for block ids up to ``num_blocks-1`` (new ids start empty)."""
    old = len(state["where"])
    if num_blocks <= old:
        return state
    n = max(num_blocks, 2 * old)
    fills = {"prev": -1, "nxt": -1, "hpos": -1}
    out = dict(state)
    for key in ("where", "prev", "nxt", "heap", "hpos", "hkey", "freq", "last_req"):
        arr = np.full(n, fills.get(key, 0), state[key].dtype)
        arr[:old] = state[key]
        out[key] = arr
    return out


# ---------------------------------------------------------------- intrusive doubly linked lists
# head = most recently inserted, tail = oldest


def leading_held(ids, s, e, held) -> int:
    """The prefix scan: how many of ``ids[s:e]`` in a row, from ``s``, are held
    (``held[id]`` true), stopping at the first miss. One definition for the compiled
    kernels (:data:`leading_held_jit`) and the Python reference loop."""
    h = 0
    while s + h < e and held[ids[s + h]]:
        h += 1
    return h


leading_held_jit = njit(cache=True, inline="always")(leading_held)
""":func:`leading_held` compiled, for use inside kernels."""


@njit(cache=True, inline="always")
def _push_head(lst, x, prev, nxt, heads, tails, sizes):
    h = heads[lst]
    prev[x] = -1
    nxt[x] = h
    if h >= 0:
        prev[h] = x
    else:
        tails[lst] = x
    heads[lst] = x
    sizes[lst] += 1


@njit(cache=True, inline="always")
def _unlink(lst, x, prev, nxt, heads, tails, sizes):
    p = prev[x]
    n = nxt[x]
    if p >= 0:
        nxt[p] = n
    else:
        heads[lst] = n
    if n >= 0:
        prev[n] = p
    else:
        tails[lst] = p
    prev[x] = -1
    nxt[x] = -1
    sizes[lst] -= 1


# ---------------------------------------------------------------- one simulator for all policies


@njit(cache=True, inline="always")
def _bin(age):
    b = 0
    while age > 0:
        age >>= 1
        b += 1
    return b


@njit(cache=True, inline="always")
def _evict_one(policy, small_cap, ghost_cap, r, where, prev, nxt, heads, tails, sizes,
               heap, hpos, hkey, freq, last_req, counters, age_hist):
    """Drop one block from the cache according to ``policy``; count it and its idle age."""
    victim = -1
    if policy == LRU or policy == FIFO:
        victim = tails[L_MAIN]
        _unlink(L_MAIN, victim, prev, nxt, heads, tails, sizes)
    elif policy == LFU or policy == OPT:
        victim = _heap_pop(sizes[L_MAIN], heap, hpos, hkey)
        sizes[L_MAIN] -= 1
    else:  # S3-FIFO
        while victim < 0:
            if sizes[L_SMALL] > 0 and (sizes[L_SMALL] >= small_cap or sizes[L_MAIN] == 0):
                t = tails[L_SMALL]
                _unlink(L_SMALL, t, prev, nxt, heads, tails, sizes)
                if freq[t] >= 2:
                    where[t] = MAIN
                    _push_head(L_MAIN, t, prev, nxt, heads, tails, sizes)
                else:
                    victim = t
                    where[t] = GHOST
                    _push_head(L_GHOST, t, prev, nxt, heads, tails, sizes)
                    if sizes[L_GHOST] > ghost_cap:
                        g = tails[L_GHOST]
                        _unlink(L_GHOST, g, prev, nxt, heads, tails, sizes)
                        where[g] = NOWHERE
            else:
                t = tails[L_MAIN]
                _unlink(L_MAIN, t, prev, nxt, heads, tails, sizes)
                if freq[t] > 0:
                    freq[t] -= 1
                    _push_head(L_MAIN, t, prev, nxt, heads, tails, sizes)
                else:
                    victim = t
                    where[t] = NOWHERE
        counters[C_EVICTIONS] += 1
        age_hist[_bin(r - last_req[victim])] += 1
        return victim
    where[victim] = NOWHERE
    counters[C_EVICTIONS] += 1
    age_hist[_bin(r - last_req[victim])] += 1
    return victim


@njit(cache=True)
def run_requests(policy, capacity, small_cap, ghost_cap, ids, offsets, next_ref, total_refs,
                 r_begin, r_end, r_base, where, prev, nxt, heads, tails, sizes, heap, hpos, hkey,
                 freq, last_req, counters, age_hist, hits_out):
    """Replay requests ``r_begin..r_end-1`` with prefix-match semantics.

    For each request: ``hits_out[r]`` = length of the longest run of its leading blocks that are
    cached when it arrives (stops at the first miss). Then every block, in order, is touched if
    cached, or inserted after evicting down to ``capacity - 1`` blocks (``capacity < 0``:
    unbounded, ``capacity == 0``: nothing is ever cached). ``next_ref[i]`` (OPT only) is the
    position of the next reference to ``ids[i]``'s block, ``>= total_refs`` if none.
    ``r_base + r`` is the request's index in the whole stream (for idle ages).
    Long: one compiled hot loop whose steps share local state (list ends, counters, heaps) that
    helper calls would pass back and forth at every block.
    """
    for rl in range(r_begin, r_end):
        r = rl + r_base
        s = offsets[rl]
        e = offsets[rl + 1]
        h = 0
        while s + h < e and (where[ids[s + h]] == MAIN or where[ids[s + h]] == SMALL):
            h += 1
        hits_out[rl] = h
        for i in range(s, e):
            x = ids[i]
            counters[C_CLOCK] += 1
            w = where[x]
            if w == MAIN or w == SMALL:  # touch
                if policy == LRU:
                    _unlink(L_MAIN, x, prev, nxt, heads, tails, sizes)
                    _push_head(L_MAIN, x, prev, nxt, heads, tails, sizes)
                elif policy == LFU:
                    freq[x] += 1
                    _heap_update(x, (np.int64(freq[x]) << 40) | counters[C_CLOCK],
                                 sizes[L_MAIN], heap, hpos, hkey)
                elif policy == OPT:
                    nr = next_ref[i]
                    key = -nr if nr < total_refs else -(_DEAD + np.int64(x))
                    _heap_update(x, key, sizes[L_MAIN], heap, hpos, hkey)
                elif policy == S3FIFO:
                    if freq[x] < 3:
                        freq[x] += 1
                last_req[x] = r
                continue
            if capacity == 0:
                continue
            if capacity > 0:
                while sizes[L_MAIN] + sizes[L_SMALL] >= capacity:
                    _evict_one(policy, small_cap, ghost_cap, r, where, prev, nxt, heads, tails,
                               sizes, heap, hpos, hkey, freq, last_req, counters, age_hist)
            last_req[x] = r
            if policy == LRU or policy == FIFO:
                where[x] = MAIN
                _push_head(L_MAIN, x, prev, nxt, heads, tails, sizes)
            elif policy == LFU:
                where[x] = MAIN
                freq[x] = 1
                _heap_push(x, (np.int64(1) << 40) | counters[C_CLOCK], sizes[L_MAIN],
                           heap, hpos, hkey)
                sizes[L_MAIN] += 1
            elif policy == OPT:
                nr = next_ref[i]
                key = -nr if nr < total_refs else -(_DEAD + np.int64(x))
                where[x] = MAIN
                _heap_push(x, key, sizes[L_MAIN], heap, hpos, hkey)
                sizes[L_MAIN] += 1
            else:  # S3-FIFO: a ghost hit goes straight to main
                freq[x] = 0
                if where[x] == GHOST:
                    _unlink(L_GHOST, x, prev, nxt, heads, tails, sizes)
                    where[x] = MAIN
                    _push_head(L_MAIN, x, prev, nxt, heads, tails, sizes)
                else:
                    where[x] = SMALL
                    _push_head(L_SMALL, x, prev, nxt, heads, tails, sizes)
            held = sizes[L_MAIN] + sizes[L_SMALL]
            if held > counters[C_PEAK_BLOCKS]:
                counters[C_PEAK_BLOCKS] = held
        counters[C_REQUESTS] += 1


@njit(cache=True)
def run_lru_fifo(is_lru, capacity, ids, offsets, r_begin, r_end, r_base, where, prev, nxt,
                 heads, tails, sizes, last_req, counters, age_hist, hits_out):
    """:func:`run_requests` for LRU and FIFO, with the list ends in local variables: the same
    semantics and state, about 20x faster (the hot loop of the article's policy).
    Long: one compiled hot loop whose steps share local state (list ends, counters, heaps) that
    helper calls would pass back and forth at every block."""
    head = heads[L_MAIN]
    tail = tails[L_MAIN]
    size = sizes[L_MAIN]
    evictions = counters[C_EVICTIONS]
    peak = counters[C_PEAK_BLOCKS]
    clock = counters[C_CLOCK]
    for rl in range(r_begin, r_end):
        r = rl + r_base
        s = offsets[rl]
        e = offsets[rl + 1]
        h = 0
        while s + h < e and where[ids[s + h]] == MAIN:
            h += 1
        hits_out[rl] = h
        for i in range(s, e):
            x = ids[i]
            clock += 1
            if where[x] == MAIN:
                if is_lru and head != x:  # move to the head (x has a predecessor)
                    p = prev[x]
                    n = nxt[x]
                    nxt[p] = n
                    if n >= 0:
                        prev[n] = p
                    else:
                        tail = p
                    prev[x] = -1
                    nxt[x] = head
                    prev[head] = x
                    head = x
                last_req[x] = r
                continue
            if capacity == 0:
                continue
            if capacity > 0:
                while size >= capacity:
                    t = tail
                    tail = prev[t]
                    if tail >= 0:
                        nxt[tail] = -1
                    else:
                        head = -1
                    prev[t] = -1
                    nxt[t] = -1
                    where[t] = NOWHERE
                    size -= 1
                    evictions += 1
                    age_hist[_bin(r - last_req[t])] += 1
            last_req[x] = r
            where[x] = MAIN
            prev[x] = -1
            nxt[x] = head
            if head >= 0:
                prev[head] = x
            else:
                tail = x
            head = x
            size += 1
            if size > peak:
                peak = size
        counters[C_REQUESTS] += 1
    heads[L_MAIN] = head
    tails[L_MAIN] = tail
    sizes[L_MAIN] = size
    counters[C_EVICTIONS] = evictions
    counters[C_PEAK_BLOCKS] = peak
    counters[C_CLOCK] = clock
