"""Differential KV block encoding: a block written out of the pool as a quantized delta.

A layer's block is ``x`` [2, kv_heads, tokens, head_dim] (K then V, the engine's fp32). It is
written against a reference block ``ref`` of the same shape that the reader already holds (a
stored block at the same positions and layer, the previous version of the same block, or the
zero block, which makes the encoding plain quantization at the same bound).

Error bound (stated, and checked by the tests): with ``eps[s, h] = bound * rms(x[s, h])``
(rms over the head's tokens and channels of K (s=0) or V (s=1), stored as fp32),
``|x - x_hat| <= eps[s, h]`` for every element, plus the fp32 rounding of ``x_hat``
(half an ulp of ``x_hat``). Rows whose codes would need more than 16 bits are stored raw (exact).

Stream layout (little endian), :data:`FIXED_HEADER_BYTES` + rows/2 + payload:

- u64 reference id (the reader's key of ``ref``; 0 = the zero block), u16 tokens;
- fp32 ``eps`` per (K/V, head);
- one 4-bit width class per row (row = one (K/V, head, token), ``head_dim`` values), two per
  byte: 0 = all codes zero, 1 = 2-bit, 2 = 4-bit, 3 = 8-bit, 4 = 16-bit codes, 5 = raw fp32;
- payloads by class (2, 4, 8, 16-bit, raw), rows in order within a class. A code is
  ``round((x - ref) / (2 eps))``, stored as ``code + 2^(w-1)``; narrow codes are packed low
  bits first along ``head_dim``.

``x_hat = ref + code * 2 eps`` (computed in float64, then cast to fp32).
"""

from __future__ import annotations

import hashlib
import time
import struct
from dataclasses import dataclass

import numpy as np
import torch

from kvdiag.events.schema import ShadowDelta

WIDTHS = (0, 2, 4, 8, 16, 32)  # bits per value of each width class (32: raw fp32)
LIMITS = (0, 1, 7, 127, 32767)  # largest |code| of classes 0-4
REF_BYTES = 8  # a 64-bit key naming a stored block: what a deduplicated write costs


def fixed_header_bytes(kv_heads: int) -> int:
    """Reference id + token count + one fp32 eps per (K/V, head)."""
    return 8 + 2 + 4 * 2 * kv_heads


def content_key(x: torch.Tensor) -> bytes:
    """64-bit blake2b digest of the block's bytes: equal keys = bitwise equal blocks."""
    return hashlib.blake2b(x.detach().contiguous().numpy().tobytes(), digest_size=8).digest()


def eps_of(x: torch.Tensor, bound: float) -> np.ndarray:
    """fp32 [2, kv_heads]: ``bound`` x the rms of each (K/V, head) of ``x``."""
    rms = x.double().pow(2).mean(dim=(2, 3)).sqrt()
    return (bound * rms).numpy().astype(np.float32)


@dataclass(frozen=True, slots=True)
class Encoded:
    blob: bytes
    rows_by_class: tuple[int, ...]  # rows per width class 0-5

    @property
    def nbytes(self) -> int:
        return len(self.blob)


