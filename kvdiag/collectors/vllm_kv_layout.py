"""Where a vLLM attention layer keeps its K/V, read into kvdiag's ``[1, kv_heads, tokens, head_dim]``.

KV layouts read (vLLM 0.32; logical per-layer cache ``[blocks, kv_heads, block_size, 2 x
head_dim]``, :func:`gather_kv`): the CPU backend's ``vec`` ISA (fp32/fp16 caches) stores a
block's keys transposed, ``[head_dim, block_size]``, followed by its values ``[block_size,
head_dim]``; FlashAttention stores each token's key and value side by side (``[..., :D]``,
``[..., D:]``). Any other layout (the CPU's ``amx``/``neon`` ISAs, fp8 caches) is not read: a
``CollectorStatus`` says so once and the worker's shadow stays off.
"""

from __future__ import annotations

import re
from typing import Any, Optional

CPU_LAYOUT_ISAS = ("vec",)
"""CPU attention ISAs whose KV block layout :func:`gather_kv` reads."""


def layer_index(layer_name: str) -> Optional[int]:
    """The decoder layer of a vLLM attention layer's name (``model.layers.3.self_attn.attn`` ->
    3): the number after ``layers.``, else the first number in the name, else None."""
    m = re.search(r"layers\.(\d+)\.", layer_name) or re.search(r"(\d+)", layer_name)
    return int(m.group(1)) if m else None


def gather_kv(kv_cache, block_ids, seq_len_tokens: int, layout: str):
    """Copies of one request's K and V ``[1, kv_heads, seq_len, head_dim]`` from one layer's
    paged cache ``kv_cache`` ``[blocks, kv_heads, block_size, 2 x head_dim]``: its blocks
    ``block_ids`` in order (its block-table row), the first ``seq_len_tokens`` tokens.
    ``layout``: ``"cpu-vec"`` (keys transposed per block and head, then values) or ``"flash"``
    (key and value of a token side by side)."""
    import torch

    num_blocks, heads, block, content = kv_cache.shape
    dim = content // 2
    used = -(-seq_len_tokens // block)
    ids = torch.as_tensor(block_ids[:used], dtype=torch.int64, device=kv_cache.device)
    pages = torch.index_select(kv_cache, 0, ids)  # [used, H, block, 2D], a copy
    if layout == "cpu-vec":
        halves = pages.reshape(used, heads, 2, block * dim)
        k = halves[:, :, 0].reshape(used, heads, dim, block).transpose(2, 3)
        v = halves[:, :, 1].reshape(used, heads, block, dim)
    elif layout == "flash":
        k, v = pages[..., :dim], pages[..., dim:]
    else:
        raise ValueError(f"KV layout {layout!r}: expected 'cpu-vec' or 'flash'")

    def tokens(x):  # [used, H, block, D] -> [1, H, seq_len, D]
        return x.permute(1, 0, 2, 3).reshape(heads, used * block, dim)[:, :seq_len_tokens].unsqueeze(0).contiguous()
    return tokens(k), tokens(v)


def cpu_layout(isa: Optional[str], cache_dtype: Any) -> Optional[str]:
    """The layout name :func:`gather_kv` reads for a CPU attention layer, or None (unknown)."""
    import torch

    if isa in CPU_LAYOUT_ISAS and cache_dtype in (torch.float32, torch.float16, torch.bfloat16):
        return "cpu-vec"
    return None
