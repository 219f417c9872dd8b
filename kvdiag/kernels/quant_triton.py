"""Triton kernels for :mod:`kvdiag.kernels.quant`: same layout and arithmetic as the torch
reference (fp32 math, fp16 scales, multiply by the fp32 reciprocal of the scale, floor(y + 0.5)
rounding, codes packed low bits first). fp8 values are rounded to the fp8 grid in fp32 (half away
from zero) before the cast, so the cast is exact on every backend; torch rounds half to even, so
the two can differ by one fp8 step at exact ties.

One program quantizes ``ROWS`` tokens of one (batch, head) stream: with the token axis any
``ROWS`` rows, with the channel axis exactly one group of ``G`` tokens. Programs read the input
through its 4-D strides, so the slice in front of the residual window is never copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdiag.kernels.quant import FLOAT_DTYPES, FP8_DTYPES, INT_BITS, QuantizedKV, QuantSpec

TOKEN_ROWS = 64  # rows per program on the token axis


@triton.jit
def _row_offsets(pid, n_rows, H, T, sB, sH, sT, ROWS: tl.constexpr):
    rows = pid * ROWS + tl.arange(0, ROWS)
    ok = rows < n_rows
    r = tl.where(ok, rows, 0).to(tl.int64)
    base = (r // (H * T)) * sB + ((r // T) % H) * sH + (r % T) * sT
    return rows, ok, base


@triton.jit
def _round_fp8(y, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Round fp32 ``y`` to the fp8 grid (MANT mantissa bits, min normal exponent EMIN) in fp32,
    half away from zero, so that the cast to fp8 is exact on every backend."""
    a = tl.abs(y)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), EMIN)
    r = tl.floor(a * tl.exp2(MANT - e) + 0.5) * tl.exp2(e - MANT)
    return tl.where(y < 0, -r, r)


