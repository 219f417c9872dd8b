"""The miss-cause fold's shadow prefix cache: LRU at the engine's pool size over content keys in
their hash domain, the evicted keys' last use, then a Bloom filter of older evicted keys.

Its state is arrays and its loops are compiled (:mod:`kvdiag.simulation._misskernels`); the
fold (:class:`kvdiag.diagnosis.miss_causes.MissCauseFold`) reads from it, per block, whether it
was held, evicted (with its reuse distance in block references and time since last use) or
never seen.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np

from kvdiag.simulation import _misskernels as K
from kvdiag.events.schema import MASK63


def domain_mask(domain: Optional[str]) -> int:
    """The 63-bit mask that moves a content key into ``domain`` (0: the default domain)."""
    if not domain:
        return 0
    return int.from_bytes(hashlib.blake2b(domain.encode(), digest_size=8).digest(), "little") & MASK63


_M64 = 0xFFFFFFFFFFFFFFFF


class Bloom:
    """A fixed-size Bloom filter of 64-bit keys, 3 probes (bit ``((key * P) mod 2^64 >> 32)
    mod bits`` for three multipliers P: the key is already a hash; ``bits`` rounded up to a
    whole byte). False positives: under 1% up to ~0.08 x ``bits`` keys (0.68 M keys in the
    default 2^23 bits, 1 MiB). Its bits (``a``) are the shadow kernels' filter."""

    def __init__(self, bits: int) -> None:
        self.a = np.zeros((max(64, int(bits)) + 7) // 8, np.uint8)
        self.bits = 8 * len(self.a)

    def add(self, key: int) -> None:
        K.bloom_add(self.a, _i64(key))

    def __contains__(self, key: int) -> bool:
        return bool(K.bloom_has(self.a, _i64(key)))


def _i64(key: int) -> int:
    """A 64-bit key as a signed int64 value (the same bits)."""
    key &= _M64
    return key - (1 << 64) if key >> 63 else key


class Shadow:
    """The shadow prefix cache: LRU at ``capacity_blocks`` entries (keys in their domain), the
    last ``history_keys`` evicted keys with their tick and time of last use, the older ones in
    a Bloom filter, and a block-reference clock (``tick``). State in arrays, loops compiled
    (:mod:`kvdiag.simulation._misskernels`)."""

    def __init__(self, capacity_blocks: int, history_keys: int, bloom_bits: int) -> None:
        self.capacity_blocks = int(capacity_blocks)
        self.history_keys = max(int(history_keys), 0)
        self.bloom = Bloom(bloom_bits)
        self._max_nodes = max(self.capacity_blocks, 0) + self.history_keys + 1
        self.state = K.new_state(min(self._max_nodes, 1024), 8)
        self.state["bloom"] = self.bloom.a
        self._full_size = len(self.state["nodes"]) >= self._max_nodes  # never grows again
        self._arrays = self._state_arrays()
        self._scratch = (np.empty(0, np.int8), np.empty(0, np.int64), np.empty(0, np.int64))

    def _state_arrays(self) -> tuple:
        st = self.state
        return st["nodes"], st["table"], st["domains"], st["meta"], st["bloom"]

    @property
    def tick(self) -> int:
        return int(self.state["meta"][K.M_TICK])

    def __len__(self) -> int:
        """Blocks held."""
        return int(self.state["meta"][K.M_CLEN])

    @property
    def history_len(self) -> int:
        """Evicted keys remembered with their last use."""
        return int(self.state["meta"][K.M_GLEN])

    def arrive(self, dkeys: np.ndarray, keys: np.ndarray, masked: bool, now_ns: int):
        """A prompt's lookup then its touches: (h, codes, distances, ages) of blocks ``h..``
        (:func:`_misskernels.arrive`)."""
        n = len(dkeys)
        nodes, table, domains, meta, bloom = self._room(n)
        codes, dist, age = self._scratch
        if len(codes) < n:  # the kernel's outputs, reused (the caller keeps copies)
            size = max(n, 2 * len(codes), 256)
            codes, dist, age = self._scratch = (np.empty(size, np.int8), np.empty(size, np.int64),
                                                np.empty(size, np.int64))
        h = K.arrive(nodes, table, domains, meta, bloom, dkeys, keys, masked, now_ns,
                     self.capacity_blocks, self.history_keys, codes, dist, age)
        return h, codes[:n - h].tobytes(), dist[:n - h], age[:n - h]

    def touch(self, dkeys: np.ndarray, keys: np.ndarray, masked: bool, now_ns: int) -> None:
        """Touch or insert each block in order (:func:`_misskernels.touch`)."""
        if self.capacity_blocks <= 0:
            self.state["meta"][K.M_TICK] += len(dkeys)
            return
        nodes, table, domains, meta, bloom = self._room(len(dkeys))
        K.touch(nodes, table, domains, meta, bloom, dkeys, keys, masked, now_ns, self.capacity_blocks,
                self.history_keys)

    def _room(self, n: int) -> tuple:
        """The state's arrays (nodes, table, domains, meta, bloom), grown to hold ``n`` more
        nodes where they could not."""
        if self._full_size:
            return self._arrays
        st = self.state
        meta = st["meta"]
        need = min(int(meta[K.M_CLEN] + meta[K.M_GLEN]) + n + 1, self._max_nodes)
        size = len(st["nodes"])
        if need > size:
            st = self.state = K.grow_state(st, min(max(need, 2 * size), self._max_nodes))
            self._full_size = len(st["nodes"]) >= self._max_nodes
            self._arrays = self._state_arrays()
        return self._arrays