def encode(x: torch.Tensor, ref: torch.Tensor | None, bound: float, ref_id: int = 0) -> Encoded:
    """``x`` [2, H, T, D] fp32 as a delta against ``ref`` (None: the zero block); module docstring."""
    s, h, t, d = x.shape
    xn = x.detach().numpy().astype(np.float64)
    delta = xn - (ref.detach().numpy().astype(np.float64) if ref is not None else 0.0)
    eps32 = eps_of(x, bound)
    step = 2.0 * eps32.astype(np.float64)[:, :, None, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step > 0, np.rint(delta / np.where(step > 0, step, 1.0)), 0.0)
    codes = codes.reshape(-1, d)
    exact_zero_step = (np.broadcast_to(step, delta.shape) == 0).reshape(-1, d) & (delta.reshape(-1, d) != 0)
    m = np.abs(codes).max(axis=1)
    cls = np.full(m.shape, 5, dtype=np.uint8)
    for c in range(4, -1, -1):
        cls[m <= LIMITS[c]] = c
    cls[exact_zero_step.any(axis=1)] = 5
    parts = [struct.pack("<QH", ref_id, t), eps32.tobytes(), _pack_nibbles(cls)]
    flat_x = x.detach().numpy().reshape(-1, d)
    for c in (1, 2, 3, 4):
        rows = codes[cls == c]
        if len(rows):
            parts.append(_pack(rows.astype(np.int64) + (1 << (WIDTHS[c] - 1)), WIDTHS[c]))
    raw = flat_x[cls == 5]
    if len(raw):
        parts.append(np.ascontiguousarray(raw, dtype="<f4").tobytes())
    counts = tuple(int((cls == c).sum()) for c in range(6))
    return Encoded(b"".join(parts), counts)


