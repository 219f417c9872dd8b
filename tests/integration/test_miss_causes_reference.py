"""The miss-cause fold's compiled shadow (kvdiag.simulation._misskernels) against a plain-Python
reference of the same definition (an OrderedDict LRU, an OrderedDict of evicted keys, a set for
the keys that fell off it): every request's causes, evicted blocks' reuse distances and ages
and shadow hits equal, on constructed streams (small pools, hash domains, keys falling off the
history, a pool change) and on every recorded fixture log with finished requests."""

from __future__ import annotations

import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from kvdiag.simulation._misskernels import M_BLOOM_ADDED
from kvdiag.diagnosis.miss_causes import MissCauseFold
from kvdiag.diagnosis.miss_tally import COLD, EVICTED, HASH_DOMAIN
from kvdiag.events.eventlog import iter_events, read_header
from kvdiag.events.schema import (BlockStored, KVPoolInfo, RequestArrived, RequestFinished,
                           RequestPreempted)

DATA = Path(__file__).parent.parent / "data"
LOGS = sorted(p for p in DATA.rglob("*.kvlog*") if p.suffix in (".kvlog", ".gz"))


class RefShadow:
    """The shadow as the fold defines it, one Python step per block."""

    def __init__(self, capacity_blocks: int, history_keys: int, bloom_bits: int) -> None:
        self.cap, self.ghost_cap = capacity_blocks, history_keys
        self.cache: OrderedDict[int, tuple[int, int, int]] = OrderedDict()  # key: plain, tick, ns
        self.domain_plain: dict[int, int] = {}  # plain key: entries held under another domain
        self.ghost: OrderedDict[int, tuple[int, int]] = OrderedDict()  # evicted key: tick, ns
        self.fell_off: set[int] = set()
        self.tick = 0

    def __len__(self) -> int:
        return len(self.cache)

    @property
    def history_len(self) -> int:
        return len(self.ghost)

    def classify(self, dkeys, keys, masked, now_ns):
        dkeys, keys = dkeys.tolist(), keys.tolist()
        h = 0
        while h < len(dkeys) and dkeys[h] in self.cache:
            h += 1
        codes, dist, age = [], [], []
        brk = (-1, -1)
        for j in range(h, len(dkeys)):
            d = dkeys[j]
            if d in self.cache:  # held, but its prefix broke before it
                codes.append(EVICTED)
                dist.append(brk[0])
                age.append(brk[1])
                continue
            info = (-1, -1)
            if d in self.ghost:
                tick, ns = self.ghost[d]
                info = (self.tick - tick, max(now_ns - ns, 0))
                codes.append(EVICTED)
            elif d in self.fell_off:
                codes.append(EVICTED)
            elif (masked and keys[j] in self.cache) or self.domain_plain.get(keys[j], 0) > 0:
                codes.append(HASH_DOMAIN)
            else:
                codes.append(COLD)
            dist.append(info[0])
            age.append(info[1])
            if j == h and codes[-1] == EVICTED:
                brk = info
        return h, bytes(codes), np.array(dist, np.int64), np.array(age, np.int64)

    def arrive(self, dkeys, keys, masked, now_ns):
        out = self.classify(dkeys, keys, masked, now_ns)
        self.touch(dkeys, keys, masked, now_ns)
        return out

    def touch(self, dkeys, keys, masked, now_ns) -> None:
        for d, k in zip(dkeys.tolist(), keys.tolist()):
            self.tick += 1
            if self.cap <= 0:
                continue
            if d in self.cache:
                self.cache.move_to_end(d)
                self.cache[d] = (k, self.tick, now_ns)
                continue
            while len(self.cache) >= self.cap:
                old, (oplain, otick, ons) = self.cache.popitem(last=False)
                if old != oplain:
                    self.domain_plain[oplain] -= 1
                    if not self.domain_plain[oplain]:
                        del self.domain_plain[oplain]
                self.ghost[old] = (otick, ons)
                if len(self.ghost) > self.ghost_cap:
                    self.fell_off.add(self.ghost.popitem(last=False)[0])
            self.ghost.pop(d, None)
            self.cache[d] = (k, self.tick, now_ns)
            if masked:
                self.domain_plain[k] = self.domain_plain.get(k, 0) + 1


class RefFold(MissCauseFold):
    def _reset_shadow(self) -> None:
        cap = self.capacity_blocks
        self._shadow = None if cap is None else RefShadow(cap, self.ghost_factor * max(cap, 0), 0)


