"""Fused CPU kernels for the grouped formats of :mod:`kvdiag.kernels.quant` (int8/int4/int2, fp8
e4m3/e5m2, per token or per channel): encode in one pass over the input, decode in one pass
over the output, and :func:`round_trip_into`, the two in one pass that never builds the payload
(what an error measurement needs). Codes, scales, zeros and x_hat are bit-identical to the torch
reference.

The arithmetic lives in :mod:`kvdiag.kernels.quant_simd` (LLVM vector code, 16 groups or 16
channels per call); this module walks the tensor in those blocks with numba loops, one set of
loops per format and group size, compiled on first use and cached under kvdiag's cache folder
(:func:`kvdiag.paths.numba_cache_dir`), never in the package. Shapes the blocks do not cover
(:func:`supports`: groups of fewer than 16 values along a token, or a head_dim that is not a
multiple of 16 per channel) stay on the torch reference. The kernels are serial: one layer's K or
V is 3 MiB at 4k tokens on the embedded model, and the machine's other cores run the model.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit
from numba import uint64 as U

from kvdiag.kernels import quant_simd
from kvdiag.kernels.quant import INT_BITS
from kvdiag.kernels.quant_simd import LANES
from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each function below is decorated

_JIT = dict(cache=True, nogil=True)
FP8_MANT_BITS = {"fp8_e4m3": 3, "fp8_e5m2": 2}


def supports(axis: str, group: int, head_dim: int) -> bool:
    """Whether the vector kernels cover this layout: per token, groups of a multiple of 16
    values; per channel, a head_dim that is a multiple of 16."""
    if axis == "token":
        return group % LANES == 0
    return head_dim % LANES == 0


# -------------------------------------------------------------------- per token: 16 groups a call
#
# Flat arrays: x / out [rows * T * D] fp32, the quantized tokens being the first ``quant`` of each
# row; groups of a row are consecutive (``ng`` = quant * D // group of them), payload
# [rows * ng * group // per_byte], scale / zero fp16 bits [rows * ng]. A row's last partial block
# goes through zero-filled scratch (a zero group has scale 0 and touches nothing else).


@functools.cache
def _int_token(bits: int, group: int):
    """(round_trip, encode, decode) for ``bits``-bit codes in groups of ``group`` values."""
    per_byte = 8 // bits
    block = LANES * group

    @njit(**_JIT)
    def round_trip(x, rows, t, d, quant, out):
        ng = quant * d // group
        full = ng - ng % LANES
        sx, so = np.zeros(block, np.float32), np.empty(block, np.float32)
        for r in range(rows):
            base = r * t * d
            for g0 in range(0, full, LANES):
                quant_simd.int_token_round_trip(x, out, U(base + g0 * group), bits, group)
            n = (ng - full) * group
            if n:
                b = base + full * group
                sx[:n] = x[b:b + n]
                quant_simd.int_token_round_trip(sx, so, U(0), bits, group)
                out[b:b + n] = so[:n]

    @njit(**_JIT)
    def encode(x, rows, t, d, quant, payload, scale, zero):
        ng = quant * d // group
        full = ng - ng % LANES
        sx, sp = np.zeros(block, np.float32), np.empty(block // per_byte, np.uint8)
        ss, sz = np.empty(LANES, np.uint16), np.empty(LANES, np.uint16)
        for r in range(rows):
            base = r * t * d
            for g0 in range(0, full, LANES):
                gi = r * ng + g0
                quant_simd.int_token_encode(x, U(base + g0 * group), payload, U(gi * group // per_byte),
                                            scale, zero, U(gi), bits, group)
            tail = ng - full
            if tail:
                n, b, gi = tail * group, base + full * group, r * ng + full
                sx[:n] = x[b:b + n]
                quant_simd.int_token_encode(sx, U(0), sp, U(0), ss, sz, U(0), bits, group)
                pb = gi * group // per_byte
                payload[pb:pb + n // per_byte] = sp[:n // per_byte]
                scale[gi:gi + tail] = ss[:tail]
                zero[gi:gi + tail] = sz[:tail]

    @njit(**_JIT)
    def decode(payload, scale, zero, rows, t, d, quant, out):
        ng = quant * d // group
        full = ng - ng % LANES
        sp, so = np.zeros(block // per_byte, np.uint8), np.empty(block, np.float32)
        ss, sz = np.zeros(LANES, np.uint16), np.zeros(LANES, np.uint16)
        for r in range(rows):
            base = r * t * d
            for g0 in range(0, full, LANES):
                gi = r * ng + g0
                quant_simd.int_token_decode(payload, U(gi * group // per_byte), scale, zero, U(gi),
                                            out, U(base + g0 * group), bits, group)
            tail = ng - full
            if tail:
                n, b, gi = tail * group, base + full * group, r * ng + full
                pb = gi * group // per_byte
                sp[:n // per_byte] = payload[pb:pb + n // per_byte]
                ss[:tail] = scale[gi:gi + tail]
                sz[:tail] = zero[gi:gi + tail]
                quant_simd.int_token_decode(sp, U(0), ss, sz, U(0), so, U(0), bits, group)
                out[b:b + n] = so[:n]

    return round_trip, encode, decode


@functools.cache
def _fp8_token(mant: int, group: int):
    """(round_trip, encode, decode) for fp8 with ``mant`` mantissa bits, groups of ``group``."""
    block = LANES * group

    @njit(**_JIT)
    def round_trip(x, rows, t, d, quant, out):
        ng = quant * d // group
        full = ng - ng % LANES
        sx, so = np.zeros(block, np.float32), np.empty(block, np.float32)
        for r in range(rows):
            base = r * t * d
            for g0 in range(0, full, LANES):
                quant_simd.fp8_token_round_trip(x, out, U(base + g0 * group), mant, group)
            n = (ng - full) * group
            if n:
                b = base + full * group
                sx[:n] = x[b:b + n]
                quant_simd.fp8_token_round_trip(sx, so, U(0), mant, group)
                out[b:b + n] = so[:n]

    @njit(**_JIT)
    def encode(x, rows, t, d, quant, payload, scale):
        ng = quant * d // group
        full = ng - ng % LANES
        sx, sp = np.zeros(block, np.float32), np.empty(block, np.uint8)
        ss = np.empty(LANES, np.uint16)
        for r in range(rows):
            base = r * t * d
            for g0 in range(0, full, LANES):
                gi = r * ng + g0
                quant_simd.fp8_token_encode(x, U(base + g0 * group), payload, U(gi * group), scale, U(gi),
                                            mant, group)
            tail = ng - full
            if tail:
                n, b, gi = tail * group, base + full * group, r * ng + full
                sx[:n] = x[b:b + n]
                quant_simd.fp8_token_encode(sx, U(0), sp, U(0), ss, U(0), mant, group)
                payload[gi * group:gi * group + n] = sp[:n]
                scale[gi:gi + tail] = ss[:tail]

    @njit(**_JIT)
    def decode(payload, scale, rows, t, d, quant, out):
        ng = quant * d // group
        full = ng - ng % LANES
        sp, so = np.zeros(block, np.uint8), np.empty(block, np.float32)
        ss = np.zeros(LANES, np.uint16)
        for r in range(rows):
            base = r * t * d
            for g0 in range(0, full, LANES):
                gi = r * ng + g0
                quant_simd.fp8_token_decode(payload, U(gi * group), scale, U(gi), out, U(base + g0 * group),
                                            mant, group)
            tail = ng - full
            if tail:
                n, b, gi = tail * group, base + full * group, r * ng + full
                sp[:n] = payload[gi * group:gi * group + n]
                ss[:tail] = scale[gi:gi + tail]
                quant_simd.fp8_token_decode(sp, U(0), ss, U(0), so, U(0), mant, group)
                out[b:b + n] = so[:n]

    return round_trip, encode, decode


# -------------------------------------------------------------------- per channel: 16 channels a call
#
# A block is ``group`` consecutive tokens of 16 channels; payload rows hold D // per_byte bytes,
# scale / zero fp16 bits [rows * (quant // group) * D].


@functools.cache
def _int_channel(bits: int, group: int):
    per_byte = 8 // bits

    @njit(**_JIT)
    def round_trip(x, rows, t, d, quant, out):
        for r in range(rows):
            for tg in range(quant // group):
                b = r * t * d + tg * group * d
                for j in range(0, d, LANES):
                    quant_simd.int_channel_round_trip(x, out, U(b + j), U(d), bits, group)

    @njit(**_JIT)
    def encode(x, rows, t, d, quant, payload, scale, zero):
        prow, blocks = d // per_byte, quant // group
        for r in range(rows):
            for tg in range(blocks):
                b, pb, si = r * t * d + tg * group * d, (r * quant + tg * group) * prow, (r * blocks + tg) * d
                for j in range(0, d, LANES):
                    quant_simd.int_channel_encode(x, U(b + j), U(d), payload, U(pb + j // per_byte), U(prow),
                                                  scale, zero, U(si + j), bits, group)

    @njit(**_JIT)
    def decode(payload, scale, zero, rows, t, d, quant, out):
        prow, blocks = d // per_byte, quant // group
        for r in range(rows):
            for tg in range(blocks):
                b, pb, si = r * t * d + tg * group * d, (r * quant + tg * group) * prow, (r * blocks + tg) * d
                for j in range(0, d, LANES):
                    quant_simd.int_channel_decode(payload, U(pb + j // per_byte), U(prow), scale, zero, U(si + j),
                                                  out, U(b + j), U(d), bits, group)

    return round_trip, encode, decode


@functools.cache
def _fp8_channel(mant: int, group: int):
    @njit(**_JIT)
    def round_trip(x, rows, t, d, quant, out):
        for r in range(rows):
            for tg in range(quant // group):
                b = r * t * d + tg * group * d
                for j in range(0, d, LANES):
                    quant_simd.fp8_channel_round_trip(x, out, U(b + j), U(d), mant, group)

    @njit(**_JIT)
    def encode(x, rows, t, d, quant, payload, scale):
        blocks = quant // group
        for r in range(rows):
            for tg in range(blocks):
                b, pb, si = r * t * d + tg * group * d, (r * quant + tg * group) * d, (r * blocks + tg) * d
                for j in range(0, d, LANES):
                    quant_simd.fp8_channel_encode(x, U(b + j), U(d), payload, U(pb + j), scale, U(si + j),
                                                  mant, group)

    @njit(**_JIT)
    def decode(payload, scale, rows, t, d, quant, out):
        blocks = quant // group
        for r in range(rows):
            for tg in range(blocks):
                b, pb, si = r * t * d + tg * group * d, (r * quant + tg * group) * d, (r * blocks + tg) * d
                for j in range(0, d, LANES):
                    quant_simd.fp8_channel_decode(payload, U(pb + j), scale, U(si + j), out, U(b + j), U(d),
                                                  mant, group)

    return round_trip, encode, decode


def _kernels(fmt: str, axis: str, group: int):
    """(round_trip, encode, decode) for this format, axis and group size."""
    if fmt in INT_BITS:
        return (_int_token if axis == "token" else _int_channel)(INT_BITS[fmt], group)
    return (_fp8_token if axis == "token" else _fp8_channel)(FP8_MANT_BITS[fmt], group)


# -------------------------------------------------------------------- entry points


def _bits16(t: torch.Tensor) -> np.ndarray:
    """An fp16 tensor's storage as a flat uint16 numpy array (no copy)."""
    return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)


