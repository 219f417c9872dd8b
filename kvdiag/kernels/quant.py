"""Quantized KV tensors: fp16, bf16, fp8 (e4m3, e5m2) and packed int8/int4/int2.

A KV tensor is ``[batch, kv_heads, tokens, head_dim]``. Integer formats are asymmetric and
group-wise: each group of ``group_size`` values gets an fp16 ``scale`` and an fp16 ``zero``
(the group minimum); code = floor((x - zero) * (1 / scale) + 0.5) clamped to [0, 2**bits - 1];
x_hat = code * scale + zero. fp8 is symmetric and group-wise: one fp16 scale = absmax / fp8 max
per group. Groups run either along ``head_dim`` within one token (``axis="token"``, KIVI's value
layout) or along ``tokens`` within one channel (``axis="channel"``, KIVI's key layout). The
``residual_tokens`` most recent tokens stay in the original precision; with ``axis="channel"``
the tokens that do not fill a whole group stay there too (as in KIVI).

Codes are packed along ``head_dim``: value ``d`` sits in byte ``d // per_byte`` at bit
``(d % per_byte) * bits`` (low bits first). :func:`QuantizedKV.nbytes` counts every tensor that
is stored (payload, scales, zeros, residual), so ``ratio`` = original bytes / stored bytes is real.

Three implementations with the same layout and arithmetic (Triton rounds to the fp8 grid in
fp32 before its cast): a torch reference (``backend="torch"``, the oracle), Triton kernels for
GPUs (``backend="triton"``) and fused numba kernels for the CPU (``backend="numba"``,
:mod:`kvdiag.kernels.quant_cpu`: integer codes, scales and zeros bit-identical to the
reference). ``backend="auto"`` uses Triton for CUDA tensors and numba for CPU tensors of the
grouped formats (:func:`use_numba`; fp16/bf16 are single casts and stay on torch).
:func:`round_trip` is ``dequantize(quantize(x))`` in one fused pass on the CPU (no payload), for
error measurements; :func:`quantized_nbytes` gives the stored size from the shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, Optional

import torch

Axis = Literal["token", "channel"]
Backend = Literal["auto", "torch", "triton", "numba"]

INT_BITS = {"int8": 8, "int4": 4, "int2": 2}
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FLOAT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
FORMATS = tuple(FLOAT_DTYPES) + tuple(FP8_DTYPES) + tuple(INT_BITS)


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How one tensor (K or V) is stored. ``fmt``: one of :data:`FORMATS`; ``axis`` and
    ``group_size`` apply to fp8 and integer formats; ``residual_tokens``: full-precision recent
    window."""

    fmt: str
    axis: Axis = "token"
    group_size: int = 32
    residual_tokens: int = 0

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown KV format {self.fmt!r}; expected one of {', '.join(FORMATS)}")
        if self.axis not in ("token", "channel"):
            raise ValueError(f"axis must be 'token' or 'channel', not {self.axis!r}")
        if self.group_size < 4 or self.group_size & (self.group_size - 1):
            raise ValueError(f"group_size must be a power of two >= 4, not {self.group_size}")
        if self.residual_tokens < 0:
            raise ValueError("residual_tokens must be >= 0")

    @property
    def grouped(self) -> bool:
        return self.fmt in INT_BITS or self.fmt in FP8_DTYPES


@dataclass(slots=True)
class QuantizedKV:
    """What is stored for one tensor: ``payload`` covers the first ``quant_tokens`` tokens,
    ``residual`` the rest in the original dtype. ``scale``/``zero``: fp16, shape
    ``[B, H, quant_tokens, head_dim // group]`` (token axis) or
    ``[B, H, quant_tokens // group, head_dim]`` (channel axis)."""

    spec: QuantSpec
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    quant_tokens: int
    group_size: int
    payload: torch.Tensor
    scale: Optional[torch.Tensor]
    zero: Optional[torch.Tensor]
    residual: Optional[torch.Tensor]

    def nbytes(self) -> int:
        """Bytes of every stored tensor: payload + scales + zeros + residual window."""
        return sum(t.numel() * t.element_size()
                   for t in (self.payload, self.scale, self.zero, self.residual) if t is not None)

    def original_nbytes(self) -> int:
        b, h, t, d = self.shape
        return b * h * t * d * torch.empty(0, dtype=self.dtype).element_size()

    def ratio(self) -> float:
        """Original bytes / stored bytes."""
        return self.original_nbytes() / max(1, self.nbytes())


