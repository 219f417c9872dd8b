"""TensorRT-LLM's KV-cache events (its ``KVCacheEventSerializer`` form) as the vLLM-shaped dicts
:func:`kvdiag.pool.prefix_cache.schema_event` decodes, so one decoder serves every publisher."""

from __future__ import annotations


TRTLLM_CACHE_LEVELS = {0: "GPU", 1: "CPU"}
"""TensorRT-LLM's ``cache_level`` (0 the primary pool on the device, 1 the secondary, host
memory) as a ``medium``."""


def trtllm_event_dicts(ev: dict) -> list[dict]:
    """One KV-cache event as TensorRT-LLM serializes it (its ``KVCacheEventSerializer``: what
    ``LLM.get_kv_cache_events()`` and trtllm-serve's ``/kv_cache_events`` return,
    ``{"event_id", "data": {"type": ...}, "window_size", "attention_dp_rank"?}``) as vLLM-shaped
    dicts for :func:`schema_event`: ``stored`` (``parent_hash``, ``blocks`` of ``block_hash``,
    ``tokens`` of ``{"token_id"}``, ``cache_level``) as one ``BlockStored`` per run of blocks on
    one level (:data:`TRTLLM_CACHE_LEVELS`), each block's parent the one before it;
    ``removed`` (``block_hashes``, no level given) as a ``BlockRemoved`` of the device tier;
    ``created`` and ``updated`` (a block's level or priority changed) as nothing. Raises
    ValueError for anything else."""
    data = ev.get("data") if isinstance(ev, dict) else None
    kind = data.get("type") if isinstance(data, dict) else None
    if kind in ("created", "updated"):
        return []
    if kind == "removed":
        return [{"type": "BlockRemoved", "block_hashes": data.get("block_hashes"), "medium": "GPU"}]
    if kind != "stored" or not isinstance(data.get("blocks"), list):
        raise ValueError("expected a TensorRT-LLM KV cache event (data.type stored, removed, "
                         "created or updated)")
    out: list[dict] = []
    parent = data.get("parent_hash")
    for block in data["blocks"]:
        if not isinstance(block, dict):
            raise ValueError("stored.blocks: expected maps")
        tokens = [t.get("token_id") if isinstance(t, dict) else None for t in block.get("tokens") or []]
        level = block.get("cache_level")
        medium = TRTLLM_CACHE_LEVELS.get(level, f"LEVEL_{level}")
        last = out[-1] if out else None
        if last is not None and last["medium"] == medium and last["block_size"] == len(tokens):
            last["block_hashes"].append(block.get("block_hash"))
            last["token_ids"] += tokens
        else:
            out.append({"type": "BlockStored", "block_hashes": [block.get("block_hash")],
                        "parent_block_hash": parent, "token_ids": tokens,
                        "block_size": len(tokens) or None, "lora_id": None, "medium": medium})
        parent = block.get("block_hash")
    return out
