"""The capacity curve's fold kernel, compiled with numba: LRU stack distances
(:func:`kvdiag.simulation._stackkernels.stack_distances`) over raw 64-bit keys, mapped to dense
ids by an open-addressing table, with at most ``max_keys`` keys tracked (the least recently used
beyond forgotten). State in arrays owned by :class:`kvdiag.simulation.capacity_curve.ReuseCurve`.
Compiled code is cached like :mod:`kvdiag.simulation._simkernels`'.
"""

from __future__ import annotations

from numba import njit

from kvdiag.simulation._simkernels import _bin
from kvdiag.simulation._stackkernels import _fen_add, _fen_prefix, compact
from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each function is decorated

# state[...] of a ReuseCurve
S_TIME, S_LIVE, S_LOW, S_NFREE, S_FRESH, S_DISTINCT, S_FORGOTTEN = 0, 1, 2, 3, 4, 5, 6
_EMPTY = -1


@njit(cache=True, inline="always")
def _slot(k, mask):
    h = k ^ (k >> 31)
    h = h * 0x7FB5D329728EA185
    h = h ^ (h >> 27)
    return h & mask


@njit(cache=True, inline="always")
def _find(k, slot_key, slot_id, mask):
    """Slot of key ``k``, or the empty slot where it would go."""
    i = _slot(k, mask)
    while slot_id[i] != _EMPTY and slot_key[i] != k:
        i = (i + 1) & mask
    return i


@njit(cache=True, inline="always")
def _delete(i, slot_key, slot_id, mask):
    """Empty slot ``i`` of the open-addressing table (linear probing, backward shift)."""
    j = i
    while True:
        j = (j + 1) & mask
        if slot_id[j] == _EMPTY:
            break
        home = _slot(slot_key[j], mask)
        if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
            slot_key[i] = slot_key[j]
            slot_id[i] = slot_id[j]
            i = j
    slot_id[i] = _EMPTY


@njit(cache=True)
def rehash(key_of, last_time, slot_key, slot_id):
    """Insert every tracked id (``last_time >= 0``) into an empty table."""
    mask = len(slot_id) - 1
    for x in range(len(last_time)):
        if last_time[x] >= 0:
            i = _find(key_of[x], slot_key, slot_id, mask)
            slot_key[i] = key_of[x]
            slot_id[i] = x


@njit(cache=True)
def bounded_stack_distances(keys, offsets, prompt_tokens, counted, n_rows, block_size, max_keys,
                            last_time, owner, tree, key_of, slot_key, slot_id, free, state,
                            hist_blocks, hist_tokens, hist_req, reuse_hist, ids):
    """:func:`kvdiag.simulation._stackkernels.stack_distances` over rows ``0..n_rows-1`` of raw
    64-bit keys (mapped to dense ids by an open-addressing table), block tokens
    ``min(block_size, remaining prompt)`` for counted rows. After each row the least recently
    used keys beyond ``max_keys`` are forgotten (their ids and table slots freed). ``state``:
    see the S_* indices; ``ids``: scratch of at least the longest row.
    Long: one compiled hot loop whose steps share local state (the key table, the Fenwick tree,
    counters) that helper calls would pass back and forth at every block."""
    inf = len(hist_blocks) - 1
    mask = len(slot_id) - 1
    for r in range(n_rows):
        s = offsets[r]
        e = offsets[r + 1]
        for i in range(s, e):
            k = keys[i]
            j = _find(k, slot_key, slot_id, mask)
            x = slot_id[j]
            if x == _EMPTY:
                if state[S_NFREE] > 0:
                    state[S_NFREE] -= 1
                    x = free[state[S_NFREE]]
                else:
                    x = state[S_FRESH]
                    state[S_FRESH] += 1
                slot_key[j] = k
                slot_id[j] = x
                key_of[x] = k
                state[S_DISTINCT] += 1
            ids[i - s] = x
        t = state[S_TIME]
        live = state[S_LIVE]
        running = 0
        pt = prompt_tokens[r]
        if counted[r]:
            for i in range(e - s):
                p = last_time[ids[i]]
                if p < 0:
                    d = inf
                else:
                    d = live - _fen_prefix(tree, p)
                    reuse_hist[_bin(d)] += 1
                if d > running:
                    running = d
                kk = running if running < inf else inf
                bt = pt - i * block_size
                bt = 0 if bt < 0 else (block_size if bt > block_size else bt)
                hist_blocks[kk] += 1
                hist_tokens[kk] += bt
                if pt > 0:
                    hist_req[kk] += bt / pt
        for i in range(e - s):
            x = ids[i]
            p = last_time[x]
            if p >= 0:
                _fen_add(tree, p, -1)
                owner[p] = -1
            else:
                live += 1
            if t >= len(owner):
                t = compact(last_time, owner, tree, t)
                state[S_LOW] = 0
            last_time[x] = t
            owner[t] = x
            _fen_add(tree, t, 1)
            t += 1
        lo = state[S_LOW]
        while live > max_keys:  # forget the oldest marks
            x = owner[lo]
            if x >= 0 and last_time[x] == lo:
                _fen_add(tree, lo, -1)
                owner[lo] = -1
                last_time[x] = -1
                live -= 1
                _delete(_find(key_of[x], slot_key, slot_id, mask), slot_key, slot_id, mask)
                free[state[S_NFREE]] = x
                state[S_NFREE] += 1
                state[S_FORGOTTEN] += 1
            lo += 1
        state[S_TIME] = t
        state[S_LIVE] = live
        state[S_LOW] = lo
