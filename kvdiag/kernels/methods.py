"""Named KV compression methods, as the shadow runner and the CLI configure them.

A method name is ``base[:key=value...]``:

- ``fp16``, ``bf16``: cast. ``fp8_e4m3``, ``fp8_e5m2``, ``int8``, ``int4``, ``int2``: group-wise
  (:mod:`kvdiag.kernels.quant`) in KIVI's layout by default, keys grouped per channel and values
  per token. Options: ``k=token|channel``, ``v=token|channel``, ``g=GROUP`` (32),
  ``r=RECENT_TOKENS`` kept in full precision (0). ``fp8_e4m3:s=SCALE`` / ``fp8_e5m2:s=SCALE``:
  instead, a plain cast of x / SCALE with one scale for the whole tensor (saturated at the
  format's largest value), as vLLM stores ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2`` with its
  per-tensor ``k_scale``/``v_scale`` (1.0 unless calibrated); no other option then.
- ``topk_norm``, ``h2o``, ``streaming``: sparse (:mod:`kvdiag.kernels.sparse`). Options:
  ``keep=FRACTION`` of positions kept (0.125), ``recent=FRACTION`` of the budget for H2O's
  window (0.5), ``sinks=N`` for StreamingLLM (4).

Every method maps (K, V) to a :class:`Compressed` whose ``decode`` gives (K_hat, V_hat, keep)
where ``keep`` is a [B, H, T] mask of stored positions (None: all positions kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from kvdiag.kernels import sparse
from kvdiag.kernels.quant import FORMATS, FP8_DTYPES, QuantizedKV, QuantSpec, dequantize, quantize

SPARSE_METHODS = ("topk_norm", "h2o", "streaming")
DEFAULT_METHODS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2",
                   "topk_norm", "h2o", "streaming")


class Compressed(Protocol):
    def nbytes(self) -> int: ...

    def ratio(self) -> float: ...

    def decode(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]: ...


@dataclass(slots=True)
class QuantizedPair:
    k: QuantizedKV
    v: QuantizedKV
    backend: str

    def nbytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()

    def ratio(self) -> float:
        """Original K+V bytes / stored K+V bytes (payload, scales, zeros, residual)."""
        return (self.k.original_nbytes() + self.v.original_nbytes()) / max(1, self.nbytes())

    def decode(self):
        return dequantize(self.k, self.backend), dequantize(self.v, self.backend), None


@dataclass(slots=True)
class SparsePair:
    kv: sparse.SparseKV

    def nbytes(self) -> int:
        return self.kv.nbytes()

    def ratio(self) -> float:
        return self.kv.ratio()

    def decode(self):
        k, v = self.kv.decode()
        return k, v, self.kv.keep_mask()


@dataclass(slots=True)
class CastPair:
    """K and V each cast to an fp8 dtype after dividing by one per-tensor scale."""

    k: torch.Tensor
    v: torch.Tensor
    scale: float
    dtype: torch.dtype  # the original's

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def ratio(self) -> float:
        """Original K+V bytes / stored bytes (the scale is one number per tensor, not counted)."""
        original = (self.k.numel() + self.v.numel()) * torch.empty(0, dtype=self.dtype).element_size()
        return original / max(1, self.nbytes())

    def decode(self):
        return ((self.k.float() * self.scale).to(self.dtype), (self.v.float() * self.scale).to(self.dtype), None)


def cast_fp8(x: torch.Tensor, fmt: str, scale: float) -> torch.Tensor:
    """``x / scale`` in the fp8 format ``fmt``, saturated at its largest finite value."""
    dtype = FP8_DTYPES[fmt]
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-top, top).to(dtype)


@dataclass(frozen=True, slots=True)
class Method:
    """One configured compressor. ``compress(k, v, attn_mass)``: ``attn_mass`` [B, H_kv, T] is
    the attention each position received (used by H2O only)."""

    name: str
    base: str
    k_spec: Optional[QuantSpec] = None
    v_spec: Optional[QuantSpec] = None
    keep_frac: float = 0.125
    recent_frac: float = 0.5
    sinks: int = 4
    backend: str = "auto"
    cast_scale: Optional[float] = None  # fp8 as a plain cast with this per-tensor scale

    @property
    def is_sparse(self) -> bool:
        return self.base in SPARSE_METHODS

    def compress(self, k: torch.Tensor, v: torch.Tensor,
                 attn_mass: Optional[torch.Tensor] = None) -> Compressed:
        if self.base == "topk_norm":
            return SparsePair(sparse.topk_norm(k, v, self.keep_frac))
        if self.base == "h2o":
            return SparsePair(sparse.h2o(k, v, self.keep_frac, attn_mass, self.recent_frac))
        if self.base == "streaming":
            return SparsePair(sparse.streaming(k, v, self.keep_frac, self.sinks))
        if self.cast_scale is not None:
            return CastPair(cast_fp8(k, self.base, self.cast_scale), cast_fp8(v, self.base, self.cast_scale),
                            self.cast_scale, k.dtype)
        return QuantizedPair(quantize(k, self.k_spec, self.backend),
                             quantize(v, self.v_spec, self.backend), self.backend)


def parse_method(name: str, backend: str = "auto") -> Method:
    """``"int4:k=token:g=64"`` -> a :class:`Method`; ValueError with the expected form otherwise."""
    base, *opts = name.strip().split(":")
    kv: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep:
            raise ValueError(f"method {name!r}: expected key=value after ':', got {opt!r}")
        kv[key] = value
    allowed = {"k", "v", "g", "r"} if base in FORMATS else {"keep", "recent", "sinks"}
    if base in FP8_DTYPES and "s" in kv:
        allowed = {"s"}
    unknown = set(kv) - allowed
    if base not in FORMATS and base not in SPARSE_METHODS:
        raise ValueError(f"unknown method {base!r}; expected one of "
                         f"{', '.join(FORMATS + SPARSE_METHODS)}")
    if unknown:
        raise ValueError(f"method {name!r}: unknown option(s) {sorted(unknown)}; expected {sorted(allowed)}")
    try:
        if "s" in kv:
            scale = float(kv["s"])
            if not scale > 0:
                raise ValueError("s must be > 0")
            return Method(name, base, backend=backend, cast_scale=scale)
        if base in FORMATS:
            group, recent = int(kv.get("g", 32)), int(kv.get("r", 0))
            k_spec = QuantSpec(base, kv.get("k", "channel"), group, recent)
            v_spec = QuantSpec(base, kv.get("v", "token"), group, recent)
            return Method(name, base, k_spec, v_spec, backend=backend)
        keep = float(kv.get("keep", 0.125))
        if not 0 < keep <= 1:
            raise ValueError("keep must be in (0, 1]")
        return Method(name, base, keep_frac=keep, recent_frac=float(kv.get("recent", 0.5)),
                      sinks=int(kv.get("sinks", 4)), backend=backend)
    except ValueError as exc:
        raise ValueError(f"method {name!r}: {exc}") from None


def parse_methods(text: str | tuple[str, ...] | list[str], backend: str = "auto") -> list[Method]:
    names = text.split(",") if isinstance(text, str) else list(text)
    return [parse_method(n, backend) for n in names if n.strip()]
