"""The miss-cause fold's shadow LRU (kvdiag.diagnosis.miss_causes), compiled with numba.

One pool of nodes holds the shadow's entries (the LRU list, oldest first) and the evicted-key
history (the ghost list, oldest first): an entry evicted from the shadow moves to the ghost
list, a ghost key touched again moves back, the oldest ghost key beyond the history goes to the
Bloom filter. Nodes are found by key in one open-addressing table (linear probing, deletion by
backward shift); a second table counts, per plain content key, the shadow's entries held under a
non-default hash domain. Each node holds its key, plain key, tick and time of last use (ns).

State lives in arrays owned by :class:`kvdiag.diagnosis.miss_shadow.Shadow`, which grows them
before a call could run out of room. With ``NUMBA_DISABLE_JIT=1`` the same functions run as
plain Python. Compiled code is cached like :mod:`kvdiag.simulation._simkernels`'.
"""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np
from numba import njit

from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each function is decorated

# node fields: nodes[i, F_*], one 64-byte row per node
F_KEY, F_PLAIN, F_TICK, F_NS, F_PREV, F_NEXT, F_WHERE = range(7)
N_FIELDS = 8
FREE, CACHED, GHOST = 0, 1, 2
# meta[...]
# M_DHELD: the shadow's entries held under a non-default domain
M_TICK, M_CHEAD, M_CTAIL, M_CLEN, M_GHEAD, M_GTAIL, M_GLEN, M_FREE, M_HIGH, M_BLOOM_ADDED, M_DHELD = range(11)
N_META = 11
# cause codes (miss_tally.CAUSES order)
COLD, EVICTED, HASH_DOMAIN = 0, 1, 2

_P1 = np.uint64(0x9E3779B97F4A7C15)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)


