"""LRU stack (reuse) distances under prefix-match semantics, compiled with numba.

A Fenwick tree over time slots marks each block's last use; a block's stack distance (its rank
in the recency order, 1 = most recently used) is the number of marks after its own. The
histograms by prefix-maximum distance give LRU's hit rate at every capacity in one pass
(:mod:`kvdiag.simulation.lru_curve`, :mod:`kvdiag.simulation.capacity_curve`). Compiled code is
cached like :mod:`kvdiag.simulation._simkernels`'.
"""

from __future__ import annotations

from numba import njit

from kvdiag.simulation._simkernels import _bin
from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each function is decorated


@njit(cache=True, inline="always")
def _fen_add(tree, i, delta):
    i += 1
    n = len(tree)
    while i < n:
        tree[i] += delta
        i += i & (-i)


@njit(cache=True, inline="always")
def _fen_prefix(tree, i):
    """Sum of marks at times ``0..i-1``."""
    s = 0
    while i > 0:
        s += tree[i]
        i -= i & (-i)
    return s


@njit(cache=True)
def compact(last_time, owner, tree, t):
    """Renumber the live marks' times to ``0..live-1`` (keeping their order); return live."""
    live = 0
    for old in range(t):
        x = owner[old]
        if x >= 0 and last_time[x] == old:
            last_time[x] = live
            owner[live] = x
            live += 1
    for k in range(live, len(owner)):
        owner[k] = -1
    # Fenwick tree of ones at 0..live-1, built in linear time
    n = len(tree)
    for k in range(n):
        tree[k] = 0
    for k in range(1, n):
        if k <= live:
            tree[k] += 1
        j = k + (k & (-k))
        if j < n:
            tree[j] += tree[k]
    return live


@njit(cache=True)
def stack_distances(ids, offsets, block_tokens, prompt_tokens, counted, r_begin, r_end,
                    last_time, owner, tree, state, hist_blocks, hist_tokens, hist_req,
                    reuse_hist):
    """One pass of LRU stack distances under prefix-match semantics.

    For a reference, ``d`` = the block's rank in the recency order when its request arrives (1 =
    most recently used, ``inf`` = never seen); LRU with capacity ``C`` holds exactly the ``C``
    top-ranked blocks, so the reference hits iff ``max(d)`` over the request's blocks up to it is
    ``<= C``. Histograms are indexed by that prefix maximum (``len - 1`` = never a hit):
    ``hist_blocks`` counts references, ``hist_tokens`` their tokens, ``hist_req`` their share of
    the request's prompt tokens. ``reuse_hist[bin(d)]`` counts re-references by raw ``d``.
    ``state`` = [next time slot, live blocks]. Rows with ``counted[r] == 0`` (blocks a request
    adds when it finishes) only update the recency order.
    """
    inf = len(hist_blocks) - 1
    for r in range(r_begin, r_end):
        s = offsets[r]
        e = offsets[r + 1]
        t = state[0]
        live = state[1]
        running = 0
        pt = prompt_tokens[r]
        for i in range(s, e if counted[r] else s):
            p = last_time[ids[i]]
            if p < 0:  # never seen before this request
                d = inf
            else:
                d = live - _fen_prefix(tree, p)
                reuse_hist[_bin(d)] += 1
            if d > running:
                running = d
            k = running if running < inf else inf
            hist_blocks[k] += 1
            hist_tokens[k] += block_tokens[i]
            if pt > 0:
                hist_req[k] += block_tokens[i] / pt
        for i in range(s, e):
            x = ids[i]
            p = last_time[x]
            if p >= 0:
                _fen_add(tree, p, -1)
                owner[p] = -1
            else:
                live += 1
            if t >= len(owner):
                t = compact(last_time, owner, tree, t)
            last_time[x] = t
            owner[t] = x
            _fen_add(tree, t, 1)
            t += 1
        state[0] = t
        state[1] = live
