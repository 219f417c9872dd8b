"""Sequential inner loops of the prefix-cache simulator, compiled with numba.

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


# ---------------------------------------------------------------- indexed binary min-heap


@njit(cache=True, inline="always")
def _sift_up(i, heap, hpos, hkey):
    x = heap[i]
    k = hkey[x]
    while i > 0:
        parent = (i - 1) >> 1
        y = heap[parent]
        if hkey[y] <= k:
            break
        heap[i] = y
        hpos[y] = i
        i = parent
    heap[i] = x
    hpos[x] = i


@njit(cache=True, inline="always")
def _sift_down(i, n, heap, hpos, hkey):
    x = heap[i]
    k = hkey[x]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and hkey[heap[c + 1]] < hkey[heap[c]]:
            c += 1
        y = heap[c]
        if hkey[y] >= k:
            break
        heap[i] = y
        hpos[y] = i
        i = c
    heap[i] = x
    hpos[x] = i


@njit(cache=True, inline="always")
def _heap_push(x, key, n, heap, hpos, hkey):
    hkey[x] = key
    heap[n] = x
    hpos[x] = n
    _sift_up(n, heap, hpos, hkey)


@njit(cache=True, inline="always")
def _heap_update(x, key, n, heap, hpos, hkey):
    old = hkey[x]
    hkey[x] = key
    if key < old:
        _sift_up(hpos[x], heap, hpos, hkey)
    else:
        _sift_down(hpos[x], n, heap, hpos, hkey)


@njit(cache=True, inline="always")
def _heap_pop(n, heap, hpos, hkey):
    x = heap[0]
    hpos[x] = -1
    last = heap[n - 1]
    if n > 1:
        heap[0] = last
        hpos[last] = 0
        _sift_down(0, n - 1, heap, hpos, hkey)
    return x


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


# ---------------------------------------------------------------- LRU stack distances


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


# ---------------------------------------------------------------- blocks held by live requests


@njit(cache=True)
def live_peaks(ids, offsets, private, pages, reqs, kinds, num_blocks):
    """Sweep arrivals (``kinds`` +1) and finishes (-1) of requests ``reqs``; return the peak of
    blocks held without sharing (sum of ``pages``) and with sharing (distinct chained blocks of
    live requests + their ``private`` blocks)."""
    count = np.zeros(max(num_blocks, 1), np.int64)
    unshared = 0
    shared = 0
    peak_unshared = 0
    peak_shared = 0
    for k in range(len(reqs)):
        r = reqs[k]
        kind = kinds[k]
        unshared += kind * pages[r]
        shared += kind * private[r]
        for i in range(offsets[r], offsets[r + 1]):
            x = ids[i]
            if kind > 0:
                if count[x] == 0:
                    shared += 1
                count[x] += 1
            else:
                count[x] -= 1
                if count[x] == 0:
                    shared -= 1
        if unshared > peak_unshared:
            peak_unshared = unshared
        if shared > peak_shared:
            peak_shared = shared
    return peak_unshared, peak_shared


# ---------------------------------------------------------------- tiered prefix cache
# Tiers 0..T-1 (0 = the top, e.g. GPU), each an LRU list over the same block ids: row t of
# ``tprev``/``tnxt``; ``tmask[x]`` has bit t set while tier t holds block x (write-through keeps
# copies in several tiers at once; write-back keeps every block in at most one).

MAX_TIERS = 8
# tctr[t, ...]
T_HIT_BLOCKS, T_HIT_TOKENS, T_PROMOTED, T_EVICTED, T_DEMOTED, T_ALREADY, T_DROPPED, \
    T_WRITTEN, T_INSERTED, T_RAISED, T_PEAK, T_REMOVED = range(12)
N_TIER_COUNTERS = 12


def new_tier_state(num_tiers: int, num_blocks: int) -> dict:
    """Zeroed tier-simulator state for ``num_tiers`` tiers and block ids ``0..num_blocks-1``."""
    n = max(int(num_blocks), 1)
    return {
        "mask": np.zeros(n, np.uint8),
        "prev": np.full((num_tiers, n), -1, np.int32),
        "nxt": np.full((num_tiers, n), -1, np.int32),
        "heads": np.full(num_tiers, -1, np.int64),
        "tails": np.full(num_tiers, -1, np.int64),
        "sizes": np.zeros(num_tiers, np.int64),
        "counters": np.zeros((num_tiers, N_TIER_COUNTERS), np.int64),
    }


# Each list operation takes a tier's head, tail and size as values and returns them: the top
# tier's stay in local variables for the whole run, a lower tier's are loaded once before a
# group of operations on it and stored once after. With them read from and written to the
# heads/tails/sizes arrays inside every operation, each store to prev/nxt forces a reload
# (the arrays may alias), about 5x slower.

_UNBOUNDED = np.int64(1) << 62


@njit(cache=True, inline="always")
def _l_push(x, head, tail, size, prev, nxt):
    """Block ``x`` to the most recent end of the list (head, tail, size) over ``prev``/``nxt``."""
    prev[x] = -1
    nxt[x] = head
    if head >= 0:
        prev[head] = x
    else:
        tail = x
    return x, tail, size + 1


@njit(cache=True, inline="always")
def _l_unlink(x, head, tail, size, prev, nxt):
    """Block ``x`` out of the list (head, tail, size) over ``prev``/``nxt``."""
    p = prev[x]
    n = nxt[x]
    if p >= 0:
        nxt[p] = n
    else:
        head = n
    if n >= 0:
        prev[n] = p
    else:
        tail = p
    prev[x] = -1
    nxt[x] = -1
    return head, tail, size - 1


@njit(cache=True, inline="always")
def _cap(caps, t):
    """Tier ``t``'s capacity in blocks (negative: unbounded)."""
    return caps[t] if caps[t] >= 0 else _UNBOUNDED


