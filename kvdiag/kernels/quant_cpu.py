"""Fused CPU kernels for the grouped formats of :mod:`kvdiag.kernels.quant` (int8/int4/int2, fp8
e4m3/e5m2, per token or per channel): encode in one pass over the input, decode in one pass
over the output, and :func:`round_trip_into`, the two in one pass that never builds the payload
(what an error measurement needs). Codes, scales, zeros and x_hat are bit-identical to the torch
reference.

The kernels live in :mod:`kvdiag.kernels.quant_simd` (LLVM vector code for a block of 16 token
groups, or of one channel group's tokens across the head_dim, and the numba loops that walk the
tensor in those blocks, compiled per format, group size and head_dim on first use and cached
under kvdiag's cache folder, :func:`kvdiag.paths.numba_cache_dir`, never in the package); this
module hands them the tensors as flat arrays. Shapes the blocks do not cover
(:func:`supports`: groups of fewer than 16 values along a token, or a head_dim that is not a
multiple of 16 per channel) stay on the torch reference. The kernels are serial: one layer's K or
V is 3 MiB at 4k tokens on the embedded model, and the machine's other cores run the model.
"""

from __future__ import annotations

import numpy as np
import torch

from kvdiag.kernels import quant_simd
from kvdiag.kernels.quant import INT_BITS
from kvdiag.kernels.quant_simd import LANES

FP8_MANT_BITS = {"fp8_e4m3": 3, "fp8_e5m2": 2}


def supports(axis: str, group: int, head_dim: int) -> bool:
    """Whether the vector kernels cover this layout: per token, groups of a multiple of 16
    values; per channel, a head_dim that is a multiple of 16."""
    if axis == "token":
        return group % LANES == 0
    return head_dim % LANES == 0


def _kernels(fmt: str, axis: str, group: int, head_dim: int):
    """(round_trip, encode, decode) for this format, axis, group size and head_dim."""
    kind = INT_BITS[fmt] if fmt in INT_BITS else -FP8_MANT_BITS[fmt]
    if axis == "token":
        return quant_simd.token_kernels(kind, group)
    return quant_simd.channel_kernels(kind, group, head_dim)


_NO_ZEROS = np.zeros(1, np.uint16)  # fp8 stores no zeros; the kernels never touch this


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


def _fp16_array(shape) -> tuple[np.ndarray, torch.Tensor]:
    """A new fp16 tensor and its storage as a flat uint16 numpy array (allocated in numpy: a
    third of the cost of torch's views for the small tensors of a decode step)."""
    bits = np.empty(shape, np.int16)
    return bits.reshape(-1).view(np.uint16), torch.from_numpy(bits).view(torch.float16)


def encode(x: torch.Tensor, fmt: str, axis: str, group: int, quant: int):
    """``x`` [B, H, T, D] (any float dtype) -> (payload [B, H, quant, D // per_byte] as uint8,
    scale, zero) for the first ``quant`` tokens; ``zero`` is None for fp8."""
    b, h, t, d = x.shape
    _check(axis, group, d)
    xf, rows, _, _ = _flat_input(x)
    groups_shape = (b, h, quant, d // group) if axis == "token" else (b, h, quant // group, d)
    scale_bits, scale = _fp16_array(groups_shape)
    per_byte = 8 // INT_BITS.get(fmt, 8)
    payload = np.empty((b, h, quant, d // per_byte), np.uint8)
    zero_bits, zero = _fp16_array(groups_shape) if fmt in INT_BITS else (_NO_ZEROS, None)
    _kernels(fmt, axis, group, d)[1](xf, rows, t, d, quant, payload.reshape(-1), scale_bits, zero_bits)
    return torch.from_numpy(payload), scale, zero


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
    zero_bits = _bits16(zero.contiguous()) if zero is not None else _NO_ZEROS
    _kernels(fmt, axis, group, d)[2](p1, _bits16(scale.contiguous()), zero_bits, b * h, t, d, quant, out1)


def round_trip_into(x: torch.Tensor, fmt: str, axis: str, group: int, quant: int, out: torch.Tensor) -> None:
    """x_hat of :func:`encode` then :func:`decode_into` for the first ``quant`` tokens of ``x``,
    written into ``out`` (contiguous fp32, shape of ``x``) in one pass, without materialising
    the payload: bit-identical to the two calls (same arithmetic, same order)."""
    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != x.shape:
        raise ValueError("round_trip_into writes into a contiguous fp32 tensor shaped as x")
    _check(axis, group, x.shape[-1])
    xf, rows, t, d = _flat_input(x)
    _kernels(fmt, axis, group, d)[0](xf, rows, t, d, quant, out.numpy().reshape(-1))
