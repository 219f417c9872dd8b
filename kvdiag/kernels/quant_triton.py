"""Triton kernels for :mod:`kvdiag.kernels.quant`: same layout and arithmetic as the torch
reference (fp32 math, fp16 scales, multiply by the fp32 reciprocal of the scale, floor(y + 0.5)
rounding, codes packed low bits first). fp8 values are rounded to the fp8 grid in fp32 (half away
from zero) before the cast, so the cast is exact on every backend; torch rounds half to even, so
the two can differ by one fp8 step at exact ties.

One quantizing program takes ``ROWS`` consecutive tokens (rows of ``head_dim`` values) of one
(batch, head) stream (grid: streams x token blocks, so no per-token division): up to TOKEN_ROWS,
or on the channel axis whole groups of ``G`` tokens, up to CHANNEL_ROWS or one group (the
quantized tokens are a multiple of ``G``). It reads the input through its 4-D strides, so the
slice in front of the residual window is never copied. Dequantizing programs take up to
TOKEN_ROWS rows of the contiguous payload (whole groups on the channel axis). Every program loads
and stores whole rows, (ROWS, D) values and (ROWS, D // per_byte) bytes, and packs or unpacks the
codes of a byte in registers (reshape + split / join), so each access is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdiag.kernels.quant import FLOAT_DTYPES, FP8_DTYPES, INT_BITS, QuantizedKV, QuantSpec

TOKEN_ROWS = 64  # tokens per program, at most
CHANNEL_ROWS = 32  # tokens per program quantizing along the channel axis (at least one group)
THREAD_VALUES = 64  # values per thread: warps = tile values / (32 * THREAD_VALUES), 1 to 8


@triton.jit
def _stream_tile(H, T, sB, sH, sT, ROWS: tl.constexpr):
    """Program (stream, block) = tokens block * ROWS + [0, ROWS) of (batch, head) stream
    ``program_id(0)``: (first output row, int64; local token index; token < T; int64 input offset
    of each token), so no per-token division is needed."""
    bh = tl.program_id(0)
    t0 = tl.program_id(1) * ROWS
    t = tl.arange(0, ROWS)
    ok = t0 + t < T
    base = (bh // H).to(tl.int64) * sB + (bh % H).to(tl.int64) * sH + (t0 + t).to(tl.int64) * sT
    return bh.to(tl.int64) * T + t0, t, ok, base


@triton.jit
def _round_fp8(y, FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, SUB_UP: tl.constexpr,
               SUB_DN: tl.constexpr):
    """``y`` (fp32) rounded to the fp8 grid (MANT mantissa bits, min normal exponent EMIN) in fp32,
    half away from zero, and clamped to [-FMAX, FMAX], so that the cast to fp8 is exact on every
    backend. Normal magnitudes: add half a step to the bits and clear the dropped mantissa bits (a
    carry moves to the next binade); below 2**EMIN the step is fixed, SUB_DN = 2**(EMIN - MANT) =
    1 / SUB_UP. The sign bit is put back last (so -0.0 stays -0.0, as in torch)."""
    SH: tl.constexpr = 23 - MANT
    ybits = y.to(tl.uint32, bitcast=True)
    bits = ybits & 0x7FFFFFFF
    a = bits.to(tl.float32, bitcast=True)
    normal = ((bits + (1 << (SH - 1))) >> SH << SH).to(tl.float32, bitcast=True)
    sub = tl.floor(a * SUB_UP + 0.5) * SUB_DN
    r = tl.minimum(tl.where(bits < ((127 + EMIN) << 23), sub, normal), FMAX)
    return (r.to(tl.uint32, bitcast=True) | (ybits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _pack(codes, ROWS: tl.constexpr, D: tl.constexpr, PPB: tl.constexpr, BITS: tl.constexpr):
    """int32 codes (ROWS, D) -> (ROWS, D // PPB), value d at bits (d % PPB) * BITS of byte
    d // PPB; the tile is split in registers, so the caller loads and stores it contiguously."""
    DP: tl.constexpr = D // PPB
    if PPB == 1:
        packed = codes
    elif PPB == 2:
        c0, c1 = tl.split(tl.reshape(codes, (ROWS, DP, 2)))
        packed = c0 | (c1 << BITS)
    else:  # 4 per byte: j = 2 * j1 + j0, split j0 first
        e0, e1 = tl.split(tl.reshape(codes, (ROWS, DP, 2, 2)))
        c0, c2 = tl.split(e0)
        c1, c3 = tl.split(e1)
        packed = c0 | (c1 << BITS) | (c2 << (2 * BITS)) | (c3 << (3 * BITS))
    return packed


@triton.jit
def _unpack(p, ROWS: tl.constexpr, D: tl.constexpr, PPB: tl.constexpr, BITS: tl.constexpr):
    """int32 bytes (ROWS, D // PPB) -> int32 codes (ROWS, D), the inverse of :func:`_pack`."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if PPB == 1:
        codes = p
    elif PPB == 2:
        codes = tl.reshape(tl.join(p & MASK, p >> BITS), (ROWS, D))
    else:  # join j1 inside j0 -> [row, byte, j1, j0], i.e. d = 4 * byte + 2 * j1 + j0
        c0 = p & MASK
        c1 = (p >> BITS) & MASK
        c2 = (p >> (2 * BITS)) & MASK
        c3 = p >> (3 * BITS)
        codes = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (ROWS, D))
    return codes


@triton.jit
def _quant_kernel(x_ptr, out_ptr, scale_ptr, zero_ptr, H, T, sB, sH, sT, sD,
                  ROWS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PPB: tl.constexpr,
                  BITS: tl.constexpr, CHANNEL: tl.constexpr, FP8: tl.constexpr,
                  FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
                  SUB_UP: tl.constexpr, SUB_DN: tl.constexpr):
    """One tile of rows quantized in registers (:func:`quantize`'s formats). Long: a Triton
    kernel is one program; its steps stay in registers only within it."""
    row0, t, ok, base = _stream_tile(H, T, sB, sH, sT, ROWS)
    DP: tl.constexpr = D // PPB
    QMAX: tl.constexpr = (1 << BITS) - 1
    cols = tl.arange(0, D)
    mask2 = ok[:, None]
    # one contiguous (ROWS, D) tile, viewed as groups: (groups, G, D) or (ROWS, groups, G)
    x = tl.load(x_ptr + base[:, None] + (cols * sD)[None, :], mask=mask2, other=0.0).to(tl.float32)
    if CHANNEL:
        GP: tl.constexpr = ROWS // G  # whole groups of G tokens per program
        xg = tl.reshape(x, (GP, G, D))
        grp = tl.arange(0, GP)
        soff = grp[:, None] * D + cols[None, :]  # from scale row row0 // G
        smask = (tl.program_id(1) * ROWS + grp * G < T)[:, None]  # T is a multiple of G
        sptr = scale_ptr + row0 // G * D
        zptr = zero_ptr + row0 // G * D
        if FP8:
            mx = tl.max(tl.abs(xg), axis=1)
        else:
            mn = tl.min(xg, axis=1)
            mx = tl.max(xg, axis=1)
    else:
        NG: tl.constexpr = D // G  # groups per token
        xg = tl.reshape(x, (ROWS, NG, G))
        soff = t[:, None] * NG + tl.arange(0, NG)[None, :]
        smask = mask2
        sptr = scale_ptr + row0 * NG
        zptr = zero_ptr + row0 * NG
        if FP8:
            mx = tl.max(tl.abs(xg), axis=2)
        else:
            mn = tl.min(xg, axis=2)
            mx = tl.max(xg, axis=2)
    if FP8:
        s16 = tl.div_rn(mx, FMAX).to(tl.float16)
    else:
        s16 = tl.div_rn(mx - mn, QMAX * 1.0).to(tl.float16)
        z16 = mn.to(tl.float16)
        tl.store(zptr + soff, z16, mask=smask)
    tl.store(sptr + soff, s16, mask=smask)
    s = s16.to(tl.float32)
    inv = tl.div_rn(1.0, tl.where(s > 0, s, 1.0))
    if CHANNEL:
        ib = inv[:, None, :]
    else:
        ib = inv[:, :, None]
    if FP8:
        y = _round_fp8(xg * ib, FMAX, MANT, EMIN, SUB_UP, SUB_DN)
        payload = tl.reshape(y, (ROWS, D)).to(out_ptr.dtype.element_ty)
    else:
        if CHANNEL:
            zb = z16.to(tl.float32)[:, None, :]
        else:
            zb = z16.to(tl.float32)[:, :, None]
        # floor(y + 0.5) clamped to [0, QMAX]: after the clamp the value is >= 0, so the
        # truncating cast is the floor (as in the torch reference)
        code = tl.minimum(tl.maximum((xg - zb) * ib + 0.5, 0.0), QMAX * 1.0).to(tl.int32)
        payload = _pack(tl.reshape(code, (ROWS, D)), ROWS, D, PPB, BITS).to(tl.uint8)
    tl.store(out_ptr + row0 * DP + t[:, None] * DP + tl.arange(0, DP)[None, :], payload, mask=mask2)


@triton.jit
def _dequant_kernel(q_ptr, scale_ptr, zero_ptr, out_ptr, n_rows,
                    ROWS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PPB: tl.constexpr,
                    BITS: tl.constexpr, CHANNEL: tl.constexpr, FP8: tl.constexpr):
    row0 = tl.program_id(0).to(tl.int64) * ROWS  # rows = tokens of all streams, in order
    t = tl.arange(0, ROWS)
    mask2 = (row0 + t < n_rows)[:, None]
    DP: tl.constexpr = D // PPB
    cols = tl.arange(0, D)
    p = tl.load(q_ptr + row0 * DP + t[:, None] * DP + tl.arange(0, DP)[None, :], mask=mask2)
    if FP8:
        c = p.to(tl.float32)
    else:
        c = _unpack(p.to(tl.int32), ROWS, D, PPB, BITS).to(tl.float32)
    if CHANNEL:
        GP: tl.constexpr = ROWS // G  # a stream's tokens are a multiple of G: groups align
        cg = tl.reshape(c, (GP, G, D))
        grp = tl.arange(0, GP)
        soff = row0 // G * D + grp[:, None] * D + cols[None, :]
        smask = (row0 + grp * G < n_rows)[:, None]
        sb = tl.load(scale_ptr + soff, mask=smask, other=0.0).to(tl.float32)[:, None, :]
        if not FP8:
            zb = tl.load(zero_ptr + soff, mask=smask, other=0.0).to(tl.float32)[:, None, :]
    else:
        NG: tl.constexpr = D // G
        cg = tl.reshape(c, (ROWS, NG, G))
        soff = row0 * NG + t[:, None] * NG + tl.arange(0, NG)[None, :]
        sb = tl.load(scale_ptr + soff, mask=mask2, other=0.0).to(tl.float32)[:, :, None]
        if not FP8:
            zb = tl.load(zero_ptr + soff, mask=mask2, other=0.0).to(tl.float32)[:, :, None]
    if FP8:
        x = cg * sb
    else:
        x = cg * sb + zb
    tl.store(out_ptr + row0 * D + t[:, None] * D + cols[None, :],
             tl.reshape(x, (ROWS, D)).to(out_ptr.dtype.element_ty), mask=mask2)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, H, T, sB, sH, sT, sD, ROWS: tl.constexpr, D: tl.constexpr):
    row0, t, ok, base = _stream_tile(H, T, sB, sH, sT, ROWS)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + base[:, None] + (cols * sD)[None, :], mask=ok[:, None], other=0.0)
    tl.store(out_ptr + row0 * D + t[:, None] * D + cols[None, :],
             x.to(tl.float32).to(out_ptr.dtype.element_ty), mask=ok[:, None])


def _launch_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    b, h, t, d = x.shape
    out = torch.empty((b, h, t, d), dtype=dtype, device=x.device)
    rows, warps = _tile(t, d, TOKEN_ROWS)
    _cast_kernel[(b * h, triton.cdiv(t, rows))](x, out, h, t, *x.stride(), ROWS=rows, D=d, num_warps=warps)
    return out


def _tile(tokens: int, head_dim: int, most: int, group: int = 1) -> tuple[int, int]:
    """(tokens per program, warps): whole groups of ``group`` tokens, at most ``most`` tokens
    unless one group is more, no more than the next power of two of ``tokens``."""
    rows = group * min(max(1, most // group), triton.next_power_of_2(max(1, tokens // group)))
    return rows, min(8, max(1, rows * head_dim // (32 * THREAD_VALUES)))


def quantize(x: torch.Tensor, spec: QuantSpec, group: int):
    """(payload, scale, zero) for ``x`` = the quantized head of a KV tensor."""
    b, h, t, d = x.shape
    if spec.fmt in FLOAT_DTYPES:
        return _launch_cast(x, FLOAT_DTYPES[spec.fmt]), None, None
    fp8 = spec.fmt in FP8_DTYPES
    bits = 8 if fp8 else INT_BITS[spec.fmt]
    ppb = 8 // bits
    channel = spec.axis == "channel"
    sshape = (b, h, t // group, d) if channel else (b, h, t, d // group)
    rows, warps = _tile(t, d, CHANNEL_ROWS, group) if channel else _tile(t, d, TOKEN_ROWS)
    scale = torch.empty(sshape, dtype=torch.float16, device=x.device)
    zero = None if fp8 else torch.empty(sshape, dtype=torch.float16, device=x.device)
    out_dtype = FP8_DTYPES[spec.fmt] if fp8 else torch.uint8
    payload = torch.empty((b, h, t, d // ppb), dtype=out_dtype, device=x.device)
    fmax = float(torch.finfo(FP8_DTYPES[spec.fmt]).max) if fp8 else 1.0
    mant, emin = (3, -6) if spec.fmt == "fp8_e4m3" else (2, -14)
    _quant_kernel[(b * h, triton.cdiv(t, rows))](
        x, payload, scale, scale if zero is None else zero, h, t, *x.stride(),
        ROWS=rows, D=d, G=group, PPB=ppb, BITS=bits, CHANNEL=channel, FP8=fp8, FMAX=fmax, MANT=mant,
        EMIN=emin, SUB_UP=2.0 ** (mant - emin), SUB_DN=2.0 ** (emin - mant), num_warps=warps)
    return payload, scale, zero


def dequantize(q: QuantizedKV) -> torch.Tensor:
    """The quantized head reconstructed, [B, H, quant_tokens, D] in the original dtype."""
    b, h, _, d = q.shape
    t = q.quant_tokens
    spec = q.spec
    if spec.fmt in FLOAT_DTYPES:
        return _launch_cast(q.payload, q.dtype)
    fp8 = spec.fmt in FP8_DTYPES
    bits = 8 if fp8 else INT_BITS[spec.fmt]
    ppb = 8 // bits
    channel = spec.axis == "channel"
    n_rows = b * h * t
    out = torch.empty((b, h, t, d), dtype=q.dtype, device=q.payload.device)
    rows, warps = _tile(n_rows, d, TOKEN_ROWS, q.group_size if channel else 1)  # rows span streams
    _dequant_kernel[(triton.cdiv(n_rows, rows),)](
        q.payload, q.scale, q.scale if q.zero is None else q.zero, out, n_rows,
        ROWS=rows, D=d, G=q.group_size, PPB=ppb, BITS=bits, CHANNEL=channel, FP8=fp8, num_warps=warps)
    return out
