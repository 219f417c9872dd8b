"""Live shadow prefix sharing: a Sink that replays arriving prompts through what-if caches.

Fed the engine adapter's events, it re-chunks every ``RequestArrived.token_ids`` at each
configured block size, replays the request through one shadow :class:`PrefixCacheSim` per
(policy, block size, capacity) — exactly the offline simulator, one request at a time — and
every ``interval_s`` (and whenever the last request in flight finished) records one
``ShadowSharing`` event per configuration into ``out``.
When a request finishes, the full blocks of its prompt and generated tokens (from the
adapter's ``BlockStored`` token ids) are touched or inserted, as engines cache both.

A request's hits are its leading full blocks found in the cache, as in the offline simulator.
Engines always compute the last prompt token (its logits give the first output token): for a
fully cached prompt whose length is a multiple of the block size they recompute its last
block, one block fewer than the shadow counts.

Each event also carries ``engine_hit_rate``: the engine's own token hit rate, sum of
``RequestFinished.cached_prompt_tokens`` / sum of their ``prompt_tokens``. Compared with the
shadow token hit rate at the engine's own settings (LRU, its page size, its pool's block
count; added automatically when ``KVPoolInfo`` arrives), a gap shows prefix sharing that the
content allows but the engine did not deliver (a silent prefix-cache failure), or the other
way round. Shadow rates count requests at arrival, the engine's at finish; with requests that
overlap in time the engine can also miss blocks that are not complete yet.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np

from kvdiag.analysis.sharing import PrefixCacheSim
from kvdiag.analysis.traces import full_sequence
from kvdiag.kernels.hashing import chunk_hashes
from kvdiag.schema import (
    BlockStored,
    Event,
    KVPoolInfo,
    RequestArrived,
    RequestFinished,
    ShadowSharing,
)
from kvdiag.sinks import NullSink, Sink


_MAX_BEFORE_POOL = 1024


def engine_token_hit_rate(prompt_tokens: float, cached_prompt_tokens: float,
                          metrics_queries_tokens: Optional[float] = None,
                          metrics_hits_tokens: Optional[float] = None) -> Optional[float]:
    """The engine's own prefix hit rate: cached prompt tokens / prompt tokens of requests that
    finished normally; without them, its metrics' hit / query token counters; else None."""
    if prompt_tokens:
        return cached_prompt_tokens / prompt_tokens
    if metrics_queries_tokens:
        return (metrics_hits_tokens or 0.0) / metrics_queries_tokens
    return None


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
        self._live: dict[str, tuple[list[int], list[list[int]]]] = {}  # prompt, stored blocks
        self._engine_cached_tokens = 0
        self._engine_prompt_tokens = 0
        self._last_emit_ns = clock()
        # what arrived and finished before the engine's pool was announced, replayed into the
        # engine-settings cache when it is (the pool is created with the first request)
        self._before_pool: Optional[list[tuple[bool, list[int]]]] = [] if engine_settings else None
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
            if isinstance(event, RequestArrived) and event.token_ids is not None:
                self._arrived(event.token_ids)
                self._remember_before_pool(True, list(event.token_ids))
                self._live[event.request_id] = (list(event.token_ids), [])
            elif isinstance(event, BlockStored):
                if event.request_id in self._live and event.token_ids:
                    self._live[event.request_id][1].append(event.token_ids)
            elif isinstance(event, RequestFinished):
                self._engine_cached_tokens += event.cached_prompt_tokens
                self._engine_prompt_tokens += event.prompt_tokens
                live = self._live.pop(event.request_id, None)
                if live is not None:
                    tokens = full_sequence(*live)
                    self._finished(tokens)
                    self._remember_before_pool(False, tokens)
            elif isinstance(event, KVPoolInfo):
                if self.bytes_per_token is None and event.block_size_tokens:
                    self.bytes_per_token = event.block_bytes // event.block_size_tokens
                # also with the engine's prefix cache off: the content's hits at its settings
                # are then exactly what the engine leaves on the table
                if self.engine_settings:
                    self.engine_config = ShadowConfig("lru", event.block_size_tokens,
                                                      event.num_blocks)
                    self.add(self.engine_config)
                    for arrived, tokens in self._before_pool or ():
                        (self._arrived if arrived else self._finished)(tokens, only=self.engine_config)
                self._before_pool = None
            now = self.clock()
            drained = isinstance(event, RequestFinished) and not self._live
            # every interval, and whenever the last live request finished: then shadow (counted
            # at arrival) and engine (counted at finish) cover the same requests
            if drained or now - self._last_emit_ns >= self.interval_ns:
                self._emit(now)
        except Exception:  # a shadow analysis never breaks the observed process
            self.errors += 1

    def flush(self) -> None:
        with self._lock:
            self._emit(self.clock())
        self.out.flush()

    # ------------------------------------------------------------------ internals
    def _remember_before_pool(self, arrived: bool, tokens: list[int]) -> None:
        if self._before_pool is not None:
            self._before_pool.append((arrived, tokens))
            if len(self._before_pool) > _MAX_BEFORE_POOL:  # no pool announced: stop waiting
                self._before_pool = None

    def _selected(self, only: Optional[ShadowConfig]):
        return self._sims.items() if only is None else [(only, self._sims[only])]

    def _arrived(self, token_ids: list[int], only: Optional[ShadowConfig] = None) -> None:
        prompt = len(token_ids)
        by_size = {bs: self._dense(token_ids, bs) for bs in self._ids}
        offsets = np.zeros(2, dtype=np.int64)
        hits = np.zeros(1, dtype=np.int64)
        for cfg, sim in self._selected(only):
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

    def _finished(self, tokens: list[int], only: Optional[ShadowConfig] = None) -> None:
        """Touch or insert the full blocks of a finished request's prompt and generated tokens
        (engines cache both); no lookup, nothing counted."""
        offsets = np.zeros(2, dtype=np.int64)
        hits = np.zeros(1, dtype=np.int64)
        ids = {bs: self._dense(tokens, bs) for bs in self._ids}
        for cfg, sim in self._selected(only):
            offsets[1] = len(ids[cfg.block_size_tokens])
            sim.feed(ids[cfg.block_size_tokens], offsets, hits, 0, 1)

    def _dense(self, tokens: list[int], bs: int) -> np.ndarray:
        table = self._ids[bs]
        keys = chunk_hashes(tokens, bs, algorithm=self.hash_algorithm).tolist()
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
                engine_hit_rate=self.engine_hit_rate))
        return out

    def gap(self) -> Optional[float]:
        """Shadow token hit rate at the engine's own settings minus the engine's hit rate."""
        if self.engine_config is None or self.engine_hit_rate is None:
            return None
        c = self._counts[self.engine_config]
        shadow = c.hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0
        return shadow - self.engine_hit_rate

    def _emit(self, now: int) -> None:
        self._last_emit_ns = now
        for ev in self.snapshot(now):
            self.out.record(ev)
