"""Sparse KV: keep a subset of token positions per (batch, kv head), drop the rest.

Three selection rules, each keeping ``budget_tokens`` = max(1, round(keep_frac * tokens))
positions per (batch, kv head):

- ``topk_norm``: the positions whose key has the largest L2 norm.
- ``h2o`` (Heavy-Hitter Oracle, Zhang et al. 2023): the most recent ``recent_frac`` of the
  budget plus the older positions with the largest accumulated attention probability
  (summed over the queries seen and over the query heads that share the kv head).
- ``streaming`` (StreamingLLM, Xiao et al. 2023): the first ``sinks`` positions plus the most
  recent positions that fill the rest of the budget.

What is stored: the kept K and V rows in the original dtype plus their positions (int16 when
tokens < 32768, else int32); ``ratio`` = original K+V bytes / (kept K+V bytes + index bytes).
Decoding gives dense K/V with zeros at dropped positions and a keep mask [B, H, T]; attention
over a sparse cache must mask the dropped positions (see :func:`keep_mask`). Torch only:
selection is one ``topk`` and one ``gather`` per tensor, already bandwidth-bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(slots=True)
class SparseKV:
    """Kept rows of K and V with their positions; ``indices`` [B, H, budget] ascending."""

    method: str
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    indices: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def nbytes(self) -> int:
        """Bytes stored: kept K and V rows plus their positions."""
        return sum(t.numel() * t.element_size() for t in (self.indices, self.k, self.v))

    def original_nbytes(self) -> int:
        b, h, t, d = self.shape
        return 2 * b * h * t * d * torch.empty(0, dtype=self.dtype).element_size()

    def ratio(self) -> float:
        """Original K+V bytes / stored bytes."""
        return self.original_nbytes() / max(1, self.nbytes())

    def keep_mask(self) -> torch.Tensor:
        """[B, H, T] bool: True at stored positions."""
        b, h, t, _ = self.shape
        mask = torch.zeros((b, h, t), dtype=torch.bool, device=self.k.device)
        return mask.scatter_(2, self.indices.long(), True)

    def decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense (K_hat, V_hat) with zeros at dropped positions."""
        idx = self.indices.long().unsqueeze(-1).expand(-1, -1, -1, self.shape[3])
        k = torch.zeros(self.shape, dtype=self.dtype, device=self.k.device).scatter_(2, idx, self.k)
        v = torch.zeros(self.shape, dtype=self.dtype, device=self.v.device).scatter_(2, idx, self.v)
        return k, v


def budget_tokens(tokens: int, keep_frac: float) -> int:
    return max(1, min(tokens, round(keep_frac * tokens)))


def _store(method: str, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> SparseKV:
    positions = positions.sort(dim=-1).values
    index_dtype = torch.int16 if k.shape[2] < 32768 else torch.int32
    idx = positions.unsqueeze(-1).expand(-1, -1, -1, k.shape[3])
    return SparseKV(method, tuple(k.shape), k.dtype, positions.to(index_dtype),
                    torch.gather(k, 2, idx), torch.gather(v, 2, idx))


def topk_norm(k: torch.Tensor, v: torch.Tensor, keep_frac: float) -> SparseKV:
    """Keep the positions with the largest key L2 norm."""
    n = budget_tokens(k.shape[2], keep_frac)
    positions = k.float().norm(dim=-1).topk(n, dim=-1).indices
    return _store("topk_norm", k, v, positions)


def _recent_positions(b: int, h: int, t: int, n: int, device) -> torch.Tensor:
    return torch.arange(t - n, t, device=device).expand(b, h, n)


def h2o(k: torch.Tensor, v: torch.Tensor, keep_frac: float, attn_mass: Optional[torch.Tensor],
        recent_frac: float = 0.5) -> SparseKV:
    """Heavy hitters + recent window. ``attn_mass`` [B, H, T]: accumulated attention each
    position received (None: no queries seen, so only the window and the earliest positions)."""
    b, h, t, _ = k.shape
    n = budget_tokens(t, keep_frac)
    n_recent = min(n, max(1, round(recent_frac * n)))
    n_heavy = n - n_recent
    recent = _recent_positions(b, h, t, n_recent, k.device)
    if n_heavy == 0:
        return _store("h2o", k, v, recent)
    if attn_mass is None:
        heavy = torch.arange(n_heavy, device=k.device).expand(b, h, n_heavy)
    else:
        heavy = attn_mass[..., : t - n_recent].topk(n_heavy, dim=-1).indices
    return _store("h2o", k, v, torch.cat([heavy, recent], dim=-1))


def streaming(k: torch.Tensor, v: torch.Tensor, keep_frac: float, sinks: int = 4) -> SparseKV:
    """Attention sinks (first ``sinks`` positions) + the most recent positions."""
    b, h, t, _ = k.shape
    n = budget_tokens(t, keep_frac)
    n_sink = min(sinks, n)
    sink = torch.arange(n_sink, device=k.device).expand(b, h, n_sink)
    recent = _recent_positions(b, h, t, n - n_sink, k.device)
    return _store("streaming", k, v, torch.cat([sink, recent], dim=-1))
