"""Health of an engine's KV-event stream (the ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` wire format of vLLM, SGLang and the caches that publish through them),
folded one batch and one event at a time in bounded memory. One definition: the live
subscriber (:mod:`kvdiag.collectors.vllm_kv_events`) and the doctor (through
:class:`kvdiag.pool.blockfacts.BlockFacts`, rule ``kv_events.health``) feed the same
:class:`StreamHealth`.

The checks, each a count of :class:`StreamHealthCounts`:

- **late join**: the first batch seen has a seq above 0: the batches before it (what the cache
  already held) were never seen. Not a fault; it explains removals of unknown keys.
- **sequence gaps**: a seq above the expected one; ``lost_batches`` counts the batches between.
- **duplicate batches**: a seq already received with the same timestamp (a replayed batch
  delivered twice, a proxy resending; among the latest :data:`RECENT_SEQS`): dropped by the
  subscriber, counted.
- **restarts**: a seq below the expected one that is not a duplicate (a new timestamp): the
  publisher counts anew; the keys held are forgotten.
- **removed before stored**: keys removed that the stream never stored, while the stream is
  *complete* (seen from seq 0, no gap, since the last restart or clear): the publisher lost or
  misordered a store. The same on an incomplete stream is ``removed_unknown_explained``.
- **duplicate stores**: keys stored while held (same medium and group). Counted, not judged:
  vLLM stores one content twice when two requests compute it at once, and re-announces reused
  blocks with ``kv_cache_report_mode="full"`` (the doctor sets them against the engine's hit
  counter: the coverage of reused blocks, :func:`kvdiag.diagnosis.kv_stream_rules.kv_stream_health`).
- **clear storms**: :data:`STORM_CLEARS` or more ``AllBlocksCleared`` within
  :data:`STORM_WINDOW_S` seconds of batch time (each storm counted once).
- **balance**: keys held in the device tier (``medium`` tier 0, :func:`medium_tier`) after a
  batch above the pool's blocks (``pool_blocks``, when known): stored - removed cannot exceed
  what the pool holds, so removals went missing. ``over_pool_batches`` counts such batches,
  ``max_device_held_blocks`` the peak.

Memory: the held keys are at most ``max_keys`` (4 x the pool's blocks, at least 65,536; 2^20
without a pool size); beyond it the oldest eighth of them is forgotten (``forgotten_keys``),
so a stream that never removes still folds in flat memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Hashable, Optional

from kvdiag.pool.prefix_cache import medium_tier
from kvdiag.events.schema import Event, PrefixCacheCleared, PrefixCacheRemoved, PrefixCacheStored

STORM_CLEARS = 3
"""``AllBlocksCleared`` events within :data:`STORM_WINDOW_S` that make a storm."""
STORM_WINDOW_S = 60.0
RECENT_SEQS = 4096
"""Received (seq, timestamp) pairs remembered to tell a duplicate batch from a restart."""
MIN_MAX_KEYS = 65_536
NO_POOL_MAX_KEYS = 1 << 20


@dataclass(frozen=True, slots=True)
class StreamHealthCounts:
    """What :class:`StreamHealth` found (module docstring defines each)."""

    batches: int = 0
    events: int = 0
    first_seq: Optional[int] = None
    gaps: int = 0
    lost_batches: int = 0
    duplicate_batches: int = 0
    restarts: int = 0
    stored_blocks: int = 0
    duplicate_stores: int = 0
    removed_blocks: int = 0
    removed_before_stored: int = 0
    removed_unknown_explained: int = 0
    clears: int = 0
    clear_storms: int = 0
    pool_blocks: Optional[int] = None
    device_held_blocks: int = 0
    max_device_held_blocks: int = 0
    over_pool_batches: int = 0
    first_over_pool_ns: Optional[int] = None
    forgotten_keys: int = 0
    last_ts_ns: Optional[int] = None  # the latest batch's timestamp: the counts are as of it

    @property
    def late_join(self) -> bool:
        return bool(self.first_seq)

    def as_dict(self) -> dict:
        return asdict(self)


class StreamHealth:
    """Folds a KV-event stream into :class:`StreamHealthCounts`. Call :meth:`batch` for each
    batch as it arrives (it says whether to keep it: False for a duplicate), then :meth:`event`
    for each of its schema events; or :meth:`event` alone (a recorded log: a new ``(seq,
    ts_ns)`` starts a batch)."""

    def __init__(self, pool_blocks: Optional[int] = None) -> None:
        self._n = {k: v for k, v in asdict(StreamHealthCounts()).items()}
        self._held: dict[Hashable, int] = {}  # (medium, group, key) -> times held; insertion order
        self._device_held = 0
        self._expected: Optional[int] = None
        self._recent: dict[int, int] = {}  # seq -> ts_ns of the latest batches
        self._recent_order: deque[int] = deque()
        self._tiers: dict = {}  # medium -> is the device tier
        self._complete = False  # seen from seq 0 without a gap since the last restart or clear
        self._clear_ts: deque[int] = deque(maxlen=STORM_CLEARS)
        self._in_storm = False
        self._batch_key: Optional[tuple[int, int]] = None
        self._batch_ts = 0
        self._over_batch: Optional[tuple[int, int]] = None
        self.max_keys = NO_POOL_MAX_KEYS
        self.set_pool_blocks(pool_blocks)

    def set_pool_blocks(self, pool_blocks: Optional[int]) -> None:
        """The device pool's size in blocks (a ``KVPoolInfo`` or the engine's cache config)."""
        if pool_blocks:
            self._n["pool_blocks"] = int(pool_blocks)
            self.max_keys = max(MIN_MAX_KEYS, 4 * int(pool_blocks))

    @property
    def counts_pool(self) -> Optional[int]:
        """The pool size in blocks the balance check uses (None: unknown)."""
        return self._n["pool_blocks"]

    def seen(self, seq: int, ts_ns: int) -> bool:
        """Whether batch ``seq`` with timestamp ``ts_ns`` was already received (among the
        latest :data:`RECENT_SEQS`): a duplicate, not a restart."""
        return self._recent.get(seq) == ts_ns

    # ---------------------------------------------------------------- batches

    def batch(self, seq: int, ts_ns: int) -> bool:
        """A batch arrived; False when it is a duplicate (not to be recorded again)."""
        n = self._n
        self._close_batch()
        self._batch_key, self._batch_ts = (seq, ts_ns), ts_ns
        self._n["last_ts_ns"] = ts_ns
        expected = self._expected
        if expected is None:
            n["first_seq"] = seq
            self._complete = seq == 0
        elif seq > expected:
            n["gaps"] += 1
            n["lost_batches"] += seq - expected
            self._complete = False
        elif seq < expected:
            if self._recent.get(seq) == ts_ns:
                n["duplicate_batches"] += 1
                self._batch_key = None
                return False
            n["restarts"] += 1
            self._forget()
            self._recent.clear()
            self._recent_order.clear()
            self._complete = seq == 0
        self._recent[seq] = ts_ns
        order = self._recent_order
        order.append(seq)
        if len(order) > RECENT_SEQS:
            self._recent.pop(order.popleft(), None)
        self._expected = seq + 1
        n["batches"] += 1
        return True

    def _close_batch(self) -> None:
        """Balance check at the end of a batch (the engine's step is applied whole); a batch
        is judged once, also when :attr:`counts` looked at it while open."""
        if self._batch_key is None:
            return
        n = self._n
        held = self._device_held
        n["device_held_blocks"] = held
        n["max_device_held_blocks"] = max(n["max_device_held_blocks"], held)
        if n["pool_blocks"] and held > n["pool_blocks"] and self._over_batch != self._batch_key:
            self._over_batch = self._batch_key
            n["over_pool_batches"] += 1
            if n["first_over_pool_ns"] is None:
                n["first_over_pool_ns"] = self._batch_ts

    # ---------------------------------------------------------------- events

    def event(self, ev: Event) -> None:
        """One ``PrefixCache*`` schema event (others are ignored)."""
        if not isinstance(ev, (PrefixCacheStored, PrefixCacheRemoved, PrefixCacheCleared)):
            return
        if self._batch_key != (ev.seq, ev.ts_ns):
            if not self.batch(ev.seq, ev.ts_ns):
                return
        n = self._n
        n["events"] += 1
        device = self._tiers.get(ev.medium) if not isinstance(ev, PrefixCacheCleared) else None
        if device is None and not isinstance(ev, PrefixCacheCleared):
            device = self._tiers[ev.medium] = medium_tier(ev.medium) == 0
        if isinstance(ev, PrefixCacheStored):
            for k in ev.block_hashes:
                key = (ev.medium, ev.group_idx, int(k))
                times = self._held.get(key, 0)
                n["duplicate_stores"] += times > 0
                self._held[key] = times + 1
                self._device_held += device
                n["stored_blocks"] += 1
            if len(self._held) > self.max_keys:
                self._forget_oldest()
        elif isinstance(ev, PrefixCacheRemoved):
            for k in ev.block_hashes:
                key = (ev.medium, ev.group_idx, int(k))
                n["removed_blocks"] += 1
                times = self._held.get(key, 0)
                if times > 1:
                    self._held[key] = times - 1
                elif times == 1:
                    del self._held[key]
                else:
                    n["removed_before_stored" if self._complete else "removed_unknown_explained"] += 1
                    continue
                self._device_held -= device
        else:
            n["clears"] += 1
            self._forget()
            self._complete = True  # known empty: a later removal of an unseen key is a fault
            ts = ev.ts_ns
            self._clear_ts.append(ts)
            full = len(self._clear_ts) == STORM_CLEARS
            storm = full and ts - self._clear_ts[0] <= STORM_WINDOW_S * 1e9
            if storm and not self._in_storm:
                n["clear_storms"] += 1
            self._in_storm = storm

    def _forget_oldest(self) -> None:
        """Drop the oldest eighth of the held keys (at least those above ``max_keys``): one
        rebuild per many stores, where dropping one key at a time from a dict's front is slow."""
        items = list(self._held.items())
        drop = max(len(items) - self.max_keys, len(items) // 8)
        for (medium, _, _), times in items[:drop]:
            if medium_tier(medium) == 0:
                self._device_held -= times
        self._n["forgotten_keys"] += drop
        self._held = dict(items[drop:])

    def _forget(self) -> None:
        self._held.clear()
        self._device_held = 0

    @property
    def counts(self) -> StreamHealthCounts:
        """The counts so far (the open batch's balance included)."""
        self._close_batch()
        return StreamHealthCounts(**self._n)