@njit(cache=True)
def run_tiers(num_tiers, caps, write_through, ids, offsets, block_tokens, counted, r_begin, r_end,
              mask, prev, nxt, heads, tails, sizes, ctr, hits_out, req_hit_blocks,
              req_hit_tokens):
    """Replay requests ``r_begin..r_end-1`` through ``num_tiers`` LRU tiers
    (kvdiag.simulation.tiers has the rules). ``hits_out[r]`` = leading blocks found in any tier
    (prefix match, stops at the first miss); ``req_hit_blocks[r, t]`` / ``req_hit_tokens[r, t]``
    = those served by tier ``t`` (the highest tier holding the block); rows with
    ``counted[r] == 0`` only move blocks. A block that enters a full tier evicts its least
    recent block, demoted to the tier below unless that tier holds it already, and so on down;
    the last tier's victim is dropped.
    Long: its ~80 lines are one loop over a request's blocks: split, the tier-0 locals would
    have to travel through every call."""
    T = num_tiers
    c0 = _cap(caps, 0)
    p0 = prev[0]
    n0 = nxt[0]
    h0, t0, s0 = heads[0], tails[0], sizes[0]
    for r in range(r_begin, r_end):
        s = offsets[r]
        e = offsets[r + 1]
        h = leading_held_jit(ids, s, e, mask)
        hits_out[r] = h
        hit_end = s + h if counted[r] else s
        for i in range(s, e):
            x = np.int64(ids[i])
            m = mask[x]
            if m & 1:  # in the top tier: touch
                if h0 != x:
                    h0, t0, s0 = _l_unlink(x, h0, t0, s0, p0, n0)
                    h0, t0, s0 = _l_push(x, h0, t0, s0, p0, n0)
                if i < hit_end:
                    ctr[0, T_HIT_BLOCKS] += 1
                    ctr[0, T_HIT_TOKENS] += block_tokens[i]
                    req_hit_blocks[r, 0] += 1
                    req_hit_tokens[r, 0] += block_tokens[i]
                continue
            fresh = m == 0
            if not fresh:  # in a lower tier (the highest holding it): up to the top
                t = 1
                while not (m & (1 << t)):
                    t += 1
                if i < hit_end:  # a prefix hit: read from tier t
                    ctr[t, T_HIT_BLOCKS] += 1
                    ctr[t, T_HIT_TOKENS] += block_tokens[i]
                    ctr[t, T_PROMOTED] += 1
                    req_hit_blocks[r, t] += 1
                    req_hit_tokens[r, t] += block_tokens[i]
                else:  # past the first miss: recomputed, the copy below is not read
                    ctr[t, T_RAISED] += 1
                if not write_through or (i < hit_end and heads[t] != x):
                    pt = prev[t]
                    nt = nxt[t]
                    ht, tt, st = _l_unlink(x, heads[t], tails[t], sizes[t], pt, nt)
                    if write_through:  # the copy stays; a read warms it
                        ht, tt, st = _l_push(x, ht, tt, st, pt, nt)
                    else:  # exclusive: it leaves tier t
                        mask[x] &= np.uint8(~(1 << t) & 0xFF)
                        ctr[t, T_REMOVED] += 1
                    heads[t], tails[t], sizes[t] = ht, tt, st
            else:
                ctr[0, T_INSERTED] += 1
            # x goes to the top tier (write-through: a new block to every tier); at each
            # level: push, and if over capacity evict the tail and pass it down
            last = T if (fresh and write_through) else 1
            for start in range(last):
                if start > 0:
                    if mask[x] & (1 << start):
                        continue
                    ctr[start, T_WRITTEN] += 1
                y = x
                lvl = start
                while True:
                    bit = np.uint8(1 << lvl)
                    if lvl == 0:
                        h0, t0, s0 = _l_push(y, h0, t0, s0, p0, n0)
                        mask[y] |= bit
                        if s0 <= c0:
                            if s0 > ctr[0, T_PEAK]:
                                ctr[0, T_PEAK] = s0
                            break
                        v = t0
                        h0, t0, s0 = _l_unlink(v, h0, t0, s0, p0, n0)
                    else:
                        pt = prev[lvl]
                        nt = nxt[lvl]
                        ht, tt, st = _l_push(y, heads[lvl], tails[lvl], sizes[lvl], pt, nt)
                        mask[y] |= bit
                        if st <= _cap(caps, lvl):
                            heads[lvl], tails[lvl], sizes[lvl] = ht, tt, st
                            if st > ctr[lvl, T_PEAK]:
                                ctr[lvl, T_PEAK] = st
                            break
                        v = tt
                        ht, tt, st = _l_unlink(v, ht, tt, st, pt, nt)
                        heads[lvl], tails[lvl], sizes[lvl] = ht, tt, st
                    mask[v] &= ~bit
                    ctr[lvl, T_EVICTED] += 1
                    if lvl == T - 1:
                        ctr[lvl, T_DROPPED] += 1
                        break
                    if mask[v] & (1 << (lvl + 1)):
                        ctr[lvl, T_ALREADY] += 1
                        break
                    ctr[lvl, T_DEMOTED] += 1
                    y = v
                    lvl += 1
    heads[0], tails[0], sizes[0] = h0, t0, s0
