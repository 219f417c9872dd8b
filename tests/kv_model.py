"""The real SmolLM2 model for the compression/locality tests, loaded once per session.

Where it comes from: ``kvdiag.demo.smollm.ensure_model()`` (the kvdiag cache, fetched on first use).
"""

from __future__ import annotations

import functools

import torch

TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
        "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
        "from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the centrepiece "
        "of the 1889 World's Fair.")


@functools.lru_cache(maxsize=1)
def _load():
    from kvdiag.demo.smollm import ensure_model, load_model

    torch.set_num_threads(1)
    return load_model(ensure_model(), attn_implementation="eager")


def model_and_tokenizer():
    """(model with eager attention, tokenizer)."""
    return _load()


@functools.lru_cache(maxsize=1)
def prefill_kv():
    """(input_ids [1, T], per-layer (K, V) of the prefilled TEXT) from a real forward."""
    from transformers import DynamicCache

    model, tok = model_and_tokenizer()
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return ids, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
