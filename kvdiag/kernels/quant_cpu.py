"""Fused CPU kernels (numba) for the grouped formats of :mod:`kvdiag.kernels.quant`.

Same layout and arithmetic as the torch reference, in one pass over the input (encode) and one
over the output (decode) instead of a dozen tensor-wide passes:

- integers: zero = fp16(group min), scale = fp16((max - min) / qmax), code = floor((x - zero) *
  (1 / scale) + 0.5) clamped to [0, qmax], every step in fp32 without fused multiply-add, so
  codes, scales and zeros are bit-identical to the reference; x_hat = code * scale + zero.
- fp8: scale = fp16(absmax / fp8 max); the value x * (1 / scale), clamped to the fp8 range, is
  rounded to the nearest fp8 value (ties to even) by the bit arithmetic of c10's casts.

fp32 <-> fp16 conversions are done on the bits (round to nearest even, subnormals included),
since numba has no half type. Work is split over rows (``axis="token"``) or token groups
(``axis="channel"``) with ``prange`` on as many threads as torch uses. Compiled code is cached
under kvdiag's cache folder (:func:`kvdiag.paths.numba_cache_dir`), never in the package.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each function below is decorated

# no NaN/inf inputs and no care for the sign of zero: lets LLVM vectorize min/max; no
# reassociation, no reciprocal approximation and no contraction into FMA (bit-exactness)
_FAST = {"nnan", "ninf", "nsz"}
# rows (one token of one head) per parallel work item of the token-axis kernels: scratch arrays
# are allocated once per chunk, not once per row
_ROWS_PER_CHUNK = 256
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
    if u >= 0x47800000:  # |f| >= 65536: inf (or nan)
        out = 0x7E00 if u > 0x7F800000 else 0x7C00
    elif u < 0x38800000:  # below fp16's smallest normal: the adder rounds to the subnormal grid
        rounded = np.float32(np.uint32(u).view(np.float32) + np.float32(0.5))
        out = np.int64(rounded.view(np.uint32)) - 0x3F000000
    else:
        odd = (u >> 13) & 1
        out = (u + (0xFFF - (112 << 23)) + odd) >> 13
    return np.uint16(out | sign)


@njit(inline="always", **_JIT)
def _f16_bits_to_f32(h):
    h = np.int64(h)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    if exp == 0:  # zero or subnormal: exact in fp32
        mag = np.float32(np.float32(mant) * np.float32(2.0 ** -24))
        return np.uint32(np.int64(mag.view(np.uint32)) | sign).view(np.float32)
    if exp == 31:
        bits = sign | 0x7F800000 | (mant << 13)
    else:
        bits = sign | ((exp + 112) << 23) | (mant << 13)
    return np.uint32(bits).view(np.float32)


@njit(inline="always", **_JIT)
def _f32_to_fp8_bits(f, mant_bits, bias):
    """fp32 (already clamped to the fp8 range) -> fp8 bits, round to nearest even: c10's
    fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value without their overflow branch."""
    u = np.int64(np.float32(f).view(np.uint32))
    sign = (u >> 24) & 0x80
    u = u & 0x7FFFFFFF
    shift = 23 - mant_bits
    if u < ((128 - bias) << 23):  # below the smallest fp8 normal: round on the subnormal grid
        denorm = (127 - bias + 23 - mant_bits + 1) << 23
        rounded = np.float32(np.uint32(u).view(np.float32) + np.uint32(denorm).view(np.float32))
        out = np.int64(rounded.view(np.uint32)) - denorm
    else:
        odd = (u >> shift) & 1
        out = (u + ((bias - 127) << 23) + ((1 << (shift - 1)) - 1) + odd) >> shift
    return np.uint8((out & 0x7F) | sign)


@njit(inline="always", **_JIT)
def _encode_inverse(s16):
    """fp32 1 / scale used for encoding; a zero scale (constant group) encodes with 1."""
    s = _f16_bits_to_f32(s16)
    return np.float32(1.0) / (s if s > 0 else np.float32(1.0))


# ------------------------------------------------------------------ packing one row of codes


@njit(inline="always", **_JIT)
def _pack_codes(x, zero, inv, qmax, bits, out):
    """codes of ``x`` (one row, per-element ``zero``/``inv``) packed low bits first into ``out``."""
    if bits == 8:
        for j in range(x.shape[0]):
            out[j] = np.uint8(min(max((x[j] - zero[j]) * inv[j] + np.float32(0.5), np.float32(0.0)), qmax))
    elif bits == 4:
        for k in range(out.shape[0]):
            c0 = np.uint8(min(max((x[2 * k] - zero[2 * k]) * inv[2 * k] + np.float32(0.5), np.float32(0.0)), qmax))
            c1 = np.uint8(min(max((x[2 * k + 1] - zero[2 * k + 1]) * inv[2 * k + 1] + np.float32(0.5), np.float32(0.0)), qmax))
            out[k] = c0 | (c1 << np.uint8(4))
    else:
        for k in range(out.shape[0]):
            acc = np.uint8(0)
            for i in range(4):
                j = 4 * k + i
                c = np.uint8(min(max((x[j] - zero[j]) * inv[j] + np.float32(0.5), np.float32(0.0)), qmax))
                acc |= c << np.uint8(2 * i)
            out[k] = acc


@njit(inline="always", **_JIT)
def _pack_codes_one_group(x, zero, inv, qmax, bits, out):
    """As :func:`_pack_codes` with one ``zero``/``inv`` for the whole row (axis="token")."""
    if bits == 8:
        for j in range(x.shape[0]):
            out[j] = np.uint8(min(max((x[j] - zero) * inv + np.float32(0.5), np.float32(0.0)), qmax))
    elif bits == 4:
        for k in range(out.shape[0]):
            c0 = np.uint8(min(max((x[2 * k] - zero) * inv + np.float32(0.5), np.float32(0.0)), qmax))
            c1 = np.uint8(min(max((x[2 * k + 1] - zero) * inv + np.float32(0.5), np.float32(0.0)), qmax))
            out[k] = c0 | (c1 << np.uint8(4))
    else:
        for k in range(out.shape[0]):
            acc = np.uint8(0)
            for i in range(4):
                c = np.uint8(min(max((x[4 * k + i] - zero) * inv + np.float32(0.5), np.float32(0.0)), qmax))
                acc |= c << np.uint8(2 * i)
            out[k] = acc


@njit(inline="always", **_JIT)
def _unpack_codes_one_group(packed, scale, zero, bits, out):
    """As :func:`_unpack_codes` with one ``scale``/``zero`` for the whole row (axis="token")."""
    if bits == 8:
        for j in range(out.shape[0]):
            out[j] = np.float32(packed[j]) * scale + zero
    elif bits == 4:
        for k in range(packed.shape[0]):
            b = packed[k]
            out[2 * k] = np.float32(b & np.uint8(15)) * scale + zero
            out[2 * k + 1] = np.float32(b >> np.uint8(4)) * scale + zero
    else:
        for k in range(packed.shape[0]):
            b = packed[k]
            for i in range(4):
                out[4 * k + i] = np.float32((b >> np.uint8(2 * i)) & np.uint8(3)) * scale + zero


@njit(inline="always", **_JIT)
def _unpack_codes(packed, scale, zero, bits, out):
    """x_hat = code * scale + zero for one row (per-element ``scale``/``zero``)."""
    if bits == 8:
        for j in range(out.shape[0]):
            out[j] = np.float32(packed[j]) * scale[j] + zero[j]
    elif bits == 4:
        for k in range(packed.shape[0]):
            b = packed[k]
            out[2 * k] = np.float32(b & np.uint8(15)) * scale[2 * k] + zero[2 * k]
            out[2 * k + 1] = np.float32(b >> np.uint8(4)) * scale[2 * k + 1] + zero[2 * k + 1]
    else:
        for k in range(packed.shape[0]):
            b = packed[k]
            for i in range(4):
                j = 4 * k + i
                out[j] = np.float32((b >> np.uint8(2 * i)) & np.uint8(3)) * scale[j] + zero[j]


# ------------------------------------------------------------------ integer kernels


@njit(parallel=True, **_JIT)
def _encode_int_token(x, quant, group, bits, payload, scale, zero):
    """x [BH, T, D] fp32 -> payload [BH, quant, D // per_byte], scale/zero bits [BH, quant, D // group]."""
    rows_bh, _, d = x.shape
    per_byte = 8 // bits
    qmax = np.float32((1 << bits) - 1)
    rows = rows_bh * quant
    for chunk in prange((rows + _ROWS_PER_CHUNK - 1) // _ROWS_PER_CHUNK):
        for r in range(chunk * _ROWS_PER_CHUNK, min(rows, (chunk + 1) * _ROWS_PER_CHUNK)):
            bh, t = r // quant, r % quant
            for g in range(d // group):
                xs = x[bh, t, g * group:(g + 1) * group]
                lo, hi = xs[0], xs[0]
                for j in range(group):
                    lo = min(lo, xs[j])
                    hi = max(hi, xs[j])
                z16 = _f32_to_f16_bits(lo)
                s16 = _f32_to_f16_bits((hi - lo) / qmax)
                zero[bh, t, g], scale[bh, t, g] = z16, s16
                _pack_codes_one_group(xs, _f16_bits_to_f32(z16), _encode_inverse(s16), qmax, bits,
                            payload[bh, t, g * group // per_byte:(g + 1) * group // per_byte])


@njit(parallel=True, **_JIT)
def _decode_int_token(payload, scale, zero, group, bits, out):
    """Inverse of :func:`_encode_int_token` into the first ``quant`` tokens of ``out`` [BH, T, D]."""
    rows_bh, quant, d = payload.shape[0], payload.shape[1], out.shape[2]
    per_byte = 8 // bits
    rows = rows_bh * quant
    for chunk in prange((rows + _ROWS_PER_CHUNK - 1) // _ROWS_PER_CHUNK):
        for r in range(chunk * _ROWS_PER_CHUNK, min(rows, (chunk + 1) * _ROWS_PER_CHUNK)):
            bh, t = r // quant, r % quant
            for g in range(d // group):
                _unpack_codes_one_group(payload[bh, t, g * group // per_byte:(g + 1) * group // per_byte],
                                        _f16_bits_to_f32(scale[bh, t, g]), _f16_bits_to_f32(zero[bh, t, g]),
                                        bits, out[bh, t, g * group:(g + 1) * group])


@njit(parallel=True, **_JIT)
def _encode_int_channel(x, quant, group, bits, payload, scale, zero):
    """Groups of ``group`` tokens per channel: scale/zero bits [BH, quant // group, D]."""
    rows_bh, _, d = x.shape
    blocks = quant // group
    qmax = np.float32((1 << bits) - 1)
    for r in prange(rows_bh * blocks):
        bh, tg = r // blocks, r % blocks
        xb = x[bh, tg * group:(tg + 1) * group]
        lo = xb[0].copy()
        hi = xb[0].copy()
        for t in range(1, group):
            for j in range(d):
                lo[j] = min(lo[j], xb[t, j])
                hi[j] = max(hi[j], xb[t, j])
        zero_f = np.empty(d, np.float32)
        inv_f = np.empty(d, np.float32)
        for j in range(d):
            z16 = _f32_to_f16_bits(lo[j])
            s16 = _f32_to_f16_bits((hi[j] - lo[j]) / qmax)
            zero[bh, tg, j], scale[bh, tg, j] = z16, s16
            zero_f[j] = _f16_bits_to_f32(z16)
            inv_f[j] = _encode_inverse(s16)
        for t in range(group):
            _pack_codes(xb[t], zero_f, inv_f, qmax, bits, payload[bh, tg * group + t])


@njit(parallel=True, **_JIT)
def _decode_int_channel(payload, scale, zero, group, bits, out):
    rows_bh, quant, d = payload.shape[0], payload.shape[1], out.shape[2]
    blocks = quant // group
    for r in prange(rows_bh * blocks):
        bh, tg = r // blocks, r % blocks
        scale_f = np.empty(d, np.float32)
        zero_f = np.empty(d, np.float32)
        for j in range(d):
            scale_f[j] = _f16_bits_to_f32(scale[bh, tg, j])
            zero_f[j] = _f16_bits_to_f32(zero[bh, tg, j])
        for t in range(tg * group, (tg + 1) * group):
            _unpack_codes(payload[bh, t], scale_f, zero_f, bits, out[bh, t])


# ------------------------------------------------------------------ fp8 kernels


@njit(inline="always", **_JIT)
def _encode_fp8_row(x, inv, fmax, mant_bits, bias, out):
    for j in range(x.shape[0]):
        out[j] = _f32_to_fp8_bits(min(max(x[j] * inv[j], -fmax), fmax), mant_bits, bias)


@njit(parallel=True, **_JIT)
def _encode_fp8_token(x, quant, group, fmax, mant_bits, bias, payload, scale):
    rows_bh, _, d = x.shape
    rows = rows_bh * quant
    for chunk in prange((rows + _ROWS_PER_CHUNK - 1) // _ROWS_PER_CHUNK):
        inv_f = np.empty(group, np.float32)
        for r in range(chunk * _ROWS_PER_CHUNK, min(rows, (chunk + 1) * _ROWS_PER_CHUNK)):
            bh, t = r // quant, r % quant
            for g in range(d // group):
                xs = x[bh, t, g * group:(g + 1) * group]
                amax = np.float32(0.0)
                for j in range(group):
                    amax = max(amax, abs(xs[j]))
                s16 = _f32_to_f16_bits(amax / fmax)
                scale[bh, t, g] = s16
                inv_f[:] = _encode_inverse(s16)
                _encode_fp8_row(xs, inv_f, fmax, mant_bits, bias, payload[bh, t, g * group:(g + 1) * group])


@njit(parallel=True, **_JIT)
def _encode_fp8_channel(x, quant, group, fmax, mant_bits, bias, payload, scale):
    rows_bh, _, d = x.shape
    blocks = quant // group
    for r in prange(rows_bh * blocks):
        bh, tg = r // blocks, r % blocks
        xb = x[bh, tg * group:(tg + 1) * group]
        amax = np.zeros(d, np.float32)
        for t in range(group):
            for j in range(d):
                amax[j] = max(amax[j], abs(xb[t, j]))
        inv_f = np.empty(d, np.float32)
        for j in range(d):
            s16 = _f32_to_f16_bits(amax[j] / fmax)
            scale[bh, tg, j] = s16
            inv_f[j] = _encode_inverse(s16)
        for t in range(group):
            _encode_fp8_row(xb[t], inv_f, fmax, mant_bits, bias, payload[bh, tg * group + t])


@njit(parallel=True, **_JIT)
def _decode_fp8_token(payload, scale, group, table, out):
    rows_bh, quant, d = payload.shape[0], payload.shape[1], out.shape[2]
    for r in prange(rows_bh * quant):
        bh, t = r // quant, r % quant
        for g in range(d // group):
            s = _f16_bits_to_f32(scale[bh, t, g])
            for j in range(g * group, (g + 1) * group):
                out[bh, t, j] = table[payload[bh, t, j]] * s


@njit(parallel=True, **_JIT)
def _decode_fp8_channel(payload, scale, group, table, out):
    rows_bh, quant, d = payload.shape[0], payload.shape[1], out.shape[2]
    blocks = quant // group
    for r in prange(rows_bh * blocks):
        bh, tg = r // blocks, r % blocks
        scale_f = np.empty(d, np.float32)
        for j in range(d):
            scale_f[j] = _f16_bits_to_f32(scale[bh, tg, j])
        for t in range(tg * group, (tg + 1) * group):
            for j in range(d):
                out[bh, t, j] = table[payload[bh, t, j]] * scale_f[j]


# ------------------------------------------------------------------ entry points


def _use_torch_threads() -> None:
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


def _bits16(t: torch.Tensor) -> np.ndarray:
    """An fp16 tensor's storage as a uint16 numpy array (no copy)."""
    return t.view(torch.int16).numpy().view(np.uint16)


def _fp8_table(fmt: str) -> np.ndarray:
    """fp32 value of every fp8 bit pattern (256 entries)."""
    from kvdiag.kernels.quant import FP8_DTYPES

    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPES[fmt]).float().numpy()


_FP8_TABLES: dict[str, np.ndarray] = {}


def _fp8_bias(fmt: str) -> int:
    return 7 if fmt == "fp8_e4m3" else 15


def encode(x: torch.Tensor, fmt: str, axis: str, group: int, quant: int):
    """``x`` [B, H, T, D] (any float dtype) -> (payload [B, H, quant, D // per_byte] as uint8,
    scale, zero) for the first ``quant`` tokens; ``zero`` is None for fp8."""
    from kvdiag.kernels.quant import INT_BITS

    b, h, t, d = x.shape
    x3 = x.detach().float().contiguous().reshape(b * h, t, d).numpy()
    _use_torch_threads()
    if fmt in INT_BITS:
        bits = INT_BITS[fmt]
        payload = torch.empty((b, h, quant, d * bits // 8), dtype=torch.uint8)
        groups_shape = (b, h, quant, d // group) if axis == "token" else (b, h, quant // group, d)
        scale = torch.empty(groups_shape, dtype=torch.float16)
        zero = torch.empty(groups_shape, dtype=torch.float16)
        kernel = _encode_int_token if axis == "token" else _encode_int_channel
        kernel(x3, quant, group, bits, payload.numpy().reshape(b * h, quant, -1),
               _bits16(scale).reshape(b * h, *groups_shape[2:]), _bits16(zero).reshape(b * h, *groups_shape[2:]))
        return payload, scale, zero
    payload = torch.empty((b, h, quant, d), dtype=torch.uint8)
    groups_shape = (b, h, quant, d // group) if axis == "token" else (b, h, quant // group, d)
    scale = torch.empty(groups_shape, dtype=torch.float16)
    kernel = _encode_fp8_token if axis == "token" else _encode_fp8_channel
    kernel(x3, quant, group, np.float32(FP8_MAX[fmt]), FP8_MANT_BITS[fmt], _fp8_bias(fmt),
           payload.numpy().reshape(b * h, quant, d), _bits16(scale).reshape(b * h, *groups_shape[2:]))
    return payload, scale, None


def decode_into(payload: torch.Tensor, scale: torch.Tensor, zero, fmt: str, axis: str, group: int,
                out: torch.Tensor) -> None:
    """Write x_hat of the quantized tokens (``payload.shape[2]`` of them) into the first tokens
    of ``out`` [B, H, T, D], a contiguous fp32 tensor."""
    from kvdiag.kernels.quant import INT_BITS

    b, h, t, d = out.shape
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("decode_into writes into a contiguous fp32 tensor")
    out3 = out.numpy().reshape(b * h, t, d)
    p3 = payload.view(torch.uint8).numpy().reshape(b * h, payload.shape[2], -1)
    s3 = _bits16(scale).reshape(b * h, *scale.shape[2:])
    _use_torch_threads()
    if fmt in INT_BITS:
        kernel = _decode_int_token if axis == "token" else _decode_int_channel
        kernel(p3, s3, _bits16(zero).reshape(b * h, *zero.shape[2:]), group, INT_BITS[fmt], out3)
        return
    table = _FP8_TABLES.get(fmt)
    if table is None:
        table = _FP8_TABLES[fmt] = _fp8_table(fmt)
    kernel = _decode_fp8_token if axis == "token" else _decode_fp8_channel
    kernel(p3, s3, group, table, out3)