def new_state(num_nodes: int, bloom_bits: int) -> dict:
    """Empty state with room for ``num_nodes`` nodes and a Bloom filter of ``bloom_bits``."""
    n = max(int(num_nodes), 8)
    size = _table_size(n)
    meta = np.zeros(N_META, np.int64)
    meta[[M_CHEAD, M_CTAIL, M_GHEAD, M_GTAIL, M_FREE]] = -1
    return {"nodes": _new_nodes(n), "table": _new_table(size, -1), "domains": _new_table(size, 0),
            "meta": meta, "bloom": np.zeros((max(64, int(bloom_bits)) + 7) // 8, np.uint8)}


def _new_nodes(n: int) -> np.ndarray:
    """``n`` free nodes, rows aligned to 64 bytes (a node is one cache line)."""
    nbytes = n * N_FIELDS * 8
    buf = np.zeros(nbytes + 64, np.uint8)
    off = -buf.ctypes.data % 64
    nodes = buf[off:off + nbytes].view(np.int64).reshape(n, N_FIELDS)
    nodes[:, F_PREV:F_NEXT + 1] = -1
    return nodes


def _new_table(size: int, empty: int) -> np.ndarray:
    """An open-addressing table: rows (key, value), ``value == empty`` marks a free slot."""
    table = np.zeros((size, 2), np.int64)
    table[:, 1] = empty
    return table


def _table_size(num_nodes: int) -> int:
    """A power of two at least twice ``num_nodes`` (load factor at most 1/2)."""
    return 1 << max(4, (2 * num_nodes - 1).bit_length())


def grow_state(state: dict, num_nodes: int) -> dict:
    """The same state with room for ``num_nodes`` nodes (tables rebuilt at the new size)."""
    old = len(state["nodes"])
    if num_nodes <= old:
        return state
    out = dict(state)
    nodes = _new_nodes(num_nodes)
    nodes[:old] = state["nodes"]
    size = _table_size(num_nodes)
    out.update(nodes=nodes, table=_new_table(size, -1), domains=_new_table(size, 0))
    _rehash(nodes, out["table"], state["domains"], out["domains"])
    return out


@njit(cache=True, inline="always")
def _slot(key, size):
    return np.int64((np.uint64(key) * _P1) >> np.uint64(32)) & (size - 1)


@njit(cache=True)
def _find(table, key):
    """The node holding ``key``, or -1."""
    mask = len(table) - 1
    i = _slot(key, len(table))
    while table[i, 1] >= 0:
        if table[i, 0] == key:
            return table[i, 1]
        i = (i + 1) & mask
    return -1


@njit(cache=True)
def _put(table, key, node):
    """Map ``key`` (not in the table) to ``node``."""
    mask = len(table) - 1
    i = _slot(key, len(table))
    while table[i, 1] >= 0:
        i = (i + 1) & mask
    table[i, 0] = key
    table[i, 1] = node


@njit(cache=True)
def _delete(table, key, empty):
    """Remove ``key`` from a table whose free slots hold ``empty`` (backward shift: no
    tombstones). Returns whether it was there."""
    size = len(table)
    mask = size - 1
    i = _slot(key, size)
    while True:
        if table[i, 1] == empty:
            return False
        if table[i, 0] == key:
            break
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if table[j, 1] == empty:
            break
        k = _slot(table[j, 0], size)
        # move j into the hole at i unless its home k lies cyclically in (i, j]
        if (j > i and (k <= i or k > j)) or (j < i and (k <= i and k > j)):
            table[i, 0] = table[j, 0]
            table[i, 1] = table[j, 1]
            i = j
    table[i, 1] = empty
    return True


@njit(cache=True)
def _count(domains, key):
    """Entries held under a non-default domain whose plain key is ``key``."""
    mask = len(domains) - 1
    i = _slot(key, len(domains))
    while domains[i, 1] != 0:
        if domains[i, 0] == key:
            return domains[i, 1]
        i = (i + 1) & mask
    return 0


@njit(cache=True)
def _add_count(domains, key, delta):
    mask = len(domains) - 1
    i = _slot(key, len(domains))
    while domains[i, 1] != 0:
        if domains[i, 0] == key:
            if domains[i, 1] + delta == 0:
                _delete(domains, key, 0)
            else:
                domains[i, 1] += delta
            return
        i = (i + 1) & mask
    if delta > 0:
        domains[i, 0] = key
        domains[i, 1] = delta


@njit(cache=True)
def _rehash(nodes, table, old_domains, domains):
    for x in range(len(nodes)):
        if nodes[x, F_WHERE] != FREE:
            _put(table, nodes[x, F_KEY], x)
    for i in range(len(old_domains)):
        if old_domains[i, 1] != 0:
            _add_count(domains, old_domains[i, 0], old_domains[i, 1])


@njit(cache=True, inline="always")
def _push_tail(nodes, meta, lst, x):
    """Append node ``x`` to list ``lst`` (M_CHEAD or M_GHEAD: head, tail, length follow)."""
    t = meta[lst + 1]
    nodes[x, F_PREV] = t
    nodes[x, F_NEXT] = -1
    if t >= 0:
        nodes[t, F_NEXT] = x
    else:
        meta[lst] = x
    meta[lst + 1] = x
    meta[lst + 2] += 1


@njit(cache=True, inline="always")
def _unlink(nodes, meta, lst, x):
    p = nodes[x, F_PREV]
    n = nodes[x, F_NEXT]
    if p >= 0:
        nodes[p, F_NEXT] = n
    else:
        meta[lst] = n
    if n >= 0:
        nodes[n, F_PREV] = p
    else:
        meta[lst + 1] = p
    nodes[x, F_PREV] = -1
    nodes[x, F_NEXT] = -1
    meta[lst + 2] -= 1


@njit(cache=True, inline="always")
def _bloom_bit(key, p, nbits):
    return np.int64(((np.uint64(key) * p) >> np.uint64(32)) % np.uint64(nbits))


@njit(cache=True)
def bloom_add(bloom, key):
    """Set ``key``'s three bits (the hashes of :class:`kvdiag.diagnosis.miss_shadow.Bloom`)."""
    nbits = len(bloom) * 8
    i = _bloom_bit(key, _P1, nbits)
    bloom[i >> 3] |= np.uint8(1 << (i & 7))
    i = _bloom_bit(key, _P2, nbits)
    bloom[i >> 3] |= np.uint8(1 << (i & 7))
    i = _bloom_bit(key, _P3, nbits)
    bloom[i >> 3] |= np.uint8(1 << (i & 7))


@njit(cache=True)
def bloom_has(bloom, key):
    nbits = len(bloom) * 8
    i = _bloom_bit(key, _P1, nbits)
    if not bloom[i >> 3] & (1 << (i & 7)):
        return False
    i = _bloom_bit(key, _P2, nbits)
    if not bloom[i >> 3] & (1 << (i & 7)):
        return False
    i = _bloom_bit(key, _P3, nbits)
    return (bloom[i >> 3] & (1 << (i & 7))) != 0


@njit(cache=True)
def classify(nodes, table, domains, meta, bloom, keys, plain, masked, now_ns, codes, dist, age_ns):
    """A prompt's lookup at arrival: returns ``h``, its leading blocks held; for blocks
    ``h..`` writes ``codes[j - h]`` (EVICTED, HASH_DOMAIN or COLD) and, for evicted ones, the
    reuse distance in block references and the time since last use (-1: unknown). A block held
    after the prefix broke carries block ``h``'s figures."""
    n = len(keys)
    h = 0
    while h < n:
        x = _find(table, keys[h])
        if x < 0 or nodes[x, F_WHERE] != CACHED:
            break
        h += 1
    tick = meta[M_TICK]
    any_domain = masked or meta[M_DHELD] > 0
    brk_dist = -1
    brk_age = -1
    for j in range(h, n):
        k = j - h
        x = _find(table, keys[j])
        if x >= 0 and nodes[x, F_WHERE] == CACHED:  # held, but its prefix broke before it
            codes[k] = EVICTED
            dist[k] = brk_dist
            age_ns[k] = brk_age
            continue
        dist[k] = -1
        age_ns[k] = -1
        if x >= 0:  # in the evicted-key history
            codes[k] = EVICTED
            dist[k] = tick - nodes[x, F_TICK]
            age_ns[k] = max(now_ns - nodes[x, F_NS], 0)
        elif meta[M_BLOOM_ADDED] > 0 and bloom_has(bloom, keys[j]):
            codes[k] = EVICTED
        else:
            codes[k] = COLD
            if any_domain:
                y = _find(table, plain[j]) if masked else -1
                if (y >= 0 and nodes[y, F_WHERE] == CACHED) or _count(domains, plain[j]) > 0:
                    codes[k] = HASH_DOMAIN
            continue
        if j == h:
            brk_dist = dist[k]
            brk_age = age_ns[k]
    return h


@njit(cache=True)
def touch(nodes, table, domains, meta, bloom, keys, plain, masked, now_ns, cap, ghost_cap):
    """Touch or insert each block in order (LRU at ``cap`` entries, ``cap`` > 0): a block held
    moves to the newest end; a new one first evicts the oldest entries until there is room,
    each to the evicted-key history (``ghost_cap`` keys; the oldest beyond it to the Bloom
    filter). The caller leaves room for ``len(keys)`` new nodes."""
    tick = meta[M_TICK]
    for j in range(len(keys)):
        d = keys[j]
        tick += 1
        x = _find(table, d)
        if x >= 0 and nodes[x, F_WHERE] == CACHED:
            _unlink(nodes, meta, M_CHEAD, x)
            _push_tail(nodes, meta, M_CHEAD, x)
            nodes[x, F_PLAIN] = plain[j]
            nodes[x, F_TICK] = tick
            nodes[x, F_NS] = now_ns
            continue
        while meta[M_CLEN] >= cap:
            old = meta[M_CHEAD]
            _unlink(nodes, meta, M_CHEAD, old)
            if nodes[old, F_KEY] != nodes[old, F_PLAIN]:
                _add_count(domains, nodes[old, F_PLAIN], -1)
                meta[M_DHELD] -= 1
            nodes[old, F_WHERE] = GHOST
            _push_tail(nodes, meta, M_GHEAD, old)
            if meta[M_GLEN] > ghost_cap:
                g = meta[M_GHEAD]
                _unlink(nodes, meta, M_GHEAD, g)
                bloom_add(bloom, nodes[g, F_KEY])
                meta[M_BLOOM_ADDED] += 1
                _delete(table, nodes[g, F_KEY], -1)
                nodes[g, F_WHERE] = FREE
                nodes[g, F_NEXT] = meta[M_FREE]
                meta[M_FREE] = g
                if g == x:  # the history just let it go
                    x = -1
        if x >= 0:  # back from the evicted-key history
            _unlink(nodes, meta, M_GHEAD, x)
        else:
            x = meta[M_FREE]
            if x >= 0:
                meta[M_FREE] = nodes[x, F_NEXT]
                nodes[x, F_NEXT] = -1
            else:
                x = meta[M_HIGH]
                meta[M_HIGH] += 1
            _put(table, d, x)
        nodes[x, F_WHERE] = CACHED
        _push_tail(nodes, meta, M_CHEAD, x)
        nodes[x, F_KEY] = d
        nodes[x, F_PLAIN] = plain[j]
        nodes[x, F_TICK] = tick
        nodes[x, F_NS] = now_ns
        if masked:
            _add_count(domains, plain[j], 1)
            meta[M_DHELD] += 1
    meta[M_TICK] = tick


@njit(cache=True)
def arrive(nodes, table, domains, meta, bloom, keys, plain, masked, now_ns, cap, ghost_cap,
           codes, dist, age_ns):
    """:func:`classify` then, with ``cap`` > 0, :func:`touch` (else the clock advances)."""
    h = classify(nodes, table, domains, meta, bloom, keys, plain, masked, now_ns, codes, dist, age_ns)
    if cap > 0:
        touch(nodes, table, domains, meta, bloom, keys, plain, masked, now_ns, cap, ghost_cap)
    else:
        meta[M_TICK] += len(keys)
    return h


_warm_lock = threading.Lock()
_warm_thread: Optional[threading.Thread] = None


def warm_up_in_background() -> None:
    """Load the kernels (from numba's cache, else compile them: seconds, once per machine) in a
    background thread, once per process, so that a live view started now does not wait for them
    when its first request arrives (a call before they are ready waits for the rest)."""
    global _warm_thread
    with _warm_lock:
        if _warm_thread is None:
            _warm_thread = threading.Thread(target=_warm_up, name="kvdiag-miss-kernels", daemon=True)
            _warm_thread.start()


def _warm_up() -> None:
    """Each kernel called from Python once, on a small state, with the argument types the fold
    passes (numba keeps one compiled version per type signature)."""
    try:
        st = new_state(8, 64)
        keys = np.arange(1, 5, dtype=np.int64)
        n = len(keys)
        arrive(st["nodes"], st["table"], st["domains"], st["meta"], st["bloom"], keys, keys, False,
               1, 2, 2, np.empty(n, np.int8), np.empty(n, np.int64), np.empty(n, np.int64))
        touch(st["nodes"], st["table"], st["domains"], st["meta"], st["bloom"], keys, keys, False, 1, 2, 2)
        grow_state(st, 16)
    except Exception:  # the fold's own call compiles them then, or reports its error
        pass