@triton.jit
def _quant_kernel(x_ptr, out_ptr, scale_ptr, zero_ptr, n_rows, H, T, sB, sH, sT, sD,
                  ROWS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PPB: tl.constexpr,
                  BITS: tl.constexpr, CHANNEL: tl.constexpr, FP8: tl.constexpr,
                  FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    pid = tl.program_id(0)
    rows, ok, base = _row_offsets(pid, n_rows, H, T, sB, sH, sT, ROWS)
    DP: tl.constexpr = D // PPB
    NG: tl.constexpr = D // G  # groups per token on the token axis
    QMAX: tl.constexpr = (1 << BITS) - 1
    cols = tl.arange(0, DP)
    mask2 = ok[:, None]
    packed = tl.zeros((ROWS, DP), dtype=tl.int32)
    if CHANNEL:
        for j in tl.static_range(PPB):
            xj = tl.load(x_ptr + base[:, None] + ((cols * PPB + j) * sD)[None, :]).to(tl.float32)
            soff = pid * D + cols * PPB + j
            if FP8:
                s16 = tl.div_rn(tl.max(tl.abs(xj), axis=0), FMAX).to(tl.float16)
                tl.store(scale_ptr + soff, s16)
                s = s16.to(tl.float32)
                inv = tl.div_rn(1.0, tl.where(s > 0, s, 1.0))
                y = tl.minimum(tl.maximum(_round_fp8(xj * inv[None, :], MANT, EMIN), -FMAX), FMAX)
                tl.store(out_ptr + rows[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty))
            else:
                mn = tl.min(xj, axis=0)
                mx = tl.max(xj, axis=0)
                z16 = mn.to(tl.float16)
                s16 = tl.div_rn(mx - mn, QMAX * 1.0).to(tl.float16)
                tl.store(scale_ptr + soff, s16)
                tl.store(zero_ptr + soff, z16)
                s = s16.to(tl.float32)
                inv = tl.div_rn(1.0, tl.where(s > 0, s, 1.0))
                code = tl.floor((xj - z16.to(tl.float32)[None, :]) * inv[None, :] + 0.5)
                code = tl.minimum(tl.maximum(code, 0.0), QMAX * 1.0).to(tl.int32)
                packed = packed | (code << (j * BITS))
    else:
        mn = tl.full((ROWS, NG), float("inf"), tl.float32)
        mx = tl.full((ROWS, NG), float("-inf"), tl.float32)
        for j in tl.static_range(PPB):
            xj = tl.load(x_ptr + base[:, None] + ((cols * PPB + j) * sD)[None, :], mask=mask2, other=0.0)
            xg = tl.reshape(xj.to(tl.float32), (ROWS, NG, G // PPB))
            if FP8:
                mx = tl.maximum(mx, tl.max(tl.abs(xg), axis=2))
            else:
                mn = tl.minimum(mn, tl.min(xg, axis=2))
                mx = tl.maximum(mx, tl.max(xg, axis=2))
        soff = rows[:, None] * NG + tl.arange(0, NG)[None, :]
        if FP8:
            s16 = tl.div_rn(mx, FMAX).to(tl.float16)
        else:
            s16 = tl.div_rn(mx - mn, QMAX * 1.0).to(tl.float16)
            z16 = mn.to(tl.float16)
            tl.store(zero_ptr + soff, z16, mask=mask2)
            zb = tl.reshape(tl.broadcast_to(z16.to(tl.float32)[:, :, None], (ROWS, NG, G // PPB)), (ROWS, DP))
        tl.store(scale_ptr + soff, s16, mask=mask2)
        s = s16.to(tl.float32)
        inv = tl.div_rn(1.0, tl.where(s > 0, s, 1.0))
        ib = tl.reshape(tl.broadcast_to(inv[:, :, None], (ROWS, NG, G // PPB)), (ROWS, DP))
        for j in tl.static_range(PPB):
            xj = tl.load(x_ptr + base[:, None] + ((cols * PPB + j) * sD)[None, :], mask=mask2, other=0.0)
            xj = xj.to(tl.float32)
            if FP8:
                y = tl.minimum(tl.maximum(_round_fp8(xj * ib, MANT, EMIN), -FMAX), FMAX)
                tl.store(out_ptr + rows[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask2)
            else:
                code = tl.floor((xj - zb) * ib + 0.5)
                code = tl.minimum(tl.maximum(code, 0.0), QMAX * 1.0).to(tl.int32)
                packed = packed | (code << (j * BITS))
    if not FP8:
        tl.store(out_ptr + rows[:, None] * DP + cols[None, :], packed.to(tl.uint8), mask=mask2)


@triton.jit
def _dequant_kernel(q_ptr, scale_ptr, zero_ptr, out_ptr, n_rows,
                    ROWS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PPB: tl.constexpr,
                    BITS: tl.constexpr, CHANNEL: tl.constexpr, FP8: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    ok = rows < n_rows
    mask2 = ok[:, None]
    DP: tl.constexpr = D // PPB
    NG: tl.constexpr = D // G
    MASK: tl.constexpr = (1 << BITS) - 1
    cols = tl.arange(0, DP)
    p = tl.load(q_ptr + rows[:, None] * DP + cols[None, :], mask=mask2)
    if FP8:
        p = p.to(tl.float32)
    else:
        p = p.to(tl.int32)
    if not CHANNEL:
        soff = rows[:, None] * NG + tl.arange(0, NG)[None, :]
        s = tl.load(scale_ptr + soff, mask=mask2, other=0.0).to(tl.float32)
        sb = tl.reshape(tl.broadcast_to(s[:, :, None], (ROWS, NG, G // PPB)), (ROWS, DP))
        if not FP8:
            z = tl.load(zero_ptr + soff, mask=mask2, other=0.0).to(tl.float32)
            zb = tl.reshape(tl.broadcast_to(z[:, :, None], (ROWS, NG, G // PPB)), (ROWS, DP))
    for j in tl.static_range(PPB):
        if CHANNEL:
            soff = pid * D + cols * PPB + j
            sb = tl.load(scale_ptr + soff).to(tl.float32)[None, :]
            if not FP8:
                zb = tl.load(zero_ptr + soff).to(tl.float32)[None, :]
        if FP8:
            x = p * sb
        else:
            code = ((p >> (j * BITS)) & MASK).to(tl.float32)
            x = code * sb + zb
        tl.store(out_ptr + rows[:, None] * D + (cols * PPB + j)[None, :],
                 x.to(out_ptr.dtype.element_ty), mask=mask2)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n_rows, H, T, sB, sH, sT, sD, ROWS: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    rows, ok, base = _row_offsets(pid, n_rows, H, T, sB, sH, sT, ROWS)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + base[:, None] + (cols * sD)[None, :], mask=ok[:, None], other=0.0)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :],
             x.to(tl.float32).to(out_ptr.dtype.element_ty), mask=ok[:, None])


def _launch_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    b, h, t, d = x.shape
    out = torch.empty((b, h, t, d), dtype=dtype, device=x.device)
    n_rows = b * h * t
    _cast_kernel[(triton.cdiv(n_rows, TOKEN_ROWS),)](
        x, out, n_rows, h, t, *x.stride(), ROWS=TOKEN_ROWS, D=d)
    return out


def quantize(x: torch.Tensor, spec: QuantSpec, group: int):
    """(payload, scale, zero) for ``x`` = the quantized head of a KV tensor."""
    b, h, t, d = x.shape
    if spec.fmt in FLOAT_DTYPES:
        return _launch_cast(x, FLOAT_DTYPES[spec.fmt]), None, None
    fp8 = spec.fmt in FP8_DTYPES
    bits = 8 if fp8 else INT_BITS[spec.fmt]
    ppb = 8 // bits
    channel = spec.axis == "channel"
    n_rows = b * h * t
    if channel:
        sshape = (b, h, t // group, d)
        rows_per_prog, grid = group, n_rows // group
    else:
        sshape = (b, h, t, d // group)
        rows_per_prog, grid = TOKEN_ROWS, triton.cdiv(n_rows, TOKEN_ROWS)
    scale = torch.empty(sshape, dtype=torch.float16, device=x.device)
    zero = None if fp8 else torch.empty(sshape, dtype=torch.float16, device=x.device)
    out_dtype = FP8_DTYPES[spec.fmt] if fp8 else torch.uint8
    payload = torch.empty((b, h, t, d // ppb), dtype=out_dtype, device=x.device)
    fmax = float(torch.finfo(FP8_DTYPES[spec.fmt]).max) if fp8 else 1.0
    mant, emin = (3, -6) if spec.fmt == "fp8_e4m3" else (2, -14)
    _quant_kernel[(grid,)](
        x, payload, scale, scale if zero is None else zero, n_rows, h, t, *x.stride(),
        ROWS=rows_per_prog, D=d, G=group, PPB=ppb, BITS=bits, CHANNEL=channel, FP8=fp8, FMAX=fmax, MANT=mant, EMIN=emin)
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
    rows_per_prog = q.group_size if channel else TOKEN_ROWS
    _dequant_kernel[(triton.cdiv(n_rows, rows_per_prog),)](
        q.payload, q.scale, q.scale if q.zero is None else q.zero, out, n_rows,
        ROWS=rows_per_prog, D=d, G=q.group_size, PPB=ppb, BITS=bits, CHANNEL=channel, FP8=fp8)
    return out
