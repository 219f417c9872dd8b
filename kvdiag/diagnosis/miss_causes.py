"""Why prompt tokens missed the engine's prefix cache: one cause per missed token.

A finished request's missed tokens are the prompt tokens the engine did not serve from its
prefix cache, ``missed = max(0, prompt_tokens - cached_prompt_tokens)`` of its
``RequestFinished`` (vLLM: ``prefix_cache_queries - prefix_cache_hits`` of its ``/metrics``,
counted at a request's first admission). Cached tokens are a prefix, so the missed tokens are
the prompt positions ``cached_prompt_tokens .. prompt_tokens - 1``. Each gets exactly one cause;
the causes of a window sum to the engine's missed tokens of the requests that finished in it.

The reference is a shadow prefix cache at the engine's own settings (LRU, the engine's block
size ``B`` and pool size in blocks, from ``KVPoolInfo``), with the semantics of
:class:`kvdiag.simulation.sharing.PrefixCacheSim` and the engine-settings cache of
:class:`kvdiag.simulation.live_sharing.ShadowSharingSink`: at a request's arrival its prompt's
full blocks (chained content keys, from ``RequestArrived.token_ids`` or, in a hashes-mode log,
``chunk_hashes``) are looked up (its hit blocks ``h`` = the longest run of leading blocks held),
then each is touched or inserted (evicting the least recently used); at its finish the full
blocks of its prompt and generated tokens (its ``BlockStored``) are touched or inserted. Blocks
are keyed per hash domain (``RequestArrived.cache_domain``: what the engine folds into its block
hashes beside the tokens, e.g. vLLM's ``cache_salt`` or LoRA), as the engine keys them.

Block ``j`` (tokens ``j*B .. (j+1)*B - 1``; ``F = prompt // B`` full blocks) of a missed token
gets its cause in this order, the first that applies:

1. ``below_block``: ``j >= F``: the prompt's partial last block (engines cache only full
   blocks); or ``j == F - 1`` when ``prompt % B == 0`` and the shadow held the block: engines
   compute at least the last prompt token (its logits give the first output token): vLLM caps a
   hit at ``prompt - 1`` tokens (``KVCacheManager.get_computed_blocks``: ``max_cache_hit_length =
   request.num_tokens - 1``) and hits are whole blocks, so a fully cached block-aligned prompt
   recomputes its whole last block.
2. held by the shadow at arrival (``j < h``) yet missed: ``preemption`` when the request was
   preempted (``RequestPreempted``) and the engine counts its cached tokens at the last admission
   (transformers; vLLM counts them at the first admission and its re-admissions in separate
   ``preempted`` counters, so there the cause never applies); else, from the request's
   ``BlockStored`` (and ``BlockDeduplicated``: a block it filled, found stored meanwhile) events
   in order from its first computed block ``cached_prompt_tokens // B``
   (:mod:`kvdiag.diagnosis.engine_recompute`): ``evicted`` when the block was stored anew under
   an engine hash whose earlier block the engine let go in between (``BlockEvicted``, or
   ``BlockReleased`` not kept cached: transformers' blocks on a preemption): a pool
   under pressure, where running requests take blocks that the shadow, holding content alone,
   does not count (no reuse distance or age: the engine's eviction, not the shadow's);
   ``in_flight`` when no block of the engine held that hash when the request was looked up (its
   first ``RequestScheduled``; without one, its first store): an earlier request in flight was
   still computing the content, which the shadow counts as cached from that request's arrival
   and engines share only once stored; else ``engine_skip``: the shadow at the engine's own
   settings held the content and, as far as the engine's events tell, so did the engine
   (lookups the engine skipped, an engine that reports no stores or evictions: the remainder,
   named as such).
3. not held (``j >= h``): ``evicted`` when this domain's key of block ``j`` was seen before (in
   the shadow after its prefix broke, or among the keys it evicted): the content was reused after
   the shadow at the engine's capacity had let it (or its prefix) go. Each evicted block carries
   its *reuse distance* (block references, touches and inserts of any block, since the content's
   last use: the reuse time; the LRU stack distance in distinct blocks is at most this) and the
   time since its last use, or neither when it fell off the evicted-key history (see memory).
4. ``hash_domain``: the same content key was held by the shadow under another hash domain
   (another ``cache_domain``): same tokens, different salt or LoRA.
5. ``cold``: first occurrence: no earlier request had this block's prefix in this domain.
6. ``unknown``: the request's content is not in the log (a client that joined mid-request, a
   log without token ids or hashes), the engine's block size is unknown (no ``KVPoolInfo``) or
   a hashes-mode log cannot be keyed at it (not a multiple of 16 tokens). Never another cause.

Multimodal ``extra_keys`` are not a domain here: they change only the blocks holding a
placeholder, which the log does not locate; such misses show as ``engine_skip``.

Memory: per live request its blocks' causes at arrival; the engine's block contents
(:mod:`kvdiag.diagnosis.engine_recompute`); per content key the shadow's entries (at most the
pool's block count), evicted keys' last use for ``ghost_factor`` x the pool (reuse distance and
age), then a fixed-size Bloom filter (``bloom_bits``) that tells evicted from cold beyond that
(false positives, cold blocks counted as evicted: under 1% up to ~0.68 M keys fallen off the
history per MiB of filter, the default).

Speed: the shadow is arrays, its per-block loops compiled (numba, two calls per request:
:mod:`kvdiag.simulation._misskernels`, loaded in the background from the fold's creation;
tests/integration/test_miss_causes_reference.py: a plain-Python reference).

:class:`MissCauseFold` is the one definition: ``kvdiag top`` and the exporter feed it live,
the doctor and the report replay a log through it (:mod:`kvdiag.diagnosis.miss_replay`), with
the engine's evictions and uncached releases (:data:`REPLAY_EVENTS`); a live fold takes those
from its ``ledger`` (:meth:`kvdiag.pool.blockledger.BlockLedger.log_dropped`) at each store,
arrival and finish: the same content let go before the same events.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import numpy as np

from kvdiag.diagnosis.engine_recompute import NOT_HELD, RESTORED_EVICTED, EngineRecompute
from kvdiag.diagnosis.miss_shadow import Shadow, domain_mask
from kvdiag.diagnosis.miss_tally import (BELOW_BLOCK, CAUSES, COLD, ENGINE_SKIP, EVICTED, HASH_DOMAIN,
                                         IN_FLIGHT, PREEMPTION, UNKNOWN, ExplainedLog, MissTally,
                                         RequestMisses, explained_tokens)
from kvdiag.simulation import _misskernels as K
from kvdiag.traces.kvdiag_logs import full_sequence
from kvdiag.pool.hashing import Content, full_sequence_chunks
from kvdiag.events.schema import (BlockDeduplicated, BlockEvicted, BlockReleased, BlockStored, Event,
                                  KVPoolInfo, RequestArrived, RequestFinished, RequestPreempted,
                                  RequestScheduled)
from kvdiag.pool.blockledger import BlockLedger

HELD = -1  # a block the shadow served at arrival

_MAX_BEFORE_POOL = 4096  # events kept while the engine's pool is unknown
_MAX_LIVE = 1 << 16  # live requests remembered (oldest dropped: lost finishes)


class _Live:
    __slots__ = ("content", "mask", "codes", "dist", "age", "hit_blocks", "stored", "preempted",
                 "keys", "dkeys", "store_codes", "lookup_ns")

    def __init__(self, content, mask, codes, dist, age, hit_blocks, keys, dkeys) -> None:
        self.content, self.mask, self.codes = content, mask, codes  # mask: its domain's (domain_mask)
        # per block from hit_blocks: evicted ones' figures, -1: none (None: no block evicted)
        self.dist, self.age = dist, age
        self.hit_blocks = hit_blocks
        self.keys, self.dkeys = keys, dkeys  # the prompt's block keys (plain, in its domain)
        self.stored: list = []
        # per BlockStored/BlockDeduplicated of the request, in order: engine_recompute's code
        self.store_codes: list[int] = []
        self.lookup_ns, self.preempted = None, False

    def looked_up(self, ts_ns: int) -> int:
        """When the engine looked the request up: its first scheduling or block event (now)."""
        if self.lookup_ns is None:
            self.lookup_ns = ts_ns
        return self.lookup_ns

    def evicted_figures(self, k: int) -> tuple[Optional[int], Optional[int]]:
        """Block ``hit_blocks + k``'s reuse distance and time since last use (None: unknown)."""
        d, a = int(self.dist[k]), int(self.age[k])
        return (d if d >= 0 else None, a if a >= 0 else None)


