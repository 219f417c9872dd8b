"""Chained content hashing of token ids into prefix-cache keys.

A chunk's key is a hash of its parent's key and its own tokens, so two requests get equal
keys for chunk ``i`` exactly when (up to hash collisions) their first ``(i + 1) * block_size``
tokens are equal. This is the semantics of vLLM's and transformers' prefix caches:

- only full chunks are hashed (a trailing partial chunk has no key and is never shared);
- optional extra keys (an adapter id, a cache salt, ...) are folded into the seed of the chain,
  so the same tokens under a different adapter or salt never share a key;
- a ``parent`` key continues a chain (e.g. the key of the chunk before a resumed prefix).

Two algorithms:

- ``"fast"`` (default): vectorised over all tokens with numpy uint64 arithmetic. Tokens are
  mixed with splitmix64, each chunk's content hash is a polynomial of its mixed tokens, and the
  chain ``H_i = K * H_{i-1} + c_i (mod 2**64)`` is evaluated for all chunks at once as a scaled
  prefix sum (``K`` is odd, so invertible mod 2**64); each ``H_i`` is finalised with splitmix64.
  Not collision resistant against an adversary; collisions of honest traffic are ~2**-63.
- ``"blake2b"`` / ``"sha256"``: cryptographic, one ``hashlib`` call per chunk over the parent
  key's 8 bytes, the extra keys and the chunk's tokens as little-endian int64.

Keys are folded to 63 bits (``BlockHash``) so that they fit an int64 column.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Optional, Sequence

import numpy as np

from kvdiag.schema import BlockHash

ALGORITHMS = ("fast", "blake2b", "sha256")
MASK63 = (1 << 63) - 1

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_TOKEN_BASE = np.uint64(0x100000001B3)  # odd: polynomial base within a chunk
_CHAIN_BASE = 0xD6E8FEB86659FD93  # odd: base of the chain across chunks
_CHAIN_BASE_INV = pow(_CHAIN_BASE, -1, 1 << 64)
_MASK63_U = np.uint64(MASK63)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


_POWERS: dict[int, np.ndarray] = {}


def _powers(base: int, n: int) -> np.ndarray:
    """``base**0 .. base**(n-1)`` mod 2**64 as uint64 (cached, grown by doubling)."""
    have = _POWERS.get(base)
    if have is None or len(have) < n:
        size = max(n, 2 * (0 if have is None else len(have)), 1024)
        out = np.empty(size, dtype=np.uint64)
        acc = 1
        for i in range(size):  # exact in Python ints; amortised over all later calls
            out[i] = acc
            acc = (acc * base) & 0xFFFFFFFFFFFFFFFF
        _POWERS[base] = have = out
    return have[:n]


def _seed(parent: Optional[int], extra_keys: Sequence[object]) -> int:
    """64-bit start of a chain: the parent key, or a hash of the extra keys (0 if none)."""
    seed = 0 if parent is None else int(parent) & 0xFFFFFFFFFFFFFFFF
    if extra_keys:
        digest = hashlib.blake2b(repr(tuple(extra_keys)).encode(), digest_size=8).digest()
        seed ^= int.from_bytes(digest, "little")
    return seed


def _fast(tokens: np.ndarray, n_chunks: int, block_size: int, seed: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        mixed = _splitmix64(tokens[: n_chunks * block_size].astype(np.uint64))
        chunks = mixed.reshape(n_chunks, block_size)
        content = _splitmix64((chunks * _powers(int(_TOKEN_BASE), block_size)[::-1]).sum(axis=1))
        # H_i = K^(i+1) * seed + sum_{j<=i} K^(i-j) c_j = K^(i+1) * (seed + sum_{j<=i} K^(-j-1) c_j)
        inv_pows = _powers(_CHAIN_BASE_INV, n_chunks + 1)[1:]
        pows = _powers(_CHAIN_BASE, n_chunks + 1)[1:]
        chained = pows * (np.uint64(seed) + np.cumsum(content * inv_pows, dtype=np.uint64))
        return (_splitmix64(chained) & _MASK63_U).astype(np.int64)


def _crypto(tokens: np.ndarray, n_chunks: int, block_size: int, seed: int,
            extra_keys: Sequence[object], algorithm: str) -> np.ndarray:
    data = tokens[: n_chunks * block_size].astype("<i8").tobytes()
    extra = repr(tuple(extra_keys)).encode() if extra_keys else b""
    width = 8 * block_size
    out = np.empty(n_chunks, dtype=np.int64)
    parent = seed.to_bytes(8, "little")
    for i in range(n_chunks):
        h = hashlib.new(algorithm)
        h.update(parent)
        h.update(extra)
        h.update(data[i * width:(i + 1) * width])
        digest = h.digest()[:8]
        out[i] = int.from_bytes(digest, "little") & MASK63
        parent = digest
    return out


def chunk_hashes(token_ids: Iterable[int] | np.ndarray, block_size_tokens: int, *,
                 extra_keys: Sequence[object] = (), parent: Optional[int] = None,
                 algorithm: str = "fast") -> np.ndarray:
    """Chained keys (int64, 63 bits) of the full ``block_size_tokens`` chunks of ``token_ids``.

    ``len(result) == len(token_ids) // block_size_tokens``: a trailing partial chunk gets no key.
    Equal ``result[i]`` for two requests means equal first ``(i+1)*block_size_tokens`` tokens,
    equal ``extra_keys`` and equal ``parent``.
    """
    if block_size_tokens <= 0:
        raise ValueError(f"block size must be positive, got {block_size_tokens}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown hash algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    tokens = np.asarray(token_ids, dtype=np.int64).ravel()
    n_chunks = len(tokens) // block_size_tokens
    if n_chunks == 0:
        return np.empty(0, dtype=np.int64)
    seed = _seed(parent, extra_keys)
    if algorithm == "fast":
        return _fast(tokens, n_chunks, block_size_tokens, seed)
    return _crypto(tokens, n_chunks, block_size_tokens, seed, extra_keys, algorithm)


def chunk_hash_list(token_ids: Iterable[int], block_size_tokens: int, **kwargs) -> list[BlockHash]:
    """:func:`chunk_hashes` as a list of ``BlockHash`` (for events)."""
    return [BlockHash(int(h)) for h in chunk_hashes(token_ids, block_size_tokens, **kwargs)]