def _flat_input(x: torch.Tensor):
    """(x as a flat fp32 numpy array, rows = B * H, T, D); no copy when ``x`` is already
    contiguous fp32."""
    b, h, t, d = x.shape
    xf = x.detach()
    if xf.dtype != torch.float32:
        xf = xf.float()
    if not xf.is_contiguous():
        xf = xf.contiguous()
    return xf.numpy().reshape(-1), b * h, t, d


def _check(axis: str, group: int, head_dim: int) -> None:
    if not supports(axis, group, head_dim):
        raise ValueError(f"the CPU kernels need groups of a multiple of {LANES} values per token and a head_dim "
                         f"that is a multiple of {LANES} per channel (axis={axis}, group={group}, "
                         f"head_dim={head_dim}); use backend='torch'")


def encode(x: torch.Tensor, fmt: str, axis: str, group: int, quant: int):
    """``x`` [B, H, T, D] (any float dtype) -> (payload [B, H, quant, D // per_byte] as uint8,
    scale, zero) for the first ``quant`` tokens; ``zero`` is None for fp8."""
    b, h, t, d = x.shape
    _check(axis, group, d)
    xf, rows, _, _ = _flat_input(x)
    groups_shape = (b, h, quant, d // group) if axis == "token" else (b, h, quant // group, d)
    scale = torch.empty(groups_shape, dtype=torch.float16)
    kernel = _kernels(fmt, axis, group)[1]
    if fmt in INT_BITS:
        payload = torch.empty((b, h, quant, d * INT_BITS[fmt] // 8), dtype=torch.uint8)
        zero = torch.empty(groups_shape, dtype=torch.float16)
        kernel(xf, rows, t, d, quant, payload.numpy().reshape(-1), _bits16(scale), _bits16(zero))
        return payload, scale, zero
    payload = torch.empty((b, h, quant, d), dtype=torch.uint8)
    kernel(xf, rows, t, d, quant, payload.numpy().reshape(-1), _bits16(scale))
    return payload, scale, None


def decode_into(payload: torch.Tensor, scale: torch.Tensor, zero, fmt: str, axis: str, group: int,
                out: torch.Tensor) -> None:
    """Write x_hat of the quantized tokens (``payload.shape[2]`` of them) into the first tokens
    of ``out`` [B, H, T, D], a contiguous fp32 tensor."""
    b, h, t, d = out.shape
    _check(axis, group, d)
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("decode_into writes into a contiguous fp32 tensor")
    out1 = out.numpy().reshape(-1)
    quant = payload.shape[2]
    p1 = payload.view(torch.uint8).contiguous().numpy().reshape(-1)
    kernel = _kernels(fmt, axis, group)[2]
    if fmt in INT_BITS:
        kernel(p1, _bits16(scale.contiguous()), _bits16(zero.contiguous()), b * h, t, d, quant, out1)
    else:
        kernel(p1, _bits16(scale.contiguous()), b * h, t, d, quant, out1)


def round_trip_into(x: torch.Tensor, fmt: str, axis: str, group: int, quant: int, out: torch.Tensor) -> None:
    """x_hat of :func:`encode` then :func:`decode_into` for the first ``quant`` tokens of ``x``,
    written into ``out`` (contiguous fp32, shape of ``x``) in one pass, without materialising
    the payload: bit-identical to the two calls (same arithmetic, same order)."""
    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != x.shape:
        raise ValueError("round_trip_into writes into a contiguous fp32 tensor shaped as x")
    _check(axis, group, x.shape[-1])
    xf, rows, t, d = _flat_input(x)
    _kernels(fmt, axis, group)[0](xf, rows, t, d, quant, out.numpy().reshape(-1))