def _requests(fold_cls, events, **kw):
    out = []
    fold = fold_cls(on_request=out.append, **kw)
    fold.feed_all(events)
    assert not fold.errors
    return out, fold


def _same(events, **kw) -> int:
    got, fold = _requests(MissCauseFold, events, **kw)
    want, ref = _requests(RefFold, events, **kw)
    assert got == want
    assert (len(fold._shadow), fold._shadow.history_len, fold._shadow.tick) == (
        len(ref._shadow), ref._shadow.history_len, ref._shadow.tick)
    return len(got)


def _pool(t, block_size, blocks):
    return KVPoolInfo(ts_ns=t, num_blocks=blocks, block_size_tokens=block_size, block_bytes=64,
                      num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", prefix_sharing=True)


def constructed(seed: int, n: int = 400):
    """Requests over a few shared prefixes, some salted, some preempted, some with generated
    blocks stored; a pool change half way (a new shadow)."""
    rnd = random.Random(seed)
    bs = rnd.choice((2, 4))
    prefixes = [[rnd.randrange(40) for _ in range(rnd.randrange(2, 24))] for _ in range(12)]
    events, live, t = [_pool(1, bs, rnd.choice((0, 3, 8, 40)))], [], 10
    for i in range(n):
        t += rnd.randrange(1, 50)
        if i == n // 2:
            events.append(_pool(t, bs, rnd.choice((5, 17))))
        if live and (rnd.random() < 0.45 or i > n - 10):
            rid, toks = live.pop(rnd.randrange(len(live)))
            if rnd.random() < 0.15:
                events.append(RequestPreempted(ts_ns=t, request_id=rid))
            if rnd.random() < 0.5:
                events.append(BlockStored(ts_ns=t, block_id=i, block_hash=i, num_tokens=bs, request_id=rid,
                                          token_ids=[rnd.randrange(40) for _ in range(bs)]))
            cached = rnd.randrange(0, len(toks) + 1)
            events.append(RequestFinished(ts_ns=t + 1, request_id=rid, prompt_tokens=len(toks),
                                          output_tokens=1, cached_prompt_tokens=cached))
        else:
            toks = rnd.choice(prefixes) + [rnd.randrange(40) for _ in range(rnd.randrange(9))]
            rid = f"r{i}"
            events.append(RequestArrived(ts_ns=t, request_id=rid, prompt_tokens=len(toks), token_ids=toks,
                                         cache_domain=rnd.choice((None, None, None, "s1", "s2"))))
            live.append((rid, toks))
    return events


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("ghost_factor", (0, 1, 4))
def test_constructed_streams_equal_the_reference(seed, ghost_factor):
    assert _same(constructed(seed), ghost_factor=ghost_factor, engine="transformers") > 100


def test_a_long_stream_with_keys_falling_off_the_history_equals_the_reference():
    rnd = random.Random(7)
    prefixes = [[rnd.getrandbits(63) for _ in range(rnd.randrange(1, 40))] for _ in range(50)]
    events, t = [_pool(1, 16, 64)], 10
    for i in range(600):
        keys = rnd.choice(prefixes)[:rnd.randrange(1, 41)] + [rnd.getrandbits(63) for _ in range(rnd.randrange(20))]
        events += [RequestArrived(ts_ns=t, request_id=f"r{i}", prompt_tokens=16 * len(keys) + 3,
                                  chunk_hashes=keys, partial_tokens=3),
                   RequestFinished(ts_ns=t + 5, request_id=f"r{i}", prompt_tokens=16 * len(keys) + 3,
                                   output_tokens=1, cached_prompt_tokens=16 * rnd.randrange(3))]
        t += 10
    got, fold = _requests(MissCauseFold, events, ghost_factor=1)
    assert fold._shadow.state["meta"][M_BLOOM_ADDED] > 1000  # many keys fell off the history
    assert any(r.evicted and r.evicted[0][0] is None for r in got)
    assert _same(events, ghost_factor=1) == 600


@pytest.mark.parametrize("path", LOGS, ids=lambda p: str(p.relative_to(DATA)))
def test_recorded_logs_equal_the_reference(path):
    events = list(iter_events(path))
    if not any(isinstance(e, RequestFinished) for e in events):
        pytest.skip("no finished requests")
    engine = read_header(path).engine or ""
    for ghost_factor in (4, 0):
        _same(events, engine=engine, ghost_factor=ghost_factor)