def decode(blob: bytes, ref: torch.Tensor | None, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The fp32 block [2, H, T, D] a reader rebuilds from ``blob`` and its reference."""
    _, t = struct.unpack_from("<QH", blob, 0)
    off = 10
    eps32 = np.frombuffer(blob, dtype="<f4", count=2 * kv_heads, offset=off).reshape(2, kv_heads)
    off += 8 * kv_heads
    n = 2 * kv_heads * t
    cls = _unpack_nibbles(blob[off: off + (n + 1) // 2], n)
    off += (n + 1) // 2
    codes = np.zeros((n, head_dim), dtype=np.float64)
    for c in (1, 2, 3, 4):
        k = int((cls == c).sum())
        if k:
            w = WIDTHS[c]
            size = k * head_dim * w // 8
            codes[cls == c] = _unpack(blob[off: off + size], w, k, head_dim) - (1 << (w - 1))
            off += size
    k = int((cls == 5).sum())
    raw = np.frombuffer(blob, dtype="<f4", count=k * head_dim, offset=off).reshape(k, head_dim) if k else None
    step = 2.0 * eps32.astype(np.float64)[:, :, None, None]
    base = ref.detach().numpy().astype(np.float64) if ref is not None else 0.0
    out = base + codes.reshape(2, kv_heads, t, head_dim) * step
    out = np.asarray(np.broadcast_to(out, (2, kv_heads, t, head_dim)), dtype=np.float32).copy()
    if raw is not None:
        out.reshape(-1, head_dim)[cls == 5] = raw
    return torch.from_numpy(out)


def _pack_nibbles(cls: np.ndarray) -> bytes:
    c = cls.astype(np.uint8)
    if len(c) % 2:
        c = np.concatenate([c, np.zeros(1, np.uint8)])
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8).tobytes()


def _unpack_nibbles(buf: bytes, n: int) -> np.ndarray:
    b = np.frombuffer(buf, dtype=np.uint8)
    out = np.empty(2 * len(b), dtype=np.uint8)
    out[0::2], out[1::2] = b & 0xF, b >> 4
    return out[:n]


def _pack(u: np.ndarray, w: int) -> bytes:
    """Unsigned values [rows, D] of ``w`` bits -> bytes (low bits first for w < 8)."""
    if w == 8:
        return u.astype(np.uint8).tobytes()
    if w == 16:
        return u.astype("<u2").tobytes()
    per = 8 // w
    v = u.astype(np.uint8).reshape(u.shape[0], -1, per)
    packed = np.zeros(v.shape[:2], dtype=np.uint8)
    for i in range(per):
        packed |= (v[:, :, i] << (i * w)).astype(np.uint8)
    return packed.tobytes()


def _unpack(buf: bytes, w: int, rows: int, d: int) -> np.ndarray:
    if w == 8:
        return np.frombuffer(buf, dtype=np.uint8).reshape(rows, d).astype(np.int64)
    if w == 16:
        return np.frombuffer(buf, dtype="<u2").reshape(rows, d).astype(np.int64)
    per = 8 // w
    b = np.frombuffer(buf, dtype=np.uint8).reshape(rows, d // per)
    mask = (1 << w) - 1
    return np.stack([(b >> (i * w)) & mask for i in range(per)], axis=-1).reshape(rows, d).astype(np.int64)


# ---------------------------------------------------------------- the writer, in shadow

MAX_CANDIDATES = 8  # stored blocks kept per (block index, layer) as delta references


@dataclass(slots=True)
class _Stored:
    key: tuple  # (sequence key, block index): which block this is a version of
    ref_id: int
    x: torch.Tensor  # what a reader rebuilds: [2, H, T, D] fp32


class DeltaWriter:
    """A writer of KV blocks to a lower tier, and its store, measured in shadow.

    ``write(key, block_index, layers_kv, start, end, queries, scaling)``: the block of tokens
    [start, end) of a sequence (``layers_kv``: per layer (K, V) [1, H, T, D] of the whole
    sequence; ``queries``: per layer the sequence's last query [1, QH, 1, D] or None) is
    written as block ``block_index`` of the sequence ``key`` (e.g. a conversation); a second
    write of the same (key, block index) is a rewrite. One :class:`ShadowDelta` per
    layer goes to ``sink``. The store keeps every bitwise content key it has seen, and per
    (block index, layer) the last :data:`MAX_CANDIDATES` stored blocks (as a reader rebuilds
    them) as delta references; "most similar" = smallest sum over (K/V, head) of
    ||x - ref||^2 / rms(x)^2 (which is what the code widths grow with), the zero block included.
    """

    def __init__(self, sink, bound: float = 0.01, max_candidates: int = MAX_CANDIDATES) -> None:
        self.sink = sink
        self.bound = bound
        self.max_candidates = max_candidates
        self.seen: dict[bytes, _Stored] = {}  # content key -> the stored block
        self.candidates: dict[tuple[int, int], list[_Stored]] = {}
        self.versions: dict[tuple, _Stored] = {}  # (key, block index, layer) -> last written version
        self._next_id = 1
        self.writes = 0

    def write(self, key, block_index: int, layers_kv, start: int, end: int, queries=None,
              scaling: float | None = None) -> list:
        events = []
        ts = time.time_ns()
        self.writes += 1
        seq_len = int(layers_kv[0][0].shape[2])
        with torch.no_grad():
            for layer, (k, v) in enumerate(layers_kv):
                x = torch.stack([k[0, :, start:end], v[0, :, start:end]]).float().contiguous()
                full = x.numel() * k.element_size()  # in the dtype the engine serves
                ev, x_hat = self._layer(key, block_index, layer, x, full, seq_len, ts)
                q = queries[layer] if queries is not None else None
                if q is not None:
                    ev.attn_out_rel_error = attn_out_rel_error(q, k, v, start, end, x_hat, scaling)
                self.sink.record(ev)
                events.append(ev)
        return events

    def _layer(self, key, block_index: int, layer: int, x: torch.Tensor, full: int, seq_len: int, ts: int):
        h, t, d = x.shape[1], x.shape[2], x.shape[3]
        ck = content_key(x)
        prev = self.versions.get((key, block_index, layer))
        quant = encode(x, None, self.bound)
        t0 = time.perf_counter_ns()
        same = self.seen.get(ck)
        if same is not None:  # bitwise equal to a stored block: the reader rebuilds that one
            dedup = REF_BYTES
            chosen, ref, reference, x_hat = None, None, "duplicate", same.x
        else:
            dedup = full
            ref_item = self._most_similar(block_index, layer, x)
            ref = _fit(ref_item.x, t) if ref_item is not None else None
            chosen = encode(x, ref, self.bound, ref_item.ref_id if ref_item is not None else 0)
            if ref_item is None:
                reference = "zero"
            else:
                reference = "previous" if ref_item.key == (key, block_index) else "other"
            if chosen.nbytes >= full:
                chosen, reference = None, "full"
        t1 = time.perf_counter_ns()
        if chosen is not None:
            x_hat = decode(chosen.blob, ref, h, d)
        elif reference == "full":
            x_hat = x
        t2 = time.perf_counter_ns()
        delta_bytes = chosen.nbytes if chosen is not None else dedup
        prev_bytes = None
        if prev is not None:
            prev_bytes = min(full, REF_BYTES if same is not None else encode(x, _fit(prev.x, t), self.bound,
                                                                             prev.ref_id).nbytes)
        stored = _Stored((key, block_index), self._next_id, x_hat.clone())
        self._next_id += 1
        self.seen.setdefault(ck, stored)
        self.versions[(key, block_index, layer)] = stored
        if same is None:
            cands = self.candidates.setdefault((block_index, layer), [])
            cands.append(stored)
            del cands[: -self.max_candidates]
        kf, vf = x[0].double(), x[1].double()
        return ShadowDelta(
            ts_ns=ts, layer=layer, block_index=block_index, block_tokens=t, seq_len_tokens=seq_len,
            rewrite=prev is not None, full_bytes=full, dedup_bytes=dedup, delta_bytes=delta_bytes,
            quant_bytes=quant.nbytes, prev_bytes=prev_bytes, reference=reference, error_bound=self.bound,
            k_rel_error=_rel(kf, x_hat[0].double()), v_rel_error=_rel(vf, x_hat[1].double()),
            encode_ns=t1 - t0, decode_ns=t2 - t1), x_hat

    def _most_similar(self, block_index: int, layer: int, x: torch.Tensor):
        cands = self.candidates.get((block_index, layer), [])
        if not cands:
            return None
        t = x.shape[2]
        inv = 1.0 / x.double().pow(2).mean(dim=(2, 3), keepdim=True).clamp_min(1e-30)
        refs = torch.stack([_fit(c.x, t) for c in cands]).double()
        dist = ((x.double()[None] - refs).pow(2) * inv[None]).sum(dim=(1, 2, 3, 4))
        zero = float((x.double().pow(2) * inv).sum())
        best = int(dist.argmin())
        return cands[best] if float(dist[best]) < zero else None


def _fit(x: torch.Tensor, t: int) -> torch.Tensor:
    """A stored block cut or zero-padded to ``t`` tokens (a partial block's earlier version)."""
    if x.shape[2] == t:
        return x
    if x.shape[2] > t:
        return x[:, :, :t]
    pad = torch.zeros(*x.shape[:2], t - x.shape[2], x.shape[3], dtype=x.dtype)
    return torch.cat([x, pad], dim=2)


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    den = float(x.pow(2).sum().sqrt())
    return float((x - y).pow(2).sum().sqrt()) / den if den > 0 else 0.0


def attn_out_rel_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int,
                       x_hat: torch.Tensor, scaling: float | None = None) -> float:
    """||O - O_hat||_F / ||O||_F of the attention output of queries ``q`` [1, QH, Tq, D] over
    the sequence's K, V [1, H, T, D], O_hat with tokens [start, end) replaced by ``x_hat``
    [2, H, end - start, D] (the compression table's ``attn_out_rel_error``, all query heads)."""
    from kvdiag.kernels.attention import attention_probs

    scaling = scaling if scaling is not None else k.shape[-1] ** -0.5
    group = q.shape[1] // k.shape[1]
    k_hat, v_hat = k.clone().float(), v.clone().float()
    k_hat[0, :, start:end] = x_hat[0]
    v_hat[0, :, start:end] = x_hat[1]
    out = torch.matmul(attention_probs(q, k, scaling), v.float().repeat_interleave(group, dim=1))
    out_hat = torch.matmul(attention_probs(q, k_hat, scaling), v_hat.repeat_interleave(group, dim=1))
    den = float(out.double().pow(2).sum().sqrt())
    return float((out - out_hat).double().pow(2).sum().sqrt()) / den if den > 0 else 0.0
