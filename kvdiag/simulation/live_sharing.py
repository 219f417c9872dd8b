"""Live shadow prefix sharing: a Sink that replays arriving prompts through what-if caches.

Fed the engine adapter's events, it re-chunks every ``RequestArrived.token_ids`` (or, in a
hashes-mode recording, every ``RequestArrived.chunk_hashes``: block sizes that are multiples of
their chunk only) at each configured block size, replays the request through one shadow :class:`PrefixCacheSim` per
(policy, block size, capacity) — exactly the offline simulator, one request at a time — and
every ``interval_s`` in which requests arrived or finished (and whenever the last request in
flight finished) records one ``ShadowSharing`` event per configuration into ``out``.
When a request finishes, the full blocks of its prompt and generated tokens (from the
adapter's ``BlockStored`` token ids or chunk hashes) are touched or inserted, as engines cache both.

A request's hits are its leading full blocks found in the cache, as in the offline simulator.
Engines always compute the last prompt token (its logits give the first output token): for a
fully cached prompt whose length is a multiple of the block size they recompute its last
block, one block fewer than the shadow counts.

Each event also carries ``engine_hit_rate``: the engine's own token hit rate
(:mod:`kvdiag.pool.hit_rate`: cached / prompt tokens of requests that finished normally). Compared with the
shadow token hit rate at the engine's own settings (LRU, its page size, its pool's block
count; added automatically when ``KVPoolInfo`` arrives), a gap shows prefix sharing that the
content allows but the engine did not deliver (a silent prefix-cache failure), or the other
way round. With requests that overlap in time the engine can also miss blocks that are not
complete yet.

Same population: ``token_hit_rate`` counts requests at arrival, the engine at finish. The
comparison uses the ``finished_*`` counters instead: each request's shadow hits are kept from
its arrival and counted, with the engine's cached tokens of the same request, when it finishes
normally. :func:`sharing_window` compares two events' counters: the requests that finished
between them, on both sides. The sink records one event per configuration as soon as it
starts (all counters zero) and when the engine's configuration is added, so a log recorded
from the start has its baseline; a client that joins later takes the latest events at join
time (the agent's socket sends them first) as its baseline.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np

from kvdiag.simulation.sharing import PrefixCacheSim
from kvdiag.traces.kvdiag_logs import full_sequence
from kvdiag.pool.hit_rate import counts_toward_hit_rate, engine_token_hit_rate
from kvdiag.pool.hashing import Content, full_sequence_chunks
from kvdiag.events.schema import (
    BlockStored,
    Event,
    KVPoolInfo,
    RequestArrived,
    RequestFinished,
    ShadowSharing,
)
from kvdiag.events.sinks import NullSink, Sink


_MAX_BEFORE_POOL = 1024


def headline_config(keys: Iterable[tuple], block_size_tokens: Optional[int],
                    num_blocks: Optional[int]) -> tuple:
    """Of the shadow configurations ``keys`` (policy, block size, capacity or None), the one
    closest to the engine's own: same block size, capacity equal to the engine's pool (else
    unbounded, else the largest), LRU preferred. Its hit rate is what the content allows."""
    def score(key: tuple) -> tuple:
        policy, block_size, capacity = key
        return (block_size == block_size_tokens, capacity == num_blocks, capacity is None,
                capacity or 0, policy.lower() == "lru", policy)
    return max(keys, key=score)


@dataclass(frozen=True)
class SharingWindow:
    """Engine and shadow over the same requests: those that finished normally between two
    ``ShadowSharing`` events of one configuration (``start_ns`` excluded, ``end_ns``
    included). Hit rates are hit (or cached) prompt tokens / prompt tokens of those requests."""

    start_ns: int
    end_ns: int
    requests: int
    prompt_tokens: int
    shadow_hit_tokens: int
    engine_cached_tokens: int

    @property
    def shadow_hit_rate(self) -> Optional[float]:
        return self.shadow_hit_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def engine_hit_rate(self) -> Optional[float]:
        return engine_token_hit_rate(self.prompt_tokens, self.engine_cached_tokens)

    @property
    def gap(self) -> Optional[float]:
        """Shadow minus engine hit rate (None without prompt tokens)."""
        if not self.prompt_tokens:
            return None
        return (self.shadow_hit_tokens - self.engine_cached_tokens) / self.prompt_tokens


def sharing_window(baseline: Optional[ShadowSharing], latest: ShadowSharing) -> Optional[SharingWindow]:
    """The requests that finished between ``baseline`` (None: the shadow's start) and
    ``latest``, two events of one configuration; None when ``latest`` has no ``finished_*``
    counters (a log older than schema 1.6) or the counters went back (the shadow restarted:
    the window then starts at ``latest``'s start, unknown)."""
    def counts(ev: Optional[ShadowSharing]) -> Optional[tuple[int, int, int, int]]:
        if ev is None:
            return (0, 0, 0, 0)
        c = (ev.finished_requests, ev.finished_prompt_tokens, ev.finished_hit_tokens,
             ev.finished_engine_cached_tokens)
        return None if any(v is None for v in c) else c  # type: ignore[return-value]
    now, then = counts(latest), counts(baseline)
    if now is None:
        return None
    if then is None or any(a < b for a, b in zip(now, then)):
        return None
    d = [a - b for a, b in zip(now, then)]
    return SharingWindow(start_ns=baseline.ts_ns if baseline is not None else 0, end_ns=latest.ts_ns,
                         requests=d[0], prompt_tokens=d[1], shadow_hit_tokens=d[2], engine_cached_tokens=d[3])


@dataclass(frozen=True)
class ShadowConfig:
    """One what-if cache: policy (not ``opt``: the future is unknown live), block size in
    tokens, capacity in blocks (None = unbounded)."""

    policy: str
    block_size_tokens: int
    capacity_blocks: Optional[int] = None


@dataclass
class _Counts:
    requests: int = 0
    block_refs: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    request_rate_sum: float = 0.0
    requests_with_prompt: int = 0
    # the requests that finished normally, whose arrival this cache counted
    finished_requests: int = 0
    finished_prompt_tokens: int = 0
    finished_hit_tokens: int = 0
    finished_engine_cached_tokens: int = 0


class ShadowSharingSink:
    """A Sink (``record``/``flush``) that turns arriving prompts into ``ShadowSharing`` events.

    ``engine_settings=True`` adds the engine's own configuration (LRU, its page size, its
    pool's ``num_blocks``) when a ``KVPoolInfo`` event arrives.
    """

    def __init__(self, configs: Iterable[ShadowConfig] = (), out: Optional[Sink] = None, *,
                 interval_s: float = 1.0, engine_settings: bool = True,
                 bytes_per_token: Optional[int] = None, hash_algorithm: str = "fast",
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.out: Sink = out if out is not None else NullSink()
        self.interval_ns = int(interval_s * 1e9)
        self.engine_settings = engine_settings
        self.bytes_per_token = bytes_per_token
        self.hash_algorithm = hash_algorithm
        self.clock = clock
        self.engine_config: Optional[ShadowConfig] = None
        self._sims: dict[ShadowConfig, PrefixCacheSim] = {}
        self._counts: dict[ShadowConfig, _Counts] = {}
        self._ids: dict[int, dict[int, int]] = {}  # block size -> chained key -> dense id
        # live request -> prompt, stored blocks, its hit tokens per cache (counted at arrival)
        # request -> (prompt, its stored blocks' token ids or (tokens, chunk hashes), hits)
        self._live: dict[str, tuple[Content, list, dict[ShadowConfig, int]]] = {}
        self._engine_cached_tokens = 0
        self._engine_prompt_tokens = 0
        self._last_emit_ns = clock()
        self._emitted = False  # the first event recorded starts the counters' baseline
        self._changed = False  # counters moved since the last results (an idle engine: no repeats)
        # what arrived and finished before the engine's pool was announced, replayed into the
        # engine-settings cache when it is (the pool is created with the first request)
        self._before_pool: Optional[list[tuple[bool, Content, str]]] = [] if engine_settings else None
        self.errors = 0
        self._lock = threading.Lock()
        for cfg in configs:
            self.add(cfg)

    def add(self, cfg: ShadowConfig) -> None:
        """Start a what-if cache (it sees requests from now on)."""
        if cfg not in self._sims:
            self._sims[cfg] = PrefixCacheSim(cfg.policy, cfg.capacity_blocks)
            self._counts[cfg] = _Counts()
            self._ids.setdefault(cfg.block_size_tokens, {})

    # ------------------------------------------------------------------ Sink
    def record(self, event: Event) -> None:
        # engines emit from several threads (HTTP handlers add requests, the generation loop
        # announces the pool and finishes them): one event at a time
        with self._lock:
            self._record(event)

    def _record(self, event: Event) -> None:
        try:
            added = False
            prompt = Content.of_arrival(event) if isinstance(event, RequestArrived) else None
            if prompt is not None:
                hits = self._arrived(prompt)
                self._remember_before_pool(True, prompt, event.request_id)
                self._live[event.request_id] = (prompt, [], hits)
            elif isinstance(event, BlockStored):
                live = self._live.get(event.request_id)
                if live is not None and live[0].token_ids is not None and event.token_ids:
                    live[1].append(event.token_ids)
                elif live is not None and live[0].token_ids is None and event.chunk_hashes is not None:
                    live[1].append((int(event.num_tokens), list(event.chunk_hashes)))
            elif isinstance(event, RequestFinished):
                if counts_toward_hit_rate(event.status):
                    self._engine_cached_tokens += event.cached_prompt_tokens
                    self._engine_prompt_tokens += event.prompt_tokens
                live = self._live.pop(event.request_id, None)
                if live is not None:
                    prompt, stored, hits = live
                    if counts_toward_hit_rate(event.status):
                        self._count_finished(event, hits)
                    if prompt.token_ids is not None:
                        seq = full_sequence(prompt.token_ids, stored)
                        tokens = Content(len(seq), token_ids=seq)
                    else:
                        keys, n = full_sequence_chunks(prompt.chunk_keys, prompt.num_tokens, stored)
                        tokens = Content(n, chunk_keys=keys)
                    self._finished(tokens)
                    self._remember_before_pool(False, tokens, event.request_id)
            elif isinstance(event, KVPoolInfo):
                if self.bytes_per_token is None and event.block_size_tokens:
                    self.bytes_per_token = event.block_bytes // event.block_size_tokens
                # also with the engine's prefix cache off: the content's hits at its settings
                # are then exactly what the engine leaves on the table
                if self.engine_settings:
                    self.engine_config = ShadowConfig("lru", event.block_size_tokens,
                                                      event.num_blocks)
                    added = self.engine_config not in self._sims
                    self.add(self.engine_config)
                    for arrived, tokens, rid in self._before_pool or ():
                        if arrived:
                            h = self._arrived(tokens, only=self.engine_config)
                            if rid in self._live:
                                self._live[rid][2].update(h)
                        else:
                            self._finished(tokens, only=self.engine_config)
                self._before_pool = None
            now = self.clock()
            drained = isinstance(event, RequestFinished) and not self._live
            # at the start (the counters' baseline), when the engine's cache is added, every
            # interval, and whenever the last live request finished
            if isinstance(event, (RequestArrived, RequestFinished)):
                self._changed = True
            if (not self._emitted or added or drained
                    or (self._changed and now - self._last_emit_ns >= self.interval_ns)):
                self._emit(now)
        except Exception:  # a shadow analysis never breaks the observed process
            self.errors += 1

    def flush(self) -> None:
        with self._lock:
            self._emit(self.clock())
        self.out.flush()

    # ------------------------------------------------------------------ internals
    def _count_finished(self, event: RequestFinished, hits: dict) -> None:
        """A request that finished normally: its prompt, the hits each cache counted at its
        arrival and the engine's cached tokens, on every cache that counted its arrival."""
        for cfg, h in hits.items():
            c = self._counts[cfg]
            c.finished_requests += 1
            c.finished_prompt_tokens += event.prompt_tokens
            c.finished_hit_tokens += h
            c.finished_engine_cached_tokens += event.cached_prompt_tokens

    def _remember_before_pool(self, arrived: bool, tokens: Content, request_id: str) -> None:
        if self._before_pool is not None:
            self._before_pool.append((arrived, tokens, request_id))
            if len(self._before_pool) > _MAX_BEFORE_POOL:  # no pool announced: stop waiting
                self._before_pool = None

    def _selected(self, only: Optional[ShadowConfig]):
        return self._sims.items() if only is None else [(only, self._sims[only])]

    def _arrived(self, content: Content, only: Optional[ShadowConfig] = None) -> dict[ShadowConfig, int]:
        """Look the prompt up in each cache (then insert it); returns its hit tokens per cache.
        Caches whose block size the content cannot be chunked at (hashes) are left out."""
        prompt = content.num_tokens
        out: dict[ShadowConfig, int] = {}
        by_size = {bs: self._dense(content, bs) for bs in self._ids if content.can_key(bs)}
        offsets = np.zeros(2, dtype=np.int64)
        hits = np.zeros(1, dtype=np.int64)
        for cfg, sim in self._selected(only):
            if cfg.block_size_tokens not in by_size:
                continue
            ids = by_size[cfg.block_size_tokens]
            offsets[1] = len(ids)
            sim.feed(ids, offsets, hits, 0, 1)
            c = self._counts[cfg]
            h = int(hits[0])
            c.requests += 1
            c.block_refs += len(ids)
            c.hit_blocks += h
            c.hit_tokens += h * cfg.block_size_tokens  # only full blocks have keys
            c.prompt_tokens += prompt
            if prompt:
                c.requests_with_prompt += 1
                c.request_rate_sum += h * cfg.block_size_tokens / prompt
            out[cfg] = h * cfg.block_size_tokens
        return out

    def _finished(self, content: Content, only: Optional[ShadowConfig] = None) -> None:
        """Touch or insert the full blocks of a finished request's prompt and generated tokens
        (engines cache both); no lookup, nothing counted."""
        offsets = np.zeros(2, dtype=np.int64)
        hits = np.zeros(1, dtype=np.int64)
        ids = {bs: self._dense(content, bs) for bs in self._ids if content.can_key(bs)}
        for cfg, sim in self._selected(only):
            if cfg.block_size_tokens not in ids:
                continue
            offsets[1] = len(ids[cfg.block_size_tokens])
            sim.feed(ids[cfg.block_size_tokens], offsets, hits, 0, 1)

    def _dense(self, content: Content, bs: int) -> np.ndarray:
        table = self._ids[bs]
        keys = content.keys(bs, algorithm=self.hash_algorithm).tolist()
        return np.fromiter((table.setdefault(k, len(table)) for k in keys), dtype=np.int32,
                           count=len(keys))

    @property
    def engine_hit_rate(self) -> Optional[float]:
        """Engine's token hit rate: cached prompt tokens / prompt tokens of finished requests."""
        return engine_token_hit_rate(self._engine_prompt_tokens, self._engine_cached_tokens)

    def snapshot(self, ts_ns: Optional[int] = None) -> list[ShadowSharing]:
        """One ``ShadowSharing`` per configuration, over all requests seen so far."""
        ts = self.clock() if ts_ns is None else ts_ns
        out = []
        for cfg, c in self._counts.items():
            out.append(ShadowSharing(
                ts_ns=ts, policy=cfg.policy, block_size_tokens=cfg.block_size_tokens,
                capacity_blocks=cfg.capacity_blocks, requests=c.requests,
                block_hit_rate=c.hit_blocks / c.block_refs if c.block_refs else 0.0,
                token_hit_rate=c.hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
                request_hit_rate=(c.request_rate_sum / c.requests_with_prompt
                                  if c.requests_with_prompt else None),
                bytes_saved=(c.hit_tokens * self.bytes_per_token
                             if self.bytes_per_token else None),
                engine_hit_rate=self.engine_hit_rate, finished_requests=c.finished_requests,
                finished_prompt_tokens=c.finished_prompt_tokens, finished_hit_tokens=c.finished_hit_tokens,
                finished_engine_cached_tokens=c.finished_engine_cached_tokens))
        return out

    def gap(self) -> Optional[float]:
        """Shadow token hit rate at the engine's own settings minus the engine's hit rate, over
        the same requests (those finished normally since the engine's cache was added)."""
        if self.engine_config is None:
            return None
        c = self._counts[self.engine_config]
        if not c.finished_prompt_tokens:
            return None
        return (c.finished_hit_tokens - c.finished_engine_cached_tokens) / c.finished_prompt_tokens

    def _emit(self, now: int) -> None:
        self._last_emit_ns = now
        self._emitted = True
        self._changed = False
        for ev in self.snapshot(now):
            self.out.record(ev)
