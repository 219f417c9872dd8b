"""An engine's prefix cache as its own KV events describe it (vLLM's ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``): content keys entering and leaving the cache.

One definition for the live subscriber (:mod:`kvdiag.collectors.vllm_kv_events`) and the
replay of recorded streams (:mod:`kvdiag.traces.kv_event_traces`):

- :func:`fold_block_hash`: a vLLM block hash (int, or bytes of sha256) as a 63-bit key;
- :func:`vllm_event_dict`: one vLLM event, tagged map (vLLM >= 0.11) or array (older), as a dict;
  :func:`event_dicts` also takes TensorRT-LLM's form (:mod:`kvdiag.pool.trtllm_kv_events`);
- :class:`SeqTracker` / :func:`find_seq_gaps`: batches lost between a publisher's sequence
  numbers, and publisher restarts;
- :class:`PrefixCacheTally`: stored blocks, duplicate stores, removals and clears.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Iterable, Literal, Optional

from kvdiag.events.schema import (INT64_MAX, MASK63, BlockHash, Event, PrefixCacheCleared,
                           PrefixCacheRemoved, PrefixCacheStored)
from kvdiag.pool.trtllm_kv_events import trtllm_event_dicts

VLLM_KV_EVENTS_COLLECTOR = "vllm-kv-events"
"""``collector`` of the subscriber's health events; its ``CollectorGap.dropped_events`` counts
lost *batches* (one per engine step with cache changes), not events."""

DUPLICATE_BATCH_MESSAGE = "duplicate KV event batches dropped"
"""Start of the subscriber's ``CollectorError`` message counting the duplicate batches it
dropped (``count``); the doctor's ``kv_events.health`` adds them."""

