"""Capacity curves, live: LRU stack (reuse) distances folded in stream order, hence the prefix
hit rate at every cache capacity.

Mattson: LRU with a capacity of ``C`` blocks holds exactly the ``C`` most recently used
blocks, so a reference hits iff its stack distance (its block's rank in the recency order when
its request arrives; 1 = most recent) is ``<= C``; under prefix matching a block hits iff the
largest distance over its request's blocks up to it is ``<= C``. One pass gives the hit rate at
every capacity at once. The rows (:mod:`kvdiag.simulation.curve_rows` builds them) are those
of ``kvdiag replay --curve``
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
batches by a compiled kernel (:mod:`kvdiag.simulation._curvekernels`, key lookup included), so
a curve read first folds what is pending.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from kvdiag.simulation import _simkernels as K
from kvdiag.simulation._curvekernels import (_EMPTY, S_DISTINCT, S_FORGOTTEN, S_LIVE, S_LOW, S_TIME,
                                             bounded_stack_distances, rehash)
from kvdiag.simulation._stackkernels import compact
from kvdiag.simulation.lru_curve import HitRateCurve

DEFAULT_MAX_KEYS = 1 << 18
"""Keys tracked before the pool's size is known (then: 4 x the pool, at most MAX_KEYS_CAP)."""
MAX_KEYS_CAP = 1 << 21
POOL_MULTIPLES = (0.5, 1.0, 2.0, 4.0)
"""The capacities top and the exporter show, as multiples of the current pool."""
_FLUSH_REFS = 1 << 14  # block references buffered before the kernel runs


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
