"""Fused CPU kernels (numba) for the grouped formats of :mod:`kvdiag.kernels.quant`.

Same layout and arithmetic as the torch reference, in one pass over the input (encode) and one
over the output (decode) instead of a dozen tensor-wide passes, plus :func:`round_trip_into`, the
two fused into one pass that never materialises the payload (what an error measurement needs):

- integers: zero = fp16(group min), scale = fp16((max - min) / qmax), code = floor((x - zero) *
  (1 / scale) + 0.5) clamped to [0, qmax], every step in fp32 without fused multiply-add, so
  codes, scales and zeros are bit-identical to the reference; x_hat = code * scale + zero.
- fp8: scale = fp16(absmax / fp8 max); the value x * (1 / scale), clamped to the fp8 range, is
  rounded to the nearest fp8 value (ties to even) by the bit arithmetic of c10's casts.

fp32 <-> fp16 conversions are done on the bits (round to nearest even, subnormals included),
since numba has no half type. The kernels are serial (one layer's K or V, 3 MiB at 4k tokens,
on a machine whose cores also run the model); a parallel variant was not measured in this round. Compiled code is cached under kvdiag's cache folder
(:func:`kvdiag.paths.numba_cache_dir`), never in the package.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit
from numba import uint64 as U

from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each function below is decorated

# no NaN/inf inputs and no care for the sign of zero: lets LLVM vectorize min/max; no
# reassociation, no reciprocal approximation and no contraction into FMA (bit-exactness)
_FAST = {"nnan", "ninf", "nsz"}
_JIT = dict(fastmath=_FAST, cache=True, nogil=True)

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FP8_MANT_BITS = {"fp8_e4m3": 3, "fp8_e5m2": 2}


# ------------------------------------------------------------------ scalar conversions


@njit(inline="always", **_JIT)
def _f32_to_f16_bits(f):
    """fp32 -> fp16 bits, round to nearest even (as torch's cast)."""
    u = np.int64(np.float32(f).view(np.uint32))
    sign = (u >> 16) & 0x8000
    u = u & 0x7FFFFFFF
    # every case computed and one selected (no branch: the loops calling this vectorize)
    big = 0x7E00 if u > 0x7F800000 else 0x7C00  # |f| >= 65536: inf (or nan)
    # below fp16's smallest normal: the adder rounds to the subnormal grid
    rounded = np.float32(np.uint32(u).view(np.float32) + np.float32(0.5))
    sub = np.int64(rounded.view(np.uint32)) - 0x3F000000
    odd = (u >> 13) & 1
    normal = (u + (0xFFF - (112 << 23)) + odd) >> 13
    out = big if u >= 0x47800000 else (sub if u < 0x38800000 else normal)
    return np.uint16(out | sign)


@njit(inline="always", **_JIT)
def _f16_bits_to_f32(h):
    h = np.int64(h)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    # zero or subnormal: exact in fp32
    sub = np.int64(np.float32(np.float32(mant) * np.float32(2.0 ** -24)).view(np.uint32)) | sign
    special = sign | 0x7F800000 | (mant << 13)
    normal = sign | ((exp + 112) << 23) | (mant << 13)
    bits = sub if exp == 0 else (special if exp == 31 else normal)
    return np.uint32(bits).view(np.float32)


@njit(inline="always", **_JIT)
def _f32_to_fp8_bits(f, mant_bits, bias):
    """fp32 (already clamped to the fp8 range) -> fp8 bits, round to nearest even: c10's
    fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value without their overflow branch."""
    u = np.int64(np.float32(f).view(np.uint32))
    sign = (u >> 24) & 0x80
    u = u & 0x7FFFFFFF
    shift = 23 - mant_bits
    # both roundings computed and one selected (no branch: the loops calling this vectorize)
    # below the smallest fp8 normal: round on the subnormal grid by an fp32 addition
    denorm = (127 - bias + 23 - mant_bits + 1) << 23
    rounded = np.float32(np.uint32(u).view(np.float32) + np.uint32(denorm).view(np.float32))
    sub = np.int64(rounded.view(np.uint32)) - denorm
    odd = (u >> shift) & 1
    normal = (u + ((bias - 127) << 23) + ((1 << (shift - 1)) - 1) + odd) >> shift
    out = sub if u < ((128 - bias) << 23) else normal
    return np.uint8((out & 0x7F) | sign)


@njit(inline="always", **_JIT)
def _fp8_bits_to_f32(c, mant_bits, bias):
    """fp32 value of fp8 bits ``c`` (finite: the encoder clamps to the fp8 range), by arithmetic
    on the bits rather than a table lookup, so that the loop vectorizes without gathers."""
    c = np.int64(c)
    sign = (c & 0x80) << 24
    exp = (c & 0x7F) >> mant_bits
    mant = c & ((1 << mant_bits) - 1)
    normal = np.uint32(sign | ((exp + 127 - bias) << 23) | (mant << (23 - mant_bits))).view(np.float32)
    # subnormal: mant * 2 ** (1 - bias - mant_bits), exact in fp32
    sub = np.float32(mant) * np.uint32((128 - bias - mant_bits) << 23).view(np.float32)
    sub = -sub if sign else sub
    return normal if exp > 0 else sub


@njit(inline="always", **_JIT)
def _fp8_round_value(f, mant_bits, bias):
    """fp32 (already clamped to the fp8 range) rounded to the nearest fp8 value (ties to even),
    as an fp32: what decoding :func:`_f32_to_fp8_bits` gives, in 32-bit lanes without building the
    code. Adding then subtracting c = 2 ** (exponent + 23 - mant_bits) rounds to the fp8 spacing
    with the adder's round to nearest even (the exponent is clamped to fp8's smallest normal
    one, so that subnormals round on their fixed grid)."""
    u = np.float32(f).view(np.int32)
    mag = np.int32(u & np.int32(0x7FFFFFFF))
    e = max(np.int32(mag & np.int32(0x7F800000)), np.int32((128 - bias) << 23))
    c = np.int32(e + np.int32((23 - mant_bits) << 23)).view(np.float32)
    r = np.float32((mag.view(np.float32) + c) - c)
    return np.int32(r.view(np.int32) | (u & np.int32(-0x80000000))).view(np.float32)


@njit(inline="always", **_JIT)
def _encode_inverse(s16):
    """fp32 1 / scale used for encoding; a zero scale (constant group) encodes with 1."""
    s = _f16_bits_to_f32(s16)
    return np.float32(1.0) / (s if s > 0 else np.float32(1.0))


# ------------------------------------------------------------------ vectorizable building blocks
#
# Every kernel indexes flat 1-D arrays with unsigned (uint64) indices: numba then emits no
# negative-index wraparound, so LLVM sees consecutive accesses and vectorizes the inner loops
# (AVX-512 zmm on the development machine; checked with ``inspect_asm``). Float min/max
# reductions are not vectorized by numba's LLVM (scalar vminss/vmaxss, even with fastmath), so
# group minima and maxima are taken on order-preserving integer keys of the fp32 bits, which
# LLVM reduces with vector integer min/max: identical results for non-NaN inputs.


@njit(inline="always", **_JIT)
def _key(v):
    """fp32 bits (int32) -> int32 key with the order of the float values (-0.0 below +0.0)."""
    return np.int32(v ^ ((v >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@njit(inline="always", **_JIT)
def _unkey(k):
    """Inverse of :func:`_key`: the fp32 value."""
    k = np.int64(k)
    k = k ^ ((k >> 31) & 0x7FFFFFFF)
    return np.uint32(k & 0xFFFFFFFF).view(np.float32)


@njit(inline="always", **_JIT)
def _group_minmax(xi, b, group):
    """(min, max) of the fp32 values whose bits are ``xi[b:b + group]``."""
    lo = np.int32(0x7FFFFFFF)
    hi = np.int32(-0x80000000)
    for j in range(U(group)):
        k = _key(xi[b + j])
        lo = min(lo, k)
        hi = max(hi, k)
    return _unkey(lo), _unkey(hi)


@njit(inline="always", **_JIT)
def _group_absmax(xi, b, group):
    """max |x| over ``xi[b:b + group]`` (fp32 bits; the magnitude bits order as the values)."""
    m = np.int64(0)
    for j in range(U(group)):
        m = max(m, np.int64(xi[b + j]) & 0x7FFFFFFF)
    return np.uint32(m).view(np.float32)


@njit(inline="always", **_JIT)
def _code(v, zero, inv, qmax):
    """floor((v - zero) * inv + 0.5) clamped to [0, qmax], as fp32 (the truncation is the floor
    once the value is >= 0)."""
    c = min(max((v - zero) * inv + np.float32(0.5), np.float32(0.0)), qmax)
    return np.float32(np.int32(c))


@njit(inline="always", **_JIT)
def _int_params(lo, hi, qmax):
    """fp16 bits of zero and scale, and the fp32 zero, scale and encoding inverse."""
    z16 = _f32_to_f16_bits(lo)
    s16 = _f32_to_f16_bits((hi - lo) / qmax)
    return z16, s16, _f16_bits_to_f32(z16), _f16_bits_to_f32(s16), _encode_inverse(s16)


@njit(inline="always", **_JIT)
def _int_params_vec(lo, hi, n, qmax, z16, s16, zf, sf, invf):
    """:func:`_int_params` over ``n`` groups (arrays), a loop LLVM can vectorize."""
    for g in range(U(n)):
        z16[g], s16[g], zf[g], sf[g], invf[g] = _int_params(lo[g], hi[g], qmax)


@njit(inline="always", **_JIT)
def _fp8_params_vec(amax, n, fmax, s16, sf, invf):
    for g in range(U(n)):
        s = _f32_to_f16_bits(amax[g] / fmax)
        s16[g] = s
        sf[g] = _f16_bits_to_f32(s)
        invf[g] = _encode_inverse(s)


@njit(inline="always", **_JIT)
def _round_trip_group(x, b, zero, scale, inv, qmax, out, n):
    """x_hat of ``n`` values from ``x[b:]`` (one group) into ``out[b:]``."""
    for j in range(U(n)):
        out[b + j] = _code(x[b + j], zero, inv, qmax) * scale + zero


@njit(inline="always", **_JIT)
def _fp8_group(x, b, inv, fmax, mant_bits, bias, payload, pb, n):
    for j in range(U(n)):
        payload[pb + j] = _fp8_code(x[b + j], inv, fmax, mant_bits, bias)


@njit(inline="always", **_JIT)
def _fp8_decode_group(payload, pb, mant_bits, bias, s, out, b, n):
    for j in range(U(n)):
        out[b + j] = _fp8_bits_to_f32(payload[pb + j], mant_bits, bias) * s


@njit(inline="always", **_JIT)
def _fp8_round_trip_group(x, b, inv, fmax, mant_bits, bias, s, out, n):
    for j in range(U(n)):
        out[b + j] = _fp8_round_value(min(max(x[b + j] * inv, -fmax), fmax), mant_bits, bias) * s


@njit(inline="always", **_JIT)
def _pack_one(x, b, zero, inv, qmax, bits, payload, pb, n):
    """codes of ``x[b:b + n]`` (one ``zero``/``inv``) packed low bits first into ``payload[pb:]``."""
    if bits == 8:
        for j in range(U(n)):
            payload[pb + j] = np.uint8(_code(x[b + j], zero, inv, qmax))
    elif bits == 4:
        for k in range(U(n // 2)):
            c0 = np.uint8(_code(x[b + U(2) * k], zero, inv, qmax))
            c1 = np.uint8(_code(x[b + U(2) * k + U(1)], zero, inv, qmax))
            payload[pb + k] = c0 | (c1 << np.uint8(4))
    else:
        for k in range(U(n // 4)):
            c0 = np.uint8(_code(x[b + U(4) * k], zero, inv, qmax))
            c1 = np.uint8(_code(x[b + U(4) * k + U(1)], zero, inv, qmax))
            c2 = np.uint8(_code(x[b + U(4) * k + U(2)], zero, inv, qmax))
            c3 = np.uint8(_code(x[b + U(4) * k + U(3)], zero, inv, qmax))
            payload[pb + k] = c0 | (c1 << np.uint8(2)) | (c2 << np.uint8(4)) | (c3 << np.uint8(6))


@njit(inline="always", **_JIT)
def _pack_vec(x, b, zero, inv, qmax, bits, payload, pb, n):
    """As :func:`_pack_one` with per-element ``zero[j]``/``inv[j]`` (axis="channel")."""
    if bits == 8:
        for j in range(U(n)):
            payload[pb + j] = np.uint8(_code(x[b + j], zero[j], inv[j], qmax))
    elif bits == 4:
        for k in range(U(n // 2)):
            c0 = np.uint8(_code(x[b + U(2) * k], zero[U(2) * k], inv[U(2) * k], qmax))
            c1 = np.uint8(_code(x[b + U(2) * k + U(1)], zero[U(2) * k + U(1)], inv[U(2) * k + U(1)], qmax))
            payload[pb + k] = c0 | (c1 << np.uint8(4))
    else:
        for k in range(U(n // 4)):
            c0 = np.uint8(_code(x[b + U(4) * k], zero[U(4) * k], inv[U(4) * k], qmax))
            c1 = np.uint8(_code(x[b + U(4) * k + U(1)], zero[U(4) * k + U(1)], inv[U(4) * k + U(1)], qmax))
            c2 = np.uint8(_code(x[b + U(4) * k + U(2)], zero[U(4) * k + U(2)], inv[U(4) * k + U(2)], qmax))
            c3 = np.uint8(_code(x[b + U(4) * k + U(3)], zero[U(4) * k + U(3)], inv[U(4) * k + U(3)], qmax))
            payload[pb + k] = c0 | (c1 << np.uint8(2)) | (c2 << np.uint8(4)) | (c3 << np.uint8(6))


@njit(inline="always", **_JIT)
def _unpack_one(payload, pb, scale, zero, bits, out, b, n):
    """x_hat = code * scale + zero for ``n`` values (one ``scale``/``zero``) into ``out[b:]``."""
    if bits == 8:
        for j in range(U(n)):
            out[b + j] = np.float32(payload[pb + j]) * scale + zero
    elif bits == 4:
        for k in range(U(n // 2)):
            v = payload[pb + k]
            out[b + U(2) * k] = np.float32(v & np.uint8(15)) * scale + zero
            out[b + U(2) * k + U(1)] = np.float32(v >> np.uint8(4)) * scale + zero
    else:
        for k in range(U(n // 4)):
            v = payload[pb + k]
            out[b + U(4) * k] = np.float32(v & np.uint8(3)) * scale + zero
            out[b + U(4) * k + U(1)] = np.float32((v >> np.uint8(2)) & np.uint8(3)) * scale + zero
            out[b + U(4) * k + U(2)] = np.float32((v >> np.uint8(4)) & np.uint8(3)) * scale + zero
            out[b + U(4) * k + U(3)] = np.float32(v >> np.uint8(6)) * scale + zero


@njit(inline="always", **_JIT)
def _unpack_vec(payload, pb, scale, zero, bits, out, b, n):
    """As :func:`_unpack_one` with per-element ``scale[j]``/``zero[j]``."""
    if bits == 8:
        for j in range(U(n)):
            out[b + j] = np.float32(payload[pb + j]) * scale[j] + zero[j]
    elif bits == 4:
        for k in range(U(n // 2)):
            v = payload[pb + k]
            out[b + U(2) * k] = np.float32(v & np.uint8(15)) * scale[U(2) * k] + zero[U(2) * k]
            out[b + U(2) * k + U(1)] = np.float32(v >> np.uint8(4)) * scale[U(2) * k + U(1)] + zero[U(2) * k + U(1)]
    else:
        for k in range(U(n // 4)):
            v = payload[pb + k]
            out[b + U(4) * k] = np.float32(v & np.uint8(3)) * scale[U(4) * k] + zero[U(4) * k]
            out[b + U(4) * k + U(1)] = np.float32((v >> np.uint8(2)) & np.uint8(3)) * scale[U(4) * k + U(1)] + zero[U(4) * k + U(1)]
            out[b + U(4) * k + U(2)] = np.float32((v >> np.uint8(4)) & np.uint8(3)) * scale[U(4) * k + U(2)] + zero[U(4) * k + U(2)]
            out[b + U(4) * k + U(3)] = np.float32(v >> np.uint8(6)) * scale[U(4) * k + U(3)] + zero[U(4) * k + U(3)]


# ------------------------------------------------------------------ integer kernels
#
# Arrays are flat: x / out [BH * T * D] fp32 (xi: the same memory as int32), the quantized
# tokens being the first ``quant`` of each of the BH rows; payload [BH * quant * D // per_byte];
# scale / zero fp16 bits [BH * quant * D // group] (token axis, groups in row-major order) or
# [BH * quant // group * D] (channel axis).


# groups per chunk of the token-axis kernels: min/max of CHUNK groups, then their parameters in
# one vectorizable loop, then the codes
_CHUNK = 256


@njit(**_JIT)
def _encode_int_token(x, xi, rows_bh, t, d, quant, group, bits, payload, scale, zero):
    per_byte = 8 // bits
    qmax = np.float32((1 << bits) - 1)
    ng = quant * d // group
    lo, hi = np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.float32)
    zf, sf, invf = np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.float32)
    for bh in range(rows_bh):
        base = U(bh * t * d)
        for c0 in range(0, ng, _CHUNK):
            n = min(_CHUNK, ng - c0)
            for g in range(n):
                lo[g], hi[g] = _group_minmax(xi, base + U((c0 + g) * group), group)
            gi0 = U(bh * ng + c0)
            _int_params_vec(lo, hi, n, qmax, zero[gi0:gi0 + U(n)], scale[gi0:gi0 + U(n)], zf, sf, invf)
            for g in range(n):
                b, pb = base + U((c0 + g) * group), (gi0 + U(g)) * U(group // per_byte)
                _pack_one(x, b, zf[g], invf[g], qmax, bits, payload, pb, group)


@njit(**_JIT)
def _decode_int_token(payload, scale, zero, rows_bh, t, d, quant, group, bits, out):
    per_byte = 8 // bits
    ng = quant * d // group
    sf, zf = np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.float32)
    for bh in range(rows_bh):
        base = U(bh * t * d)
        for c0 in range(0, ng, _CHUNK):
            n = min(_CHUNK, ng - c0)
            gi0 = U(bh * ng + c0)
            for g in range(U(n)):  # the chunk's parameters in one vectorizable loop
                sf[g] = _f16_bits_to_f32(scale[gi0 + g])
                zf[g] = _f16_bits_to_f32(zero[gi0 + g])
            for g in range(n):
                _unpack_one(payload, (gi0 + U(g)) * U(group // per_byte), sf[g], zf[g], bits, out,
                            base + U((c0 + g) * group), group)


@njit(**_JIT)
def _round_trip_int_token(x, xi, rows_bh, t, d, quant, group, bits, out):
    """x_hat of :func:`_encode_int_token` then :func:`_decode_int_token`, without the payload."""
    qmax = np.float32((1 << bits) - 1)
    ng = quant * d // group
    lo, hi = np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.float32)
    z16, s16 = np.empty(_CHUNK, np.uint16), np.empty(_CHUNK, np.uint16)
    zf, sf, invf = np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.float32)
    for bh in range(rows_bh):
        base = U(bh * t * d)
        for c0 in range(0, ng, _CHUNK):
            n = min(_CHUNK, ng - c0)
            for g in range(n):
                lo[g], hi[g] = _group_minmax(xi, base + U((c0 + g) * group), group)
            _int_params_vec(lo, hi, n, qmax, z16, s16, zf, sf, invf)
            for g in range(n):
                b = base + U((c0 + g) * group)
                if group == 32:  # a compile-time trip count: vectorized without a scalar epilogue
                    _round_trip_group(x, b, zf[g], sf[g], invf[g], qmax, out, 32)
                else:
                    _round_trip_group(x, b, zf[g], sf[g], invf[g], qmax, out, group)


@njit(inline="always", **_JIT)
def _channel_minmax(xi, b, d, group, lo, hi):
    """Per-channel min/max keys of ``group`` rows of ``d`` values from ``xi[b:]``."""
    for j in range(U(d)):
        k = _key(xi[b + j])
        lo[j] = k
        hi[j] = k
    for tt in range(1, group):
        row = b + U(tt * d)
        for j in range(U(d)):
            k = _key(xi[row + j])
            lo[j] = min(lo[j], k)
            hi[j] = max(hi[j], k)


@njit(**_JIT)
def _encode_int_channel(x, xi, rows_bh, t, d, quant, group, bits, payload, scale, zero):
    per_byte = 8 // bits
    qmax = np.float32((1 << bits) - 1)
    blocks = quant // group
    lo, hi = np.empty(d, np.int32), np.empty(d, np.int32)
    lof, hif = np.empty(d, np.float32), np.empty(d, np.float32)
    zero_f, scale_f, inv_f = np.empty(d, np.float32), np.empty(d, np.float32), np.empty(d, np.float32)
    for bh in range(rows_bh):
        for tg in range(blocks):
            b = U(bh * t * d + tg * group * d)
            _channel_minmax(xi, b, d, group, lo, hi)
            sb = U((bh * blocks + tg) * d)
            for j in range(U(d)):
                lof[j], hif[j] = _unkey(lo[j]), _unkey(hi[j])
            _int_params_vec(lof, hif, d, qmax, zero[sb:sb + U(d)], scale[sb:sb + U(d)], zero_f, scale_f, inv_f)
            for tt in range(group):
                row = U((bh * quant + tg * group + tt) * d)
                _pack_vec(x, b + U(tt * d), zero_f, inv_f, qmax, bits, payload, row // U(per_byte), d)


@njit(**_JIT)
def _decode_int_channel(payload, scale, zero, rows_bh, t, d, quant, group, bits, out):
    per_byte = 8 // bits
    blocks = quant // group
    scale_f = np.empty(d, np.float32)
    zero_f = np.empty(d, np.float32)
    for bh in range(rows_bh):
        for tg in range(blocks):
            sb = U((bh * blocks + tg) * d)
            for j in range(U(d)):
                scale_f[j] = _f16_bits_to_f32(scale[sb + j])
                zero_f[j] = _f16_bits_to_f32(zero[sb + j])
            for tt in range(group):
                row = U((bh * quant + tg * group + tt) * d)
                _unpack_vec(payload, row // U(per_byte), scale_f, zero_f, bits, out,
                            U(bh * t * d + (tg * group + tt) * d), d)


@njit(**_JIT)
def _round_trip_int_channel(x, xi, rows_bh, t, d, quant, group, bits, out):
    qmax = np.float32((1 << bits) - 1)
    blocks = quant // group
    lo, hi = np.empty(d, np.int32), np.empty(d, np.int32)
    lof, hif = np.empty(d, np.float32), np.empty(d, np.float32)
    z16, s16 = np.empty(d, np.uint16), np.empty(d, np.uint16)
    zero_f, scale_f, inv_f = np.empty(d, np.float32), np.empty(d, np.float32), np.empty(d, np.float32)
    for bh in range(rows_bh):
        for tg in range(blocks):
            b = U(bh * t * d + tg * group * d)
            _channel_minmax(xi, b, d, group, lo, hi)
            for j in range(U(d)):
                lof[j], hif[j] = _unkey(lo[j]), _unkey(hi[j])
            _int_params_vec(lof, hif, d, qmax, z16, s16, zero_f, scale_f, inv_f)
            for tt in range(group):
                row = b + U(tt * d)
                for j in range(U(d)):
                    out[row + j] = _code(x[row + j], zero_f[j], inv_f[j], qmax) * scale_f[j] + zero_f[j]


# ------------------------------------------------------------------ fp8 kernels


@njit(inline="always", **_JIT)
def _fp8_code(v, inv, fmax, mant_bits, bias):
    return _f32_to_fp8_bits(min(max(v * inv, -fmax), fmax), mant_bits, bias)


@njit(**_JIT)
def _encode_fp8_token(x, xi, rows_bh, t, d, quant, group, fmax, mant_bits, bias, payload, scale):
    ng = quant * d // group
    amax = np.empty(_CHUNK, np.float32)
    sf, invf = np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.float32)
    for bh in range(rows_bh):
        base = U(bh * t * d)
        for c0 in range(0, ng, _CHUNK):
            n = min(_CHUNK, ng - c0)
            for g in range(n):
                amax[g] = _group_absmax(xi, base + U((c0 + g) * group), group)
            gi0 = U(bh * ng + c0)
            _fp8_params_vec(amax, n, fmax, scale[gi0:gi0 + U(n)], sf, invf)
            for g in range(n):
                _fp8_group(x, base + U((c0 + g) * group), invf[g], fmax, mant_bits, bias, payload,
                           (gi0 + U(g)) * U(group), group)


@njit(**_JIT)
def _decode_fp8_token(payload, scale, rows_bh, t, d, quant, group, mant_bits, bias, out):
    ng = quant * d // group
    for bh in range(rows_bh):
        base = U(bh * t * d)
        for gg in range(ng):
            gi = U(bh * ng + gg)
            s = _f16_bits_to_f32(scale[gi])
            b, pb = base + U(gg * group), gi * U(group)
            _fp8_decode_group(payload, pb, mant_bits, bias, s, out, b, group)


@njit(**_JIT)
def _round_trip_fp8_token(x, xi, rows_bh, t, d, quant, group, fmax, mant_bits, bias, out):
    ng = quant * d // group
    amax = np.empty(_CHUNK, np.float32)
    s16 = np.empty(_CHUNK, np.uint16)
    sf, invf = np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.float32)
    for bh in range(rows_bh):
        base = U(bh * t * d)
        for c0 in range(0, ng, _CHUNK):
            n = min(_CHUNK, ng - c0)
            for g in range(n):
                amax[g] = _group_absmax(xi, base + U((c0 + g) * group), group)
            _fp8_params_vec(amax, n, fmax, s16, sf, invf)
            for g in range(n):
                b = base + U((c0 + g) * group)
                _fp8_round_trip_group(x, b, invf[g], fmax, mant_bits, bias, sf[g], out, group)


@njit(inline="always", **_JIT)
def _channel_absmax(xi, b, d, group, amax):
    for j in range(U(d)):
        amax[j] = np.int64(xi[b + j]) & 0x7FFFFFFF
    for tt in range(1, group):
        row = b + U(tt * d)
        for j in range(U(d)):
            amax[j] = max(amax[j], np.int64(xi[row + j]) & 0x7FFFFFFF)


@njit(**_JIT)
def _encode_fp8_channel(x, xi, rows_bh, t, d, quant, group, fmax, mant_bits, bias, payload, scale):
    blocks = quant // group
    amax = np.empty(d, np.int64)
    inv_f = np.empty(d, np.float32)
    for bh in range(rows_bh):
        for tg in range(blocks):
            b = U(bh * t * d + tg * group * d)
            _channel_absmax(xi, b, d, group, amax)
            sb = U((bh * blocks + tg) * d)
            for j in range(d):
                s16 = _f32_to_f16_bits(np.uint32(amax[j]).view(np.float32) / fmax)
                scale[sb + j] = s16
                inv_f[j] = _encode_inverse(s16)
            for tt in range(group):
                row = b + U(tt * d)
                pb = U((bh * quant + tg * group + tt) * d)
                for j in range(U(d)):
                    payload[pb + j] = _fp8_code(x[row + j], inv_f[j], fmax, mant_bits, bias)


@njit(**_JIT)
def _decode_fp8_channel(payload, scale, rows_bh, t, d, quant, group, mant_bits, bias, out):
    blocks = quant // group
    scale_f = np.empty(d, np.float32)
    for bh in range(rows_bh):
        for tg in range(blocks):
            sb = U((bh * blocks + tg) * d)
            for j in range(U(d)):
                scale_f[j] = _f16_bits_to_f32(scale[sb + j])
            for tt in range(group):
                row = U(bh * t * d + (tg * group + tt) * d)
                pb = U((bh * quant + tg * group + tt) * d)
                for j in range(U(d)):
                    out[row + j] = _fp8_bits_to_f32(payload[pb + j], mant_bits, bias) * scale_f[j]


@njit(**_JIT)
def _round_trip_fp8_channel(x, xi, rows_bh, t, d, quant, group, fmax, mant_bits, bias, out):
    blocks = quant // group
    amax = np.empty(d, np.int64)
    inv_f = np.empty(d, np.float32)
    scale_f = np.empty(d, np.float32)
    for bh in range(rows_bh):
        for tg in range(blocks):
            b = U(bh * t * d + tg * group * d)
            _channel_absmax(xi, b, d, group, amax)
            for j in range(d):
                s16 = _f32_to_f16_bits(np.uint32(amax[j]).view(np.float32) / fmax)
                scale_f[j] = _f16_bits_to_f32(s16)
                inv_f[j] = _encode_inverse(s16)
            for tt in range(group):
                row = b + U(tt * d)
                for j in range(U(d)):
                    out[row + j] = (_fp8_round_value(min(max(x[row + j] * inv_f[j], -fmax), fmax), mant_bits, bias)
                                    * scale_f[j])


# ------------------------------------------------------------------ entry points


def _bits16(t: torch.Tensor) -> np.ndarray:
    """An fp16 tensor's storage as a uint16 numpy array (no copy)."""
    return t.view(torch.int16).numpy().view(np.uint16)


def _fp8_bias(fmt: str) -> int:
    return 7 if fmt == "fp8_e4m3" else 15


def _flat_input(x: torch.Tensor):
    """(x as a flat fp32 numpy array, the same memory as int32, BH, T, D); no copy when ``x`` is
    already contiguous fp32."""
    b, h, t, d = x.shape
    xf = x.detach()
    if xf.dtype != torch.float32:
        xf = xf.float()
    if not xf.is_contiguous():
        xf = xf.contiguous()
    flat = xf.numpy().reshape(-1)
    return flat, flat.view(np.int32), b * h, t, d


def encode(x: torch.Tensor, fmt: str, axis: str, group: int, quant: int):
    """``x`` [B, H, T, D] (any float dtype) -> (payload [B, H, quant, D // per_byte] as uint8,
    scale, zero) for the first ``quant`` tokens; ``zero`` is None for fp8."""
    from kvdiag.kernels.quant import INT_BITS

    b, h, t, d = x.shape
    xf, xi, bh, _, _ = _flat_input(x)
    groups_shape = (b, h, quant, d // group) if axis == "token" else (b, h, quant // group, d)
    scale = torch.empty(groups_shape, dtype=torch.float16)
    if fmt in INT_BITS:
        bits = INT_BITS[fmt]
        payload = torch.empty((b, h, quant, d * bits // 8), dtype=torch.uint8)
        zero = torch.empty(groups_shape, dtype=torch.float16)
        kernel = _encode_int_token if axis == "token" else _encode_int_channel
        kernel(xf, xi, bh, t, d, quant, group, bits, payload.numpy().reshape(-1),
               _bits16(scale).reshape(-1), _bits16(zero).reshape(-1))
        return payload, scale, zero
    payload = torch.empty((b, h, quant, d), dtype=torch.uint8)
    kernel = _encode_fp8_token if axis == "token" else _encode_fp8_channel
    kernel(xf, xi, bh, t, d, quant, group, np.float32(FP8_MAX[fmt]), FP8_MANT_BITS[fmt], _fp8_bias(fmt),
           payload.numpy().reshape(-1), _bits16(scale).reshape(-1))
    return payload, scale, None


def decode_into(payload: torch.Tensor, scale: torch.Tensor, zero, fmt: str, axis: str, group: int,
                out: torch.Tensor) -> None:
    """Write x_hat of the quantized tokens (``payload.shape[2]`` of them) into the first tokens
    of ``out`` [B, H, T, D], a contiguous fp32 tensor."""
    from kvdiag.kernels.quant import INT_BITS

    b, h, t, d = out.shape
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("decode_into writes into a contiguous fp32 tensor")
    out1 = out.numpy().reshape(-1)
    quant = payload.shape[2]
    p1 = payload.view(torch.uint8).contiguous().numpy().reshape(-1)
    s1 = _bits16(scale.contiguous()).reshape(-1)
    if fmt in INT_BITS:
        kernel = _decode_int_token if axis == "token" else _decode_int_channel
        kernel(p1, s1, _bits16(zero.contiguous()).reshape(-1), b * h, t, d, quant, group, INT_BITS[fmt], out1)
        return
    kernel = _decode_fp8_token if axis == "token" else _decode_fp8_channel
    kernel(p1, s1, b * h, t, d, quant, group, FP8_MANT_BITS[fmt], _fp8_bias(fmt), out1)


def round_trip_into(x: torch.Tensor, fmt: str, axis: str, group: int, quant: int, out: torch.Tensor) -> None:
    """x_hat of :func:`encode` then :func:`decode_into` for the first ``quant`` tokens of ``x``,
    written into ``out`` (contiguous fp32, shape of ``x``) in one pass, without materialising
    the payload: bit-identical to the two calls (same arithmetic, same order)."""
    from kvdiag.kernels.quant import INT_BITS

    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != x.shape:
        raise ValueError("round_trip_into writes into a contiguous fp32 tensor shaped as x")
    xf, xi, bh, t, d = _flat_input(x)
    out1 = out.numpy().reshape(-1)
    if fmt in INT_BITS:
        kernel = _round_trip_int_token if axis == "token" else _round_trip_int_channel
        kernel(xf, xi, bh, t, d, quant, group, INT_BITS[fmt], out1)
        return
    kernel = _round_trip_fp8_token if axis == "token" else _round_trip_fp8_channel
    kernel(xf, xi, bh, t, d, quant, group, np.float32(FP8_MAX[fmt]), FP8_MANT_BITS[fmt], _fp8_bias(fmt), out1)