def _group_used(spec: QuantSpec, head_dim: int) -> int:
    """The group size actually used: per token at most the head_dim."""
    return min(spec.group_size, head_dim) if spec.axis == "token" else spec.group_size


def _split_tokens(spec: QuantSpec, tokens: int, head_dim: int) -> tuple[int, int]:
    """(quantized tokens, group size actually used)."""
    group = _group_used(spec, head_dim)
    if spec.grouped and spec.axis == "token" and head_dim % group:
        raise ValueError(f"head_dim {head_dim} is not a multiple of group_size {group}")
    quant = max(0, tokens - spec.residual_tokens)
    if spec.grouped and spec.axis == "channel":
        quant = (quant // group) * group
    return quant, group


def _per_byte(spec: QuantSpec) -> int:
    return 8 // INT_BITS[spec.fmt] if spec.fmt in INT_BITS else 1


def _check_input(x: torch.Tensor, spec: QuantSpec) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected a KV tensor [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
    if x.shape[-1] % _per_byte(spec):
        raise ValueError(f"head_dim {x.shape[-1]} is not a multiple of {_per_byte(spec)} for {spec.fmt}")


def use_triton(x: torch.Tensor, backend: Backend) -> bool:
    if backend in ("torch", "numba"):
        return False
    if backend == "triton":
        return True
    return x.is_cuda and triton_available()


def use_numba(x: torch.Tensor, spec: QuantSpec, backend: Backend, head_dim: Optional[int] = None) -> bool:
    """The fused CPU kernels: asked for, or ``auto`` on a CPU tensor (``x``, whose last dim is
    ``head_dim`` unless given) of a grouped format whose layout they cover
    (:func:`kvdiag.kernels.quant_cpu.supports`); every one measured faster than the reference
    (benchmarks/bench_quant_cpu.py)."""
    if not spec.grouped:
        return False
    if backend == "numba":
        return True
    if backend != "auto" or x.device.type != "cpu" or not numba_available():
        return False
    from kvdiag.kernels import quant_cpu

    head_dim = x.shape[-1] if head_dim is None else head_dim
    return quant_cpu.supports(spec.axis, _group_used(spec, head_dim), head_dim)


@functools.cache
def numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def quantize(x: torch.Tensor, spec: QuantSpec, backend: Backend = "auto") -> QuantizedKV:
    """Store ``x`` ([B, H, T, D]) as ``spec`` says; ``x`` itself is never modified."""
    _check_input(x, spec)
    b, h, t, d = x.shape
    quant, group = _split_tokens(spec, t, d)
    residual = x[:, :, quant:, :].clone() if quant < t else None
    if quant == 0:
        payload = torch.empty((b, h, 0, d // _per_byte(spec)), dtype=torch.uint8, device=x.device)
        scale = zero = None
    elif use_triton(x, backend):
        from kvdiag.kernels import quant_triton

        payload, scale, zero = quant_triton.quantize(x[:, :, :quant, :], spec, group)
    elif use_numba(x, spec, backend):
        from kvdiag.kernels import quant_cpu

        payload, scale, zero = quant_cpu.encode(x, spec.fmt, spec.axis, group, quant)
        if spec.fmt in FP8_DTYPES:
            payload = payload.view(FP8_DTYPES[spec.fmt])
    else:
        payload, scale, zero = _quantize_torch(x[:, :, :quant, :], spec, group)
    return QuantizedKV(spec, (b, h, t, d), x.dtype, quant, group, payload, scale, zero, residual)


def dequantize(q: QuantizedKV, backend: Backend = "auto") -> torch.Tensor:
    """The reconstruction x_hat, shape and dtype of the original tensor."""
    b, h, t, d = q.shape
    if q.quant_tokens == 0:
        head = q.payload.new_empty((b, h, 0, d), dtype=q.dtype)
    elif use_triton(q.payload, backend):
        from kvdiag.kernels import quant_triton

        head = quant_triton.dequantize(q)
    elif use_numba(q.payload, q.spec, backend, head_dim=q.shape[-1]):
        return _dequantize_numba(q)
    else:
        head = _dequantize_torch(q)
    return head if q.residual is None else torch.cat([head, q.residual], dim=2)


def quantized_nbytes(x_shape: tuple[int, int, int, int], dtype: torch.dtype, spec: QuantSpec) -> int:
    """Bytes :func:`quantize` stores for a tensor of this shape (payload, scales, zeros, residual),
    computed from the shapes alone: equal to ``quantize(x, spec).nbytes()``."""
    b, h, t, d = x_shape
    quant, group = _split_tokens(spec, t, d)
    elem = torch.empty(0, dtype=dtype).element_size()
    residual = b * h * (t - quant) * d * elem
    if spec.fmt in FLOAT_DTYPES:
        return b * h * quant * d * torch.empty(0, dtype=FLOAT_DTYPES[spec.fmt]).element_size() + residual
    payload = b * h * quant * d // _per_byte(spec)
    if quant == 0:
        return payload + residual
    groups = b * h * quant * d // group
    return payload + groups * 2 * (1 if spec.fmt in FP8_DTYPES else 2) + residual


def round_trip(x: torch.Tensor, spec: QuantSpec, backend: Backend = "auto") -> torch.Tensor:
    """``dequantize(quantize(x, spec, backend), backend)``, bit-identical; with the fused CPU
    kernels in one pass that never materialises the payload (error measurements need x_hat, and
    the stored size is :func:`quantized_nbytes`)."""
    _check_input(x, spec)
    if not use_numba(x, spec, backend) or x.dtype != torch.float32:
        return dequantize(quantize(x, spec, backend), backend)
    from kvdiag.kernels import quant_cpu

    b, h, t, d = x.shape
    quant, group = _split_tokens(spec, t, d)
    out = torch.empty(x.shape, dtype=torch.float32)
    if quant:
        quant_cpu.round_trip_into(x, spec.fmt, spec.axis, group, quant, out)
    if quant < t:
        out[:, :, quant:] = x[:, :, quant:]
    return out


def _dequantize_numba(q: QuantizedKV) -> torch.Tensor:
    """x_hat written once: the kernels fill the quantized tokens, the residual is copied after."""
    from kvdiag.kernels import quant_cpu

    out = torch.empty(q.shape, dtype=torch.float32)
    quant_cpu.decode_into(q.payload, q.scale, q.zero, q.spec.fmt, q.spec.axis, q.group_size, out)
    if q.residual is not None:
        out[:, :, q.quant_tokens:] = q.residual
    return out if q.dtype == torch.float32 else out.to(q.dtype)


# ------------------------------------------------------------------ torch reference


def _group_view(x: torch.Tensor, axis: Axis, group: int) -> torch.Tensor:
    """[B, H, T, D] -> a view whose dim ``_GROUP_DIM[axis]`` runs over one group."""
    b, h, t, d = x.shape
    if axis == "token":
        return x.reshape(b, h, t, d // group, group)
    return x.reshape(b, h, t // group, group, d)


_GROUP_DIM = {"token": 4, "channel": 3}


def _quantize_torch(x: torch.Tensor, spec: QuantSpec, group: int):
    if spec.fmt in FLOAT_DTYPES:
        return x.to(FLOAT_DTYPES[spec.fmt]).contiguous(), None, None
    xv = _group_view(x.float(), spec.axis, group)
    gdim = _GROUP_DIM[spec.axis]
    if spec.fmt in FP8_DTYPES:
        fp8 = FP8_DTYPES[spec.fmt]
        fmax = torch.finfo(fp8).max
        scale16 = (xv.abs().amax(gdim) / fmax).to(torch.float16)
        inv = (1.0 / _safe_scale(scale16)).unsqueeze(gdim)
        y = (xv * inv).clamp_(-fmax, fmax).to(fp8)
        return y.reshape(x.shape), scale16, None
    bits = INT_BITS[spec.fmt]
    qmax = (1 << bits) - 1
    mn = xv.amin(gdim)
    mx = xv.amax(gdim)
    zero16 = mn.to(torch.float16)
    scale16 = ((mx - mn) / qmax).to(torch.float16)
    inv = 1.0 / _safe_scale(scale16)
    # code = floor((x - zero) * (1 / scale) + 0.5); after the clamp the value is >= 0, so the
    # truncating cast to uint8 is the floor
    codes = (xv - zero16.float().unsqueeze(gdim)).mul_(inv.unsqueeze(gdim)).add_(0.5).clamp_(0, qmax)
    codes = codes.to(torch.uint8).reshape(x.shape)
    return _pack(codes, bits), scale16, zero16


def _safe_scale(scale16: torch.Tensor) -> torch.Tensor:
    """fp32 scale used for encoding; a zero scale (constant group) encodes every value as 0."""
    s = scale16.float()
    return torch.where(s > 0, s, torch.ones_like(s))


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.contiguous()
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    packed = c[..., 0] | (c[..., 1] << bits)
    for j in range(2, per_byte):
        packed |= c[..., j] << (bits * j)
    return packed


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [packed & mask] + [(packed >> (bits * j)) & mask for j in range(1, per_byte)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def _dequantize_torch(q: QuantizedKV) -> torch.Tensor:
    spec = q.spec
    if spec.fmt in FLOAT_DTYPES:
        return q.payload.to(q.dtype)
    gdim = _GROUP_DIM[spec.axis]
    if spec.fmt in FP8_DTYPES:
        y = _group_view(q.payload.float(), spec.axis, q.group_size)
        x = y.mul_(q.scale.float().unsqueeze(gdim))
        return x.reshape(q.payload.shape).to(q.dtype)
    bits = INT_BITS[spec.fmt]
    codes = _unpack(q.payload, bits)
    cv = _group_view(codes.to(torch.float32), spec.axis, q.group_size)
    x = cv.mul_(q.scale.float().unsqueeze(gdim)).add_(q.zero.float().unsqueeze(gdim))
    return x.reshape(codes.shape).to(q.dtype)


def quant_step(q: QuantizedKV) -> torch.Tensor:
    """Per-element size of one quantization step ([B, H, quant_tokens, D], fp32): the integer
    scale, or for fp8 the spacing of fp8 values around x_hat; 0 for fp16/bf16."""
    b, h, _, d = q.shape
    t = q.quant_tokens
    if q.spec.fmt in FLOAT_DTYPES or q.scale is None:
        return torch.zeros((b, h, t, d))
    gdim = _GROUP_DIM[q.spec.axis]
    shape = _group_view(torch.empty((b, h, t, d), device="meta"), q.spec.axis, q.group_size).shape
    s = q.scale.float().unsqueeze(gdim).expand(shape).reshape(b, h, t, d)
    if q.spec.fmt in FP8_DTYPES:
        mant_bits = 3 if q.spec.fmt == "fp8_e4m3" else 2
        y = _group_view(q.payload.float(), q.spec.axis, q.group_size)
        mag = y.abs().clamp_min(torch.finfo(FP8_DTYPES[q.spec.fmt]).smallest_normal)
        ulp = torch.exp2(torch.floor(torch.log2(mag)) - mant_bits).reshape(b, h, t, d)
        return ulp * s
    return s
