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
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from kvdiag.events.schema import MASK63, BlockHash, RequestArrived

ALGORITHMS = ("fast", "blake2b", "sha256")

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


# ---------------------------------------------------------------- content as salted hashes
#
# A log records a prompt as the salted chained hashes of its CONTENT_CHUNK_TOKENS-token chunks
# (no token ids). Chunk i's hash stands for the first (i + 1) * CONTENT_CHUNK_TOKENS tokens, so
# the key of block j at any block size B = k * CONTENT_CHUNK_TOKENS is chunk (j + 1) * k - 1's
# hash: equal keys exactly when the token ids give equal keys (up to 2**-63 collisions), and
# replay at 16, 32, 64, 128... tokens gives the token ids' hit rates.

CONTENT_CHUNK_TOKENS = 16
"""Tokens per hashed chunk of a log's content: the smallest block size replay can re-chunk to."""

_SALT_TAG = "kvdiag-content-salt"


def new_salt() -> str:
    """A fresh per-log random salt (128 bits, hex)."""
    import secrets

    return secrets.token_hex(16)


def salted_chunk_hashes(token_ids: Iterable[int] | np.ndarray, salt: str) -> np.ndarray:
    """Chained keys (int64) of the full ``CONTENT_CHUNK_TOKENS`` chunks of ``token_ids``, the
    salt folded into the seed: the same tokens under another salt share no key."""
    return chunk_hashes(token_ids, CONTENT_CHUNK_TOKENS, extra_keys=(_SALT_TAG, str(salt)))