VLLM_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_ARRAY_FIELDS = {  # field order of the array form (older vLLM: array_like tagged structs)
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def fold_block_hash(h: object) -> BlockHash:
    """A vLLM block hash as a 63-bit key: an int (vLLM's default, 64 bits) keeps its low 63
    bits; bytes (sha256, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), or bytes recorded in JSON
    as a list of ints, their first 8 bytes little-endian; a str its first 8 UTF-8 bytes.
    Raises TypeError for anything else."""
    if isinstance(h, bool):
        raise TypeError("a block hash is an int or bytes, not a bool")
    if isinstance(h, int):
        return BlockHash(h & MASK63)
    if isinstance(h, (bytes, bytearray, memoryview)):
        return BlockHash(int.from_bytes(bytes(h[:8]), "little") & MASK63)
    if isinstance(h, str):
        return BlockHash(int.from_bytes(h.encode()[:8], "little") & MASK63)
    if isinstance(h, list):
        return BlockHash(int.from_bytes(bytes(h[:8]), "little") & MASK63)
    raise TypeError(f"a block hash is an int or bytes, not {type(h).__name__}")


def vllm_event_dict(ev: object) -> dict:
    """One vLLM KV event as a dict with ``type`` and vLLM's field names: a tagged map as
    vLLM >= 0.11 encodes it is returned as is; the array form of older versions
    (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    medium]``) is named. Raises ValueError for anything else."""
    if isinstance(ev, list) and ev and ev[0] in VLLM_TAGS:
        out = dict(zip(_ARRAY_FIELDS[ev[0]], ev[1:]))
        out["type"] = ev[0]
        return out
    if isinstance(ev, dict) and ev.get("type") in VLLM_TAGS:
        return ev
    raise ValueError("expected a vLLM KV event (BlockStored, BlockRemoved or AllBlocksCleared)")


def event_dicts(ev: object) -> list[dict]:
    """The vLLM-shaped dicts of one published event: vLLM's and SGLang's (tagged map or array,
    :func:`vllm_event_dict`) or TensorRT-LLM's serialized form (:func:`trtllm_event_dicts`)."""
    if isinstance(ev, dict) and "data" in ev and "event_id" in ev:
        return trtllm_event_dicts(ev)
    return [vllm_event_dict(ev)]


MEDIUM_TIERS: dict[str, int] = {"GPU": 0, "CPU": 1, "CPU_PINNED": 1, "CPU_TIER1": 1,
                                "CPU_TIER2": 2, "DISK": 2, "LOCAL_DISK": 2, "EXTERNAL": 3}
"""Tier of a ``medium`` as publishers name it: 0 device memory (vLLM and SGLang ``GPU``), 1 host
memory (vLLM ``CPU``, SGLang ``CPU_PINNED``, older SGLang ``CPU_TIER1``), 2 disk (SGLang
``DISK``, older ``CPU_TIER2``), 3 a shared or remote pool (SGLang ``EXTERNAL``: Mooncake,
LMCache). Unlisted names: :func:`medium_tier` returns None."""


def medium_tier(medium: Optional[str]) -> Optional[int]:
    """The tier of a published ``medium`` (:data:`MEDIUM_TIERS`; no medium: 0, the engine's
    own device pool, which is what publishers that omit it mean)."""
    if medium is None:
        return 0
    return MEDIUM_TIERS.get(medium.upper())


def plain_token_ids(tokens: object) -> list:
    """Token ids of a ``BlockStored`` as a list of ints, or ``[]`` where the publisher sent none
    (absent, null) or pages of id pairs (SGLang's bigram pages): the keys still count, the
    content is not kept. Raises ValueError for anything else (an int out of range, a string)."""
    if tokens is None:
        return []
    if not isinstance(tokens, list):
        raise ValueError(f"BlockStored.token_ids: expected a list, found {_show(tokens)}")
    if tokens and all(isinstance(t, list) for t in tokens):  # bigram pages: [[a, b], ...]
        return []
    for i, t in enumerate(tokens):
        checked_int(t, f"BlockStored.token_ids[{i}]", optional=False)
    return tokens


UINT64_MAX = 2**64 - 1
MAX_TS_S = INT64_MAX // 10**9  # batch timestamps whose nanoseconds fit in int64


def checked_int(value: object, name: str, lo: int = 0, hi: int = INT64_MAX,
         optional: bool = True) -> Optional[int]:
    """``value`` as an int in ``lo..hi`` (None allowed when ``optional``); ValueError naming
    the field otherwise."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name}: expected an integer {lo}..{hi}, found {_show(value)}")
    return value


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _hash(value: object, name: str) -> BlockHash:
    """A block hash as vLLM defines it: a 64-bit int (signed or unsigned), or non-empty bytes
    (in JSON: a list of ints 0..255); folded by :func:`fold_block_hash`."""
    if isinstance(value, int) and not isinstance(value, bool):
        checked_int(value, name, -(2**63), UINT64_MAX)
    elif isinstance(value, list):
        if not value or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 255
                                for b in value):
            raise ValueError(f"{name}: expected bytes (a non-empty list of integers 0..255)")
    elif not isinstance(value, (bytes, bytearray, str)) or not value:
        raise ValueError(f"{name}: expected a 64-bit integer or non-empty bytes, found "
                         f"{_show(value)}")
    return fold_block_hash(value)


def batch_ts_ns(ts: object, name: str = "ts") -> int:
    """A batch's wall-clock seconds as ns; ValueError unless a finite number 0..MAX_TS_S."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts <= MAX_TS_S:
        raise ValueError(f"{name}: expected seconds 0..{MAX_TS_S} (a finite number), found "
                         f"{_show(ts)}")
    return int(ts * 1e9)


def check_seq(seq: object, name: str = "seq") -> int:
    """A batch sequence number: 0..2^63-1; ValueError otherwise."""
    return checked_int(seq, name, optional=False)


def schema_event(ev: dict, ts_ns: int, seq: int) -> Event:
    """A :func:`vllm_event_dict` as the schema's ``PrefixCache*`` event (hashes folded by
    :func:`fold_block_hash`), every field checked: ints within their ranges (token ids,
    block size, group and LoRA ids non-negative, within int64), hashes as vLLM defines them.
    Every publisher of this wire format is read (vLLM, SGLang, and LMCache or Mooncake through
    them): fields kvdiag does not keep (``lora_name``, ``extra_keys``, SGLang's ``cache_salt``
    and ``session_id``, vLLM's ``locality``) are accepted and dropped; token ids absent, null
    or not plain ids (SGLang's bigram pages) leave ``token_ids`` empty, the keys still count.
    Raises ValueError ``Kind.field: expected ...``."""
    kind = ev["type"]
    if kind == "AllBlocksCleared":
        return PrefixCacheCleared(ts_ns=ts_ns, seq=seq)
    hashes = ev.get("block_hashes")
    if not isinstance(hashes, list):
        raise ValueError(f"{kind}.block_hashes: expected a list, found {_show(hashes)}")
    keys = [_hash(h, f"{kind}.block_hashes[{i}]") for i, h in enumerate(hashes)]
    medium = ev.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise ValueError(f"{kind}.medium: expected a string, found {_show(medium)}")
    group = checked_int(ev.get("group_idx"), f"{kind}.group_idx")
    if kind == "BlockRemoved":
        return PrefixCacheRemoved(ts_ns=ts_ns, seq=seq, block_hashes=keys, medium=medium,
                                  group_idx=group)
    parent = ev.get("parent_block_hash")
    parent_key = None if parent is None else _hash(parent, "BlockStored.parent_block_hash")
    tokens = plain_token_ids(ev.get("token_ids"))
    block_size = checked_int(ev.get("block_size"), "BlockStored.block_size", lo=1,
                             optional=not tokens) or 0
    checked_int(ev.get("lora_id"), "BlockStored.lora_id")  # SGLang names adapters in lora_name
    return PrefixCacheStored(ts_ns=ts_ns, seq=seq, block_hashes=keys, parent_hash=parent_key,
                             token_ids=tokens, block_size_tokens=block_size, medium=medium,
                             group_idx=group)


# ---------------------------------------------------------------- sequence numbers

SeqStep = Literal["first", "next", "gap", "restart"]


class SeqTracker:
    """Follows a publisher's batch sequence numbers (vLLM counts from 0, +1 a batch). The
    first seen sets the expectation; a later seq above it means ``seq - expected`` batches
    were lost; a seq at or below the last one means the publisher restarted (counting anew)."""

    def __init__(self) -> None:
        self.expected: Optional[int] = None  # next seq due; None before the first

    def observe(self, seq: int) -> tuple[SeqStep, int]:
        """(what ``seq`` is, batches lost just before it) and expect ``seq + 1`` next."""
        expected, self.expected = self.expected, seq + 1
        if expected is None:
            return "first", 0
        if seq == expected:
            return "next", 0
        if seq > expected:
            return "gap", seq - expected
        return "restart", 0


@dataclass(frozen=True, slots=True)
class SeqGap:
    """Batches ``first_seq..last_seq`` (inclusive) are missing; ``start_ns``/``end_ns``: the
    timestamps of the batches on either side (None when unknown)."""

    first_seq: int
    last_seq: int
    start_ns: Optional[int] = None
    end_ns: Optional[int] = None

    @property
    def lost_batches(self) -> int:
        return self.last_seq - self.first_seq + 1


def find_seq_gaps(batches: Iterable[tuple[int, Optional[int]]]) -> list[SeqGap]:
    """The gaps of a recorded stream of ``(seq, ts_ns)`` batches in arrival order, by
    :class:`SeqTracker` (a restart starts a new expectation, it is not a gap)."""
    tracker, gaps, last_ts = SeqTracker(), [], None
    for seq, ts_ns in batches:
        expected = tracker.expected
        if tracker.observe(seq)[0] == "gap":
            gaps.append(SeqGap(expected, seq - 1, last_ts, ts_ns))
        last_ts = ts_ns
    return gaps


def event_batches(events: Iterable[Event]) -> list[tuple[int, int]]:
    """``(seq, ts_ns)`` of each batch behind the ``PrefixCache*`` events of a kvdiag log, in
    log order: consecutive events with the same seq and timestamp are one batch. A batch the
    subscriber could not decode, or one without events, leaves no event: the log's own
    ``CollectorGap`` events are the subscriber's verdict."""
    out: list[tuple[int, int]] = []
    for ev in events:
        if isinstance(ev, (PrefixCacheStored, PrefixCacheRemoved, PrefixCacheCleared)):
            if not out or out[-1] != (ev.seq, ev.ts_ns):
                out.append((ev.seq, ev.ts_ns))
    return out


# ---------------------------------------------------------------- stored, duplicate, removed


@dataclass(frozen=True, slots=True)
class PrefixCacheCounts:
    """What a prefix-cache event stream says about the cache, counted in blocks (keys).

    ``stored_blocks``: keys in store events. ``duplicate_stores``: stores of a key the cache
    already held (stored and not yet removed, same medium and group): the engine computed a
    block its cache had — a missed hit, or two requests computing one prefix at the same time
    (vLLM re-announces reused blocks as stores for requests with ``kv_cache_report_mode="full"``:
    those count here too). ``removed_blocks``: keys in remove events; ``removed_unknown``: of
    them, keys not held (stored before the stream began or in a gap). ``clears``: clear-all
    events. ``held_blocks``: keys held at the end. ``restarts``: publisher restarts, after which
    the held keys are forgotten (a new engine starts empty)."""

    stored_blocks: int = 0
    duplicate_stores: int = 0
    removed_blocks: int = 0
    removed_unknown: int = 0
    clears: int = 0
    held_blocks: int = 0
    restarts: int = 0

    @property
    def duplicate_share(self) -> Optional[float]:
        """duplicate_stores / stored_blocks: the share of stored blocks whose content the
        cache already held (None before any store)."""
        return self.duplicate_stores / self.stored_blocks if self.stored_blocks else None


class PrefixCacheTally:
    """Counts :class:`PrefixCacheCounts` over events fed in publish order. A key is held as
    many times as it was stored minus removed (vLLM caches two blocks of one content when two
    requests compute it at once, and removes each on its own); keys are per medium and group."""

    def __init__(self) -> None:
        self._held: Counter[Hashable] = Counter()
        self._n = dict(stored_blocks=0, duplicate_stores=0, removed_blocks=0, removed_unknown=0,
                       clears=0, restarts=0)

    def stored(self, keys: Iterable[int], medium: Optional[str] = None,
               group_idx: Optional[int] = None) -> int:
        """Keys entered the cache; returns how many of them it already held."""
        dup = 0
        for k in keys:
            key = (medium, group_idx, int(k))
            dup += self._held[key] > 0
            self._held[key] += 1
            self._n["stored_blocks"] += 1
        self._n["duplicate_stores"] += dup
        return dup

    def removed(self, keys: Iterable[int], medium: Optional[str] = None,
                group_idx: Optional[int] = None) -> None:
        """Keys left the cache."""
        for k in keys:
            key = (medium, group_idx, int(k))
            self._n["removed_blocks"] += 1
            if self._held[key] > 0:
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]
            else:
                self._held.pop(key, None)
                self._n["removed_unknown"] += 1

    def cleared(self) -> None:
        """Every key left the cache (vLLM's clear carries no medium: all are dropped)."""
        self._held.clear()
        self._n["clears"] += 1

    def restarted(self) -> None:
        """The publisher restarted: what the cache held is no longer known."""
        self._held.clear()
        self._n["restarts"] += 1

    def feed(self, ev: Event) -> None:
        """Fold one schema event (``PrefixCache*``; others are ignored)."""
        if isinstance(ev, PrefixCacheStored):
            self.stored(ev.block_hashes, ev.medium, ev.group_idx)
        elif isinstance(ev, PrefixCacheRemoved):
            self.removed(ev.block_hashes, ev.medium, ev.group_idx)
        elif isinstance(ev, PrefixCacheCleared):
            self.cleared()

    @property
    def counts(self) -> PrefixCacheCounts:
        return PrefixCacheCounts(**self._n, held_blocks=sum(self._held.values()))


def prefix_cache_counts(events: Iterable[Event]) -> PrefixCacheCounts:
    """:class:`PrefixCacheCounts` of the ``PrefixCache*`` events among ``events`` (in order);
    a batch whose seq goes back (publisher restart) forgets the held keys."""
    tally, tracker, last = PrefixCacheTally(), SeqTracker(), None
    for ev in events:
        if not isinstance(ev, (PrefixCacheStored, PrefixCacheRemoved, PrefixCacheCleared)):
            continue
        if (ev.seq, ev.ts_ns) != last:
            last = (ev.seq, ev.ts_ns)
            if tracker.observe(ev.seq)[0] == "restart":
                tally.restarted()
        tally.feed(ev)
    return tally.counts
