"""Capacity curves, live: LRU stack (reuse) distances folded in stream order, hence the prefix
hit rate at every cache capacity.

Mattson: LRU with a capacity of ``C`` blocks holds exactly the ``C`` most recently used
blocks, so a reference hits iff its stack distance (its block's rank in the recency order when
its request arrives; 1 = most recent) is ``<= C``; under prefix matching a block hits iff the
largest distance over its request's blocks up to it is ``<= C``. One pass gives the hit rate at
every capacity at once. The rows are those of ``kvdiag replay --curve``
(:func:`kvdiag.simulation.lru_curve.lru_curve`, :class:`~kvdiag.simulation.lru_curve.HitRateCurve`):

- a kvdiag log: each ``RequestArrived`` is a counted row of its prompt's chained block keys
  (token ids re-chunked, or hashes-mode chunk keys); when it finishes, an uncounted row touches
  the full blocks of its prompt and generated tokens (its ``BlockStored`` content);
- KV events (``PrefixCacheStored``, per ``medium`` = tier): each store is one row, its parent
  chain's tokens and the stored tokens re-chunked (:func:`kvdiag.traces.kv_event_traces.load_vllm`).

Memory bound: at most ``max_keys`` keys are tracked (the most recently used ones); a key that
falls beyond rank ``max_keys`` is forgotten and its next reference counts as a first one. The
curve is therefore exact for every capacity ``<= max_keys`` blocks (``exact_up_to_blocks``)
and a lower bound above it. State is fixed-size arrays over ``max_keys`` + the longest row
ids (about 160 bytes per id: recency marks, a Fenwick tree over two time slots per id, an
open-addressing key table at load <= 1/2, three histograms). Rows are buffered and folded in
batches by a compiled kernel (key lookup included), so a curve read first folds what is
pending.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Sequence

import numpy as np
from numba import njit

from kvdiag.simulation import _simkernels as K
from kvdiag.simulation._stackkernels import _fen_add, _fen_prefix, compact
from kvdiag.simulation.lru_curve import HitRateCurve
from kvdiag.traces.kvdiag_logs import full_sequence
from kvdiag.traces.trace import DEFAULT_BLOCK_TOKENS
from kvdiag.pool.hashing import Content, chunk_hashes, full_sequence_chunks

DEFAULT_MAX_KEYS = 1 << 18
"""Keys tracked before the pool's size is known (then: 4 x the pool, at most MAX_KEYS_CAP)."""
MAX_KEYS_CAP = 1 << 21
POOL_MULTIPLES = (0.5, 1.0, 2.0, 4.0)
"""The capacities top and the exporter show, as multiples of the current pool."""
_FLUSH_REFS = 1 << 14  # block references buffered before the kernel runs


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
    Long: one compiled hot loop whose steps share local state (list ends, counters, heaps) that
    helper calls would pass back and forth at every block."""
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
                    reuse_hist[K._bin(d)] += 1
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


class ReuseCurve:
    """Rows of chained block keys in, the LRU hit-rate curve out; at most ``max_keys`` keys
    tracked (the curve is exact up to that many blocks of capacity). Rows are buffered and
    folded ``flush_refs`` block references at a time."""

    def __init__(self, block_size_tokens: int, max_keys: int = DEFAULT_MAX_KEYS,
                 flush_refs: int = _FLUSH_REFS) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.block_size_tokens = int(block_size_tokens)
        self.max_keys = int(max_keys)
        self.flush_refs = int(flush_refs)
        self.state = np.zeros(7, dtype=np.int64)
        self._alloc(self.max_keys + 1024)
        self.hist_blocks = np.zeros(self.max_keys + 2, dtype=np.int64)
        self.hist_tokens = np.zeros(self.max_keys + 2, dtype=np.int64)
        self.hist_req = np.zeros(self.max_keys + 2, dtype=np.float64)
        self.reuse = np.zeros(K.AGE_BINS, dtype=np.int64)
        self.requests = 0
        self.requests_with_prompt = 0
        self.block_refs = 0
        self.prompt_tokens = 0
        self._pending_keys: list[np.ndarray] = []
        self._pending_rows: list[tuple[int, int, int]] = []  # (refs, prompt tokens, counted)
        self._pending_refs = 0
        self._pending_longest = 0

    def _alloc(self, id_capacity: int) -> None:
        """Arrays for ``id_capacity`` ids (tracked keys + the longest row), the table at load
        <= 1/2; what was tracked is carried over."""
        old = getattr(self, "last_time", None)
        self.id_capacity = id_capacity
        last_time = np.full(id_capacity, -1, dtype=np.int64)
        key_of = np.zeros(id_capacity, dtype=np.int64)
        free = np.zeros(id_capacity, dtype=np.int64)
        owner = np.full(2 * id_capacity + 64, -1, dtype=np.int64)
        tree = np.zeros(2 * id_capacity + 65, dtype=np.int64)
        size = 1 << max(4, int(2 * id_capacity - 1).bit_length())
        self.slot_key = np.zeros(size, dtype=np.int64)
        self.slot_id = np.full(size, _EMPTY, dtype=np.int64)
        if old is not None:
            n = len(old)
            last_time[:n], key_of[:n], owner[:len(self.owner)] = old, self.key_of, self.owner
            free[:n] = self.free
            self.state[S_TIME] = compact(last_time, owner, tree, int(self.state[S_TIME]))
            self.state[S_LOW] = 0
            rehash(key_of, last_time, self.slot_key, self.slot_id)
        self.last_time, self.key_of, self.free, self.owner, self.tree = last_time, key_of, free, owner, tree
        self._ids = np.zeros(id_capacity, dtype=np.int64)

    # ------------------------------------------------------------------ rows
    def add(self, keys, prompt_tokens: int, counted: bool = True) -> None:
        """One row: a request's prompt block keys (``counted``; a block holds
        ``min(block size, remaining prompt)`` tokens), or the blocks a request adds when it
        finishes (not counted: recency only)."""
        n = len(keys)
        if self._pending_refs + n > self.flush_refs:
            self.flush()
        if self.max_keys + n > self.id_capacity:
            self.flush()
            self._alloc(self.max_keys + 2 * n)
        self._pending_keys.append(keys)
        self._pending_rows.append((n, int(prompt_tokens), 1 if counted else 0))
        self._pending_refs += n
        if counted:
            self.requests += 1
            self.block_refs += n
            self.prompt_tokens += int(prompt_tokens)
            if prompt_tokens > 0:
                self.requests_with_prompt += 1

    def flush(self) -> None:
        """Fold the buffered rows (one kernel call)."""
        if not self._pending_rows:
            return
        rows = np.array(self._pending_rows, dtype=np.int64)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(rows[:, 0], out=offsets[1:])
        keys = np.concatenate(self._pending_keys).astype(np.int64, copy=False) \
            if offsets[-1] else np.zeros(0, np.int64)
        self._pending_keys, self._pending_rows, self._pending_refs = [], [], 0
        bounded_stack_distances(
            keys, offsets, rows[:, 1], rows[:, 2], len(rows), self.block_size_tokens,
            self.max_keys, self.last_time, self.owner, self.tree, self.key_of, self.slot_key,
            self.slot_id, self.free, self.state, self.hist_blocks, self.hist_tokens,
            self.hist_req, self.reuse, self._ids)

    # ------------------------------------------------------------------ results
    @property
    def distinct_keys(self) -> int:
        """Keys seen (a forgotten key seen again counts again); buffered rows not included."""
        return int(self.state[S_DISTINCT])

    @property
    def forgotten_keys(self) -> int:
        return int(self.state[S_FORGOTTEN])

    @property
    def tracked_keys(self) -> int:
        return int(self.state[S_LIVE])

    @property
    def exact_up_to_blocks(self) -> int:
        """Capacities up to this many blocks are exact."""
        return self.max_keys

    def curve(self, bytes_per_token: Optional[int] = None) -> HitRateCurve:
        """The :class:`HitRateCurve` over capacities ``0..min(distinct keys, max_keys)``."""
        self.flush()
        d = min(self.distinct_keys, self.max_keys)
        return HitRateCurve(
            block_size_tokens=self.block_size_tokens, requests=self.requests,
            block_refs=self.block_refs, prompt_tokens=self.prompt_tokens, distinct_blocks=d,
            block_hits=np.cumsum(self.hist_blocks[:d + 1]),
            token_hits=np.cumsum(self.hist_tokens[:d + 1]),
            request_rate=np.cumsum(self.hist_req[:d + 1]) / max(self.requests_with_prompt, 1),
            reuse_hist=self.reuse.copy(), bytes_per_token=bytes_per_token)

    def token_hit_rates(self, capacities_blocks: Sequence[int]) -> list[Optional[float]]:
        """Token hit rate (hit tokens / prompt tokens) of LRU at each capacity in blocks; None
        beyond the exact range once a key was forgotten, or before any prompt token."""
        self.flush()
        if not self.prompt_tokens:
            return [None] * len(capacities_blocks)
        out: list[Optional[float]] = []
        hits = upto = 0  # hit tokens at distances below upto (ascending capacities: summed once)
        for c in capacities_blocks:
            c = max(int(c), 0)
            if c > self.max_keys and self.forgotten_keys:
                out.append(None)
                continue
            end = min(c, self.max_keys) + 1
            if end < upto:
                hits = upto = 0
            hits += int(self.hist_tokens[upto:end].sum())
            upto = end
            out.append(hits / self.prompt_tokens)
        return out



def max_keys_for_pool(pool_blocks: Optional[int]) -> int:
    """The bound used live: 4 x the pool (so the 4x point is exact), at most MAX_KEYS_CAP;
    DEFAULT_MAX_KEYS when the pool is unknown."""
    if not pool_blocks:
        return DEFAULT_MAX_KEYS
    return int(min(MAX_KEYS_CAP, max(1024, 4 * int(pool_blocks))))


MAX_LIVE = 1 << 16
"""Requests in flight whose content :class:`RequestRows` keeps for their finish row."""
MAX_CHAIN = 1 << 17
"""KV-event keys whose parent and tokens :class:`StoreRows` keeps to resolve chains."""


class RequestRows:
    """Rows from a kvdiag event stream's request content, as ``load_kvdiag`` builds them: a
    counted row at ``RequestArrived`` (token ids or hashes-mode chunk keys, re-chunked at
    ``block_size_tokens``), an uncounted one at ``RequestFinished`` (prompt and generated
    content from the request's ``BlockStored`` events). At most MAX_LIVE requests in flight
    are kept (the oldest dropped)."""

    def __init__(self, curve: ReuseCurve, hash_algorithm: str = "fast") -> None:
        self.curve = curve
        self.hash_algorithm = hash_algorithm
        self._live: OrderedDict[str, tuple[Content, list]] = OrderedDict()  # at most MAX_LIVE
        self.skipped = 0  # requests whose content cannot be keyed at the block size

    def arrived(self, ev) -> None:
        if ev.request_id in self._live:  # a repeated arrival of a request in flight
            return
        content = Content.of_arrival(ev)  # the one reader (its keys shared with the miss causes)
        if content is None:
            return
        bs = self.curve.block_size_tokens
        if not content.can_key(bs):
            self.skipped += 1
            return
        self.curve.add(content.keys(bs, self.hash_algorithm), ev.prompt_tokens)
        self._live[ev.request_id] = (content, [])
        if len(self._live) > MAX_LIVE:  # never finished: its finish row is lost
            self._live.popitem(last=False)

    def stored(self, ev) -> None:
        live = self._live.get(ev.request_id) if ev.request_id is not None else None
        if live is None:
            return
        if live[0].token_ids is not None and ev.token_ids is not None and len(ev.token_ids):
            live[1].append(list(ev.token_ids))
        elif live[0].token_ids is None and ev.chunk_hashes is not None:
            live[1].append((int(ev.num_tokens), list(ev.chunk_hashes)))

    def finished(self, ev) -> None:
        live = self._live.pop(ev.request_id, None)
        if live is None:
            return
        prompt, stored = live
        bs = self.curve.block_size_tokens
        if not stored:  # full_sequence of no stored block: the prompt alone, keyed at its arrival
            keys = prompt.keys(bs, self.hash_algorithm)
        elif prompt.token_ids is not None:
            keys = chunk_hashes(full_sequence(prompt.token_ids, stored), bs,
                                algorithm=self.hash_algorithm)
        else:
            chunks, _ = full_sequence_chunks(prompt.chunk_keys, prompt.num_tokens, stored)
            keys = Content(0, chunk_keys=chunks).keys(bs)
        self.curve.add(keys, 0, counted=False)


class StoreRows:
    """Rows from KV events of one tier, as ``load_vllm`` builds them: each
    ``PrefixCacheStored`` is a row of its parent chain's tokens and its own, re-chunked at the
    curve's block size. The chain table holds at most ``max_chain`` keys (default: the
    curve's bound, at most MAX_CHAIN; each with its block's token ids; the oldest dropped: a
    chain through a dropped key starts there, and the curve is no longer replay's)."""

    def __init__(self, curve: ReuseCurve, hash_algorithm: str = "fast",
                 max_chain: Optional[int] = None) -> None:
        self.curve = curve
        self.hash_algorithm = hash_algorithm
        self.max_chain = max_chain or min(curve.max_keys, MAX_CHAIN)
        self._chains: OrderedDict[int, tuple[Optional[int], list]] = OrderedDict()
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.resident_blocks = 0  # stored - removed, floored at 0
        self.peak_resident_blocks = 0

    def stored(self, ev) -> None:
        chains = self._chains
        hashes, parent, tokens, bs = ev.block_hashes, ev.parent_hash, ev.token_ids, ev.block_size_tokens
        parts, seen, p = [], set(), parent
        while p is not None and p in chains and p not in seen:
            seen.add(p)
            p, toks = chains[p]
            parts.append(toks)
        prefix = [t for toks in reversed(parts) for t in toks]
        for i, h in enumerate(hashes):
            chains[h] = (parent if i == 0 else hashes[i - 1], list(tokens[i * bs:(i + 1) * bs]))
        while len(chains) > self.max_chain:
            chains.popitem(last=False)
        seq = prefix + list(tokens)
        self.curve.add(chunk_hashes(seq, self.curve.block_size_tokens,
                                    algorithm=self.hash_algorithm), len(seq))
        self.stored_blocks += len(hashes)
        self.resident_blocks += len(hashes)
        self.peak_resident_blocks = max(self.peak_resident_blocks, self.resident_blocks)

    def removed(self, ev) -> None:
        self.removed_blocks += len(ev.block_hashes)
        self.resident_blocks = max(0, self.resident_blocks - len(ev.block_hashes))

    def cleared(self) -> None:
        self.resident_blocks = 0


def curve_of_events(events: Iterable, block_size_tokens: Optional[int] = None,
                    max_keys: int = MAX_KEYS_CAP, hash_algorithm: str = "fast") -> dict[str, HitRateCurve]:
    """The curves of a recorded event stream (what the live fold computes), by tier: "pool"
    for request content, the KV events' ``medium`` for their tiers ("default" without one).
    ``block_size_tokens``: the request rows' block size (default: the pool's or the header's,
    else 16)."""
    from kvdiag.events.schema import (BlockStored, KVPoolInfo, LogHeader, PrefixCacheCleared,
                               PrefixCacheRemoved, PrefixCacheStored, RequestArrived,
                               RequestFinished)

    bs = block_size_tokens
    req: Optional[RequestRows] = None
    tiers: dict[str, StoreRows] = {}
    for ev in events:
        if isinstance(ev, LogHeader):
            bs = bs or ev.block_size_tokens
        elif isinstance(ev, KVPoolInfo):
            bs = bs or ev.block_size_tokens
        elif isinstance(ev, RequestArrived):
            if req is None:
                req = RequestRows(ReuseCurve(bs or DEFAULT_BLOCK_TOKENS, max_keys), hash_algorithm)
            req.arrived(ev)
        elif isinstance(ev, BlockStored) and req is not None:
            req.stored(ev)
        elif isinstance(ev, RequestFinished) and req is not None:
            req.finished(ev)
        elif isinstance(ev, PrefixCacheStored):
            tier = ev.medium or "default"
            if tier not in tiers:
                tiers[tier] = StoreRows(ReuseCurve(ev.block_size_tokens or DEFAULT_BLOCK_TOKENS,
                                                   max_keys), hash_algorithm)
            tiers[tier].stored(ev)
        elif isinstance(ev, PrefixCacheRemoved) and (ev.medium or "default") in tiers:
            tiers[ev.medium or "default"].removed(ev)
        elif isinstance(ev, PrefixCacheCleared):
            for rows in tiers.values():
                rows.cleared()
    out = {} if req is None else {"pool": req.curve.curve()}
    out.update({t: rows.curve.curve() for t, rows in tiers.items()})
    return out


def _row_object(row: dict):
    from types import SimpleNamespace

    return SimpleNamespace(**{k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()})


def curves_of_frames(frames: dict, block_size_tokens: Optional[int],
                     max_keys: int = MAX_KEYS_CAP, hash_algorithm: str = "fast") -> dict[str, HitRateCurve]:
    """:func:`curve_of_events` over one node's event frames (``frames[tag]``: rows with
    ``ts_ns``, as :class:`kvdiag.diagnosis.frames.Logs` holds them), rows merged in time order
    (stable: a frame's own order at equal times)."""
    tags = ("request_arrived", "block_stored", "request_finished", "prefix_cache_stored",
            "prefix_cache_removed", "prefix_cache_cleared")
    merged = []
    for order, tag in enumerate(tags):
        df = frames.get(tag)
        if df is None or not len(df):
            continue
        for i, row in enumerate(df.to_dict("records")):
            merged.append((int(row["ts_ns"]), i, order, tag, row))
    merged.sort(key=lambda m: (m[0], m[2], m[1]))  # at equal times: arrival, store, finish
    req: Optional[RequestRows] = None
    tiers: dict[str, StoreRows] = {}
    for _, _, _, tag, row in merged:
        ev = _row_object(row)
        if tag == "request_arrived":
            if req is None and (ev.token_ids is not None or ev.chunk_hashes is not None):
                req = RequestRows(ReuseCurve(block_size_tokens or DEFAULT_BLOCK_TOKENS, max_keys),
                                  hash_algorithm)
            if req is not None:
                req.arrived(ev)
        elif tag == "block_stored" and req is not None:
            req.stored(ev)
        elif tag == "request_finished" and req is not None:
            req.finished(ev)
        elif tag == "prefix_cache_stored":
            tier = ev.medium or "default"
            if tier not in tiers:
                tiers[tier] = StoreRows(ReuseCurve(int(ev.block_size_tokens or DEFAULT_BLOCK_TOKENS),
                                                   max_keys), hash_algorithm)
            tiers[tier].stored(ev)
    out = {} if req is None else {"pool": req.curve.curve()}
    out.update({t: rows.curve.curve() for t, rows in tiers.items()})
    return out
