"""KV bytes per token: the one definition every place that sizes a KV cache calls.

``kv_bytes_per_token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element``: the
bytes one token's keys and values occupy over all layers. Grouped-query (GQA) and multi-query
(MQA) attention store ``num_key_value_heads`` heads, fewer than the query heads; multi-head
attention (MHA) stores as many as it has query heads. Pure arithmetic, no imports beyond the
standard library, so the agent, the shadow and the planner can all use it.
"""

from __future__ import annotations

DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
               "fp8": 1, "float8": 1, "int8": 1}
"""Bytes per stored element of each KV dtype name."""


class ModelConfigError(ValueError):
    """A model name or config.json that does not describe a KV cache; the message names it."""


def element_bytes(dtype: str) -> int:
    """Bytes per KV element of ``dtype`` (fp32, fp16, bf16, fp8, int8)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ModelConfigError(f"dtype {dtype!r}: expected one of "
                               f"{', '.join(sorted(DTYPE_BYTES))}") from None


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """KV bytes of one token over all layers, K and V:
    2 x num_layers x num_kv_heads x head_dim x bytes per element of ``dtype``."""
    return 2 * num_layers * num_kv_heads * head_dim * element_bytes(dtype)