def block_chunk_hashes(token_ids, block_index: int, block_size_tokens: int, salt: str,
                       keys: Optional[np.ndarray] = None) -> list[BlockHash]:
    """The salted chunk keys of a sequence's chunks that end inside its block ``block_index``
    (of ``block_size_tokens``), chained from the start of ``token_ids``. ``keys``: the
    sequence's :func:`salted_chunk_hashes` when already computed (over at least the block)."""
    end = (block_index + 1) * block_size_tokens
    first = (block_index * block_size_tokens) // CONTENT_CHUNK_TOKENS
    if keys is None:
        keys = salted_chunk_hashes(list(token_ids[:end]), salt)
    return [BlockHash(int(h)) for h in keys[first:end // CONTENT_CHUNK_TOKENS]]


def keys_from_chunks(chunk_keys: Sequence[int] | np.ndarray, block_size_tokens: int) -> np.ndarray:
    """Block keys at ``block_size_tokens`` (a multiple of ``CONTENT_CHUNK_TOKENS``) from a
    sequence's chained chunk keys: block j's key is chunk ``(j + 1) * k - 1``'s, k = B / 16."""
    if block_size_tokens <= 0 or block_size_tokens % CONTENT_CHUNK_TOKENS:
        raise ValueError(f"expected a block size that is a multiple of {CONTENT_CHUNK_TOKENS} "
                         f"tokens (this log holds hashes of {CONTENT_CHUNK_TOKENS}-token chunks, "
                         f"not token ids), got {block_size_tokens}")
    k = block_size_tokens // CONTENT_CHUNK_TOKENS
    return np.asarray(chunk_keys, dtype=np.int64)[k - 1::k].copy()


@dataclass
class Content:
    """A token sequence as analyses need it: its token ids, or its chained chunk keys and token
    count (a log recorded in hashes mode). Its block keys are computed once per block size and
    algorithm (:meth:`keys`), so the folds that read one arrival (the miss causes, the capacity
    curve) share one hashing: the arrays are shared, never written to."""

    num_tokens: int
    token_ids: Optional[list[int]] = None
    chunk_keys: Optional[np.ndarray] = None
    _keys: dict = field(default_factory=dict, repr=False, compare=False)

    def can_key(self, block_size_tokens: int) -> bool:
        """Whether :meth:`keys` can chunk at ``block_size_tokens``."""
        return self.token_ids is not None or block_size_tokens % CONTENT_CHUNK_TOKENS == 0

    def keys(self, block_size_tokens: int, algorithm: str = "fast") -> np.ndarray:
        """Chained keys of the full blocks of ``block_size_tokens`` (int64, contiguous; the same
        array on every call with the same arguments: read it, do not write it)."""
        memo = (block_size_tokens, algorithm if self.token_ids is not None else "")
        out = self._keys.get(memo)
        if out is None:
            if self.token_ids is not None:
                out = chunk_hashes(self.token_ids, block_size_tokens, algorithm=algorithm)
            else:
                out = keys_from_chunks(self.chunk_keys, block_size_tokens)
            self._keys[memo] = out
        return out

    @classmethod
    def of_arrival(cls, event: RequestArrived) -> Optional["Content"]:
        """A request's prompt as its ``RequestArrived`` recorded it: token ids, else chunk
        hashes (a log in hashes mode), else None (no content recorded). The one reader: the
        same object for the same event when asked again in a row (the live folds of one
        arrival share it, and its :meth:`keys`)."""
        last = _LAST_ARRIVAL[0]
        if last[0] is event:
            return last[1]
        if event.token_ids is not None:
            content = cls(len(event.token_ids), token_ids=list(event.token_ids))
        elif event.chunk_hashes is not None:
            content = cls(event.prompt_tokens, chunk_keys=np.asarray(event.chunk_hashes, np.int64))
        else:
            content = None
        _LAST_ARRIVAL[0] = (event, content)
        return content


_LAST_ARRIVAL: list = [(None, None)]  # [(event, its Content)]: Content.of_arrival's one-entry memo


def full_sequence_chunks(prompt_keys: Sequence[int], prompt_tokens: int,
                         stored_blocks: list[tuple[int, Sequence[int]]]) -> tuple[np.ndarray, int]:
    """:func:`kvdiag.traces.kvdiag_logs.full_sequence` on chunk keys: a finished request's prompt
    and generated content as far as its engine stored full blocks. ``stored_blocks``: (tokens
    in block, chunk keys ending in it) of its ``block_stored`` events, in order. Blocks whose
    keys are all prompt keys are the prompt's own; the others continue the prompt's leading
    full blocks. Returns (chunk keys, tokens); the prompt alone when they do not fit."""
    prompt_keys = np.asarray(prompt_keys, dtype=np.int64)
    sizes = {n for n, _ in stored_blocks}
    if len(sizes) != 1 or 0 in sizes:
        return prompt_keys, prompt_tokens
    bs = sizes.pop()
    k = prompt_tokens // bs
    own = set(prompt_keys.tolist())
    generated = [list(keys) for _, keys in stored_blocks if not (keys and own.issuperset(keys))]
    lead = (k * bs) // CONTENT_CHUNK_TOKENS
    total = lead + sum(len(g) for g in generated)
    n_tokens = (k + len(generated)) * bs
    if not generated or total != n_tokens // CONTENT_CHUNK_TOKENS:
        return prompt_keys, prompt_tokens
    return (np.concatenate([prompt_keys[:lead]] + [np.asarray(g, np.int64) for g in generated]),
            n_tokens)


class ContentHasher:
    """Turns events that carry token ids into their hashes-mode form under one salt (``kvdiag
    export --strip-tokens``, ``kvdiag attach`` of an agent that records ids): a
    ``request_arrived`` gets ``chunk_hashes`` and ``partial_tokens``, a ``block_stored`` the
    chunk keys ending in it (chained over the request's prompt and the blocks it stored
    before), an engine's ``prefix_cache_stored`` keeps its own keys; every ``token_ids`` goes."""

    def __init__(self, salt: Optional[str] = None) -> None:
        self.salt = salt or new_salt()
        self._seq: dict[str, tuple[list[int], list[int]]] = {}  # rid -> (prompt, sequence)

    def __call__(self, event):
        import msgspec

        from kvdiag.events.schema import BlockStored, PrefixCacheStored, RequestArrived

        if isinstance(event, RequestArrived) and event.token_ids is not None:
            ids = [int(t) for t in event.token_ids]
            self._seq[event.request_id] = (ids, [])
            keys = salted_chunk_hashes(ids, self.salt)
            return msgspec.structs.replace(
                event, token_ids=None, chunk_hashes=[BlockHash(int(h)) for h in keys],
                partial_tokens=len(ids) % CONTENT_CHUNK_TOKENS)
        if isinstance(event, BlockStored) and event.token_ids is not None:
            return msgspec.structs.replace(event, token_ids=None,
                                           chunk_hashes=self._stored(event))
        if isinstance(event, PrefixCacheStored) and event.token_ids:
            return msgspec.structs.replace(event, token_ids=[])
        return event

    def _stored(self, event) -> Optional[list[BlockHash]]:
        """The chunk keys ending in a stored block: a block of the prompt's own (same tokens as
        a full prompt block) or the next block after the prompt's leading full blocks."""
        state = self._seq.get(event.request_id) if event.request_id is not None else None
        block = [int(t) for t in event.token_ids]
        bs = len(block)
        if state is None or bs == 0:
            return None
        prompt, seq = state
        k = len(prompt) // bs
        own = next((j for j in range(k) if prompt[j * bs:(j + 1) * bs] == block), None)
        if own is not None:
            index, tokens = own, prompt[:(own + 1) * bs]
        else:
            seq = (seq or prompt[:k * bs]) + block
            index, tokens = len(seq) // bs - 1, seq
            self._seq[event.request_id] = (prompt, seq)
        return block_chunk_hashes(tokens, index, bs, self.salt)


class HashingSink:
    """A sink that passes every event through a :class:`ContentHasher` into ``sink``."""

    def __init__(self, sink, hasher: ContentHasher) -> None:
        self.sink, self.hasher = sink, hasher

    def record(self, event) -> None:
        self.sink.record(self.hasher(event))

    def flush(self) -> None:
        self.sink.flush()