_EVICTED_CODE = bytes([EVICTED])


class MissCauseFold:
    """Fed events in order (:meth:`feed`), attributes every finished request's missed tokens
    (module docstring) and calls ``on_request`` with its :class:`RequestMisses`; ``tally``
    holds the cumulative counts, ``explained`` the requests with tokens the engine's own
    events explain (:func:`kvdiag.diagnosis.miss_tally.explained_tokens`).
    ``cached_at_first_admission``: the engine counts a request's cached tokens at its first
    admission (vLLM: ``engine="vllm"``), so preemption never explains them; None: from
    ``engine``. ``ledger``: the ledger that folds the same stream's
    block events (a live fold, whose evictions and releases the ledger alone receives): the
    engine's evictions are taken from it; without one, feed them (:data:`REPLAY_EVENTS`)."""

    def __init__(self, *, engine: str = "", cached_at_first_admission: Optional[bool] = None,
                 ghost_factor: int = 4, bloom_bits: int = 1 << 23, hash_algorithm: str = "fast",
                 on_request: Optional[Callable[[RequestMisses], None]] = None,
                 ledger: Optional[BlockLedger] = None) -> None:
        self.first_admission = (engine.startswith("vllm") if cached_at_first_admission is None
                                else cached_at_first_admission)
        self.ghost_factor = ghost_factor
        self.bloom_bits = bloom_bits
        self.hash_algorithm = hash_algorithm
        self.on_request = on_request
        self.tally = MissTally()
        self.explained = ExplainedLog()
        self.block_size_tokens: Optional[int] = None
        self.capacity_blocks: Optional[int] = None
        self._reset_shadow()
        self._live: dict[str, _Live] = {}
        self._before_pool: Optional[list[Event]] = []
        self.errors = 0
        # the content the engine let go (module docstring): fed as events, or taken from
        # ``ledger`` (the live fold's, which folds those events itself) from the first store on
        self._recompute = EngineRecompute(ledger)
        K.warm_up_in_background()  # the shadow's kernels are loaded by the time requests arrive

    def set_engine(self, engine: str) -> None:
        """The engine's name (a log header's ``engine``): vLLM counts cached tokens at a
        request's first admission."""
        self.first_admission = (engine or "").startswith("vllm")

    def _reset_shadow(self) -> None:
        cap = self.capacity_blocks
        self._shadow = (None if cap is None else
                        Shadow(cap, self.ghost_factor * max(cap, 0), self.bloom_bits))

    # ------------------------------------------------------------------ feeding
    def feed(self, ev: Event) -> None:
        """Fold one event (others than requests, stores and the pool are ignored)."""
        t = type(ev)
        if t not in _WANTED:
            return
        try:
            if t is BlockStored:
                live = self._live.get(ev.request_id)
                if live is not None:
                    live.store_codes.append(self._recompute.stored(ev.block_id, ev.block_hash, ev.ts_ns,
                                                                   live.looked_up(ev.ts_ns)))
                    if live.content.token_ids is not None and ev.token_ids:
                        live.stored.append(ev.token_ids)
                    elif live.content.token_ids is None and ev.chunk_hashes is not None:
                        live.stored.append((int(ev.num_tokens), list(ev.chunk_hashes)))
                elif self._before_pool is not None and self.block_size_tokens is None:
                    self._buffer(ev)
                else:
                    self._recompute.stored(ev.block_id, ev.block_hash, ev.ts_ns)
            elif t is KVPoolInfo:
                self._pool(ev)
            elif self.block_size_tokens is None and self._before_pool is not None:
                self._buffer(ev)
            elif t is BlockEvicted or (t is BlockReleased and not ev.cached):  # content let go
                self._recompute.evicted(ev.block_id)
            elif t is RequestArrived:
                self._recompute.take_dropped()
                self._arrived(ev)
            elif t is RequestFinished:
                self._recompute.take_dropped()
                self._finished(ev)
            else:  # RequestScheduled, RequestPreempted, BlockDeduplicated
                live = self._live.get(ev.request_id)
                if live is not None and t is RequestPreempted:
                    live.preempted = True
                elif live is not None:  # looked up; or it adopted a stored block for one it filled
                    lookup = live.looked_up(ev.ts_ns)
                    if t is BlockDeduplicated:
                        live.store_codes.append(self._recompute.adopted(ev.block_hash, lookup))
        except Exception:  # one malformed event costs its own request, not the fold
            self.errors += 1
            if t is RequestFinished:  # its missed tokens still count, as unknown
                self._live.pop(ev.request_id, None)
                self._record(ev, None, [], None)

    def feed_all(self, events: Iterable[Event]) -> None:
        """:meth:`feed` each event (others than :data:`FOLD_EVENTS` passed over at once)."""
        feed, wanted = self.feed, _WANTED
        for ev in events:
            if type(ev) in wanted:
                feed(ev)

    def _buffer(self, ev: Event) -> None:
        self._before_pool.append(ev)
        if len(self._before_pool) > _MAX_BEFORE_POOL:  # no pool announced: stop waiting
            pending, self._before_pool = self._before_pool, None
            for e in pending:
                self.feed(e)

    def _pool(self, ev: KVPoolInfo) -> None:
        config = (int(ev.block_size_tokens), int(ev.num_blocks))
        if config != (self.block_size_tokens, self.capacity_blocks):
            if self.block_size_tokens is not None:  # another pool: a new engine, a new cache
                self._live.clear()
                self._recompute.clear()  # its block ids name other blocks
            self.block_size_tokens, self.capacity_blocks = config
            self._reset_shadow()
        pending, self._before_pool = self._before_pool or [], None
        for e in pending:
            self.feed(e)

    # ------------------------------------------------------------------ the shadow
    def _keys(self, content: Content) -> Optional[np.ndarray]:
        bs = self.block_size_tokens
        if bs is None or not content.can_key(bs):
            return None
        return content.keys(bs, algorithm=self.hash_algorithm)  # int64, contiguous; shared: read only

    def _arrived(self, ev: RequestArrived) -> None:
        if len(self._live) >= _MAX_LIVE:
            self._live.pop(next(iter(self._live)))
        content = Content.of_arrival(ev)
        keys = None if content is None else self._keys(content)
        if keys is None:
            return  # its misses are unknown
        domain = getattr(ev, "cache_domain", None)
        mask = domain_mask(domain) if domain else 0
        dkeys = keys ^ mask if mask else keys
        h, codes, dist, age = self._shadow.arrive(dkeys, keys, bool(mask), ev.ts_ns)
        if _EVICTED_CODE in codes:  # the shadow's outputs are its scratch: keep what is read
            dist, age = dist.copy(), age.copy()
        else:
            dist = age = None
        self._live[ev.request_id] = _Live(content, mask, codes, dist, age, h, keys, dkeys)

    def _finished(self, ev: RequestFinished) -> None:
        live = self._live.pop(ev.request_id, None)
        prompt = int(ev.prompt_tokens)
        cached = int(ev.cached_prompt_tokens)
        missed = max(prompt - cached, 0)
        tokens = [0] * len(CAUSES)
        evicted: list = []
        held_evicted = 0
        bs = self.block_size_tokens
        if live is None or bs is None:
            tokens[UNKNOWN] = missed
        else:
            full = prompt // bs
            h = live.hit_blocks
            start = min(cached, prompt)
            # the partial tail (and anything past the prompt the engine reported)
            tail_start = max(start, full * bs)
            tokens[BELOW_BLOCK] += prompt - tail_start
            codes = live.codes
            j = start // bs
            held_end = min(h, full)
            if j < held_end:  # blocks the shadow held
                held_evicted = self._held_missed(live, j, held_end, full, prompt, start, tokens, evicted)
                j = held_end
            while j < full:
                n = (j + 1) * bs - max(j * bs, start)
                if n == bs:  # whole blocks from here on: counted by code, evicted ones listed
                    lo = j - h
                    hi = max(lo, min(full - h, len(codes)))
                    part = codes[lo:hi]
                    for c in (COLD, EVICTED, HASH_DOMAIN):
                        tokens[c] += part.count(c) * bs
                    k = codes.find(_EVICTED_CODE, lo, hi)
                    while k >= 0:
                        evicted.append(live.evicted_figures(k) + (bs,))
                        k = codes.find(_EVICTED_CODE, k + 1, hi)
                    tokens[UNKNOWN] += (full - h - hi) * bs  # the arrival keyed fewer blocks
                    break
                if j - h < len(codes):
                    cause = codes[j - h]
                    if cause == EVICTED:
                        evicted.append(live.evicted_figures(j - h) + (n,))
                else:
                    cause = UNKNOWN
                tokens[cause] += n
                j += 1
            self._store_finished(live, ev.ts_ns)
        self._record(ev, tokens, evicted, None if live is None or bs is None else live.hit_blocks * bs,
                     held_evicted)

    def _held_missed(self, live: _Live, j: int, held_end: int, full: int, prompt: int, start: int,
                     tokens: list[int], evicted: list) -> int:
        """The causes of the missed tokens of blocks ``j .. held_end - 1``, which the shadow held
        (module docstring, cause 2; a block-aligned prompt's last block is ``below_block``);
        returns how many of them the engine had evicted."""
        bs = self.block_size_tokens
        if held_end == full and prompt % bs == 0:
            tokens[BELOW_BLOCK] += full * bs - max((full - 1) * bs, start)
            held_end -= 1
        if live.preempted and not self.first_admission:
            tokens[PREEMPTION] += max(held_end * bs - start, 0)
            return 0
        codes = live.store_codes  # its stores in order from block j (engine_recompute)
        held_evicted = 0
        for k in range(held_end - j):
            n = (j + k + 1) * bs - max((j + k) * bs, start)
            code = codes[k] if k < len(codes) else None
            if code == RESTORED_EVICTED:
                held_evicted += n
                evicted.append((None, None, n))
            elif code == NOT_HELD:
                tokens[IN_FLIGHT] += n
            else:
                tokens[ENGINE_SKIP] += n
        tokens[EVICTED] += held_evicted
        return held_evicted

    def _record(self, ev: RequestFinished, tokens: Optional[list[int]], evicted: list,
                shadow_hit_tokens: Optional[int], held_evicted: int = 0) -> None:
        """Count one finished request (``tokens`` None: all its missed tokens unknown)."""
        prompt, cached = int(ev.prompt_tokens), int(ev.cached_prompt_tokens)
        missed = max(prompt - cached, 0)
        if tokens is None:
            tokens = [0] * len(CAUSES)
            tokens[UNKNOWN] = missed
        explained = explained_tokens(tokens, held_evicted)
        if explained:
            self.explained.add(ev.ts_ns, explained)
        if self.on_request is None:  # the tally alone: no record to build
            self.tally.count(prompt, cached, missed, tokens, evicted, held_evicted)
            return
        rec = RequestMisses(ts_ns=ev.ts_ns, request_id=str(ev.request_id), prompt_tokens=prompt,
                            cached_prompt_tokens=cached, missed_tokens=missed, tokens=tuple(tokens),
                            evicted=tuple(evicted), status=ev.status, shadow_hit_tokens=shadow_hit_tokens,
                            held_evicted_tokens=held_evicted)
        self.tally.add(rec)
        self.on_request(rec)

    def _store_finished(self, live: _Live, now_ns: int) -> None:
        """Touch or insert the full blocks of the prompt and generated tokens (no lookup)."""
        content = live.content
        if not live.stored:  # no generated block stored: the prompt's blocks again
            self._shadow.touch(live.dkeys, live.keys, bool(live.mask), now_ns)
            return
        if content.token_ids is not None:
            seq = full_sequence(content.token_ids, live.stored)
            whole = Content(len(seq), token_ids=seq)
        else:
            keys, n = full_sequence_chunks(content.chunk_keys, content.num_tokens, live.stored)
            whole = Content(n, chunk_keys=keys)
        keys = self._keys(whole)
        if keys is None or not len(keys):
            return
        mask = live.mask
        self._shadow.touch(keys ^ mask if mask else keys, keys, bool(mask), now_ns)


FOLD_EVENTS = (KVPoolInfo, RequestArrived, RequestScheduled, RequestPreempted, BlockStored, BlockDeduplicated,
               RequestFinished)
"""The event types the fold reads, in the order ties in time are replayed."""
REPLAY_EVENTS = (*FOLD_EVENTS, BlockEvicted, BlockReleased)
"""What a replay of a log feeds the fold: its events and the content the engine let go (evicted,
or released uncached); a live fold takes those from its ledger."""
_WANTED = frozenset(REPLAY_EVENTS)
