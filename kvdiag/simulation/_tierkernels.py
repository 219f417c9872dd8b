"""The tiered prefix-cache simulator (:mod:`kvdiag.simulation.tiers`), compiled with numba.

One kernel, :func:`run_tiers`, replays requests over any number of tiers up to ``MAX_TIERS``
and counts, per tier, hits, promotions, demotions, evictions and writes (the ``T_*`` counters).
With ``NUMBA_DISABLE_JIT=1`` it runs as plain Python. Compiled code is cached like
:mod:`kvdiag.simulation._simkernels`'.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvdiag.simulation._simkernels import leading_held_jit
from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each function is decorated


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
