"""Cross-request KV similarity: how alike are the keys and values of different requests at the
same positions, layer by layer, on a real model?

Definition. For two requests a and b, layer l and the positions ``offset .. offset+N-1``:
``cos_l(a, b)`` = mean over those positions p and over KV heads h of the cosine similarity of
``K_a[l, h, p, :]`` and ``K_b[l, h, p, :]`` (head_dim vectors, after RoPE, as cached); the same
for V. A group's value is the mean of ``cos_l`` over its pairs. Pairs "share a system prompt"
when their token ids agree on at least their first ``min_shared_tokens`` tokens; all other
pairs form the "different prompt" group. Since attention is causal, KV at position p depends
only on tokens ``0..p``: each prompt is run only up to ``offset + N`` tokens, one request at a
time (no padding), with the model's own cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

import numpy as np
import pandas as pd

from kvdiag.events.schema import ShadowSimilarity


def _token_ids(tokenizer, prompt) -> list[int]:
    """A prompt as token ids: ids as given, text encoded, chat messages through the template."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if prompt and isinstance(prompt[0], dict):
        enc = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    return [int(t) for t in prompt]


def prompt_kv(model, token_ids: Sequence[int], n_tokens: int):
    """Per-layer (K, V) of the first ``n_tokens`` of a prompt: float32 arrays
    [kv_heads, n_tokens, head_dim], read from the model's ``DynamicCache`` after a prefill."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([list(token_ids[:n_tokens])], dtype=torch.long)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        try:
            model(input_ids=ids, cache=cache, use_cache=True)
        except TypeError:  # transformers < 5 names it past_key_values
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    return [(layer.keys[0].float().numpy(), layer.values[0].float().numpy())
            for layer in cache.layers]


def _cosines(a: np.ndarray, b: np.ndarray) -> float:
    """Mean cosine similarity of matching rows of a and b (vectors along the last axis)."""
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return float(np.mean(num / np.maximum(den, 1e-30)))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class SimilarityResult:
    """Per-layer mean K and V cosine similarity, for pairs sharing a system prompt or not."""

    positions: int
    offset: int
    min_shared_tokens: int
    frame: pd.DataFrame  # layer, same_prompt, k_cosine, v_cosine, pairs

    def events(self, ts_ns: int) -> list[ShadowSimilarity]:
        """The result as ``ShadowSimilarity`` events (one per layer and group)."""
        return [ShadowSimilarity(ts_ns=ts_ns, layer=int(r.layer), positions=self.positions,
                                 same_prompt=bool(r.same_prompt), k_cosine=float(r.k_cosine),
                                 v_cosine=float(r.v_cosine), pairs=int(r.pairs))
                for r in self.frame.itertuples()]


def kv_similarity(model, tokenizer, prompts: Sequence, *, positions: int = 10, offset: int = 0,
                  min_shared_tokens: int = 16, max_pairs: int = 200,
                  seed: int = 0) -> SimilarityResult:
    """Cosine similarity of K and V at positions ``offset..offset+positions-1`` between
    requests, per layer, split into pairs that share a system prompt and pairs that do not
    (see the module docstring). ``prompts``: token-id lists, strings or chat message lists.
    At most ``max_pairs`` pairs per group are used (a seeded sample)."""
    ids = [_token_ids(tokenizer, p) for p in prompts]
    need = offset + positions
    keep = [i for i, t in enumerate(ids) if len(t) >= need]
    kv = {i: prompt_kv(model, ids[i], need) for i in keep}
    rng = np.random.default_rng(seed)
    groups: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for a, b in combinations(keep, 2):
        groups[_common_prefix(ids[a], ids[b]) >= min_shared_tokens].append((a, b))
    rows = []
    for same, pairs in groups.items():
        if not pairs:
            continue
        if len(pairs) > max_pairs:
            pairs = [pairs[k] for k in sorted(rng.choice(len(pairs), max_pairs, replace=False))]
        n_layers = len(kv[pairs[0][0]])
        for layer in range(n_layers):
            k_cos, v_cos = [], []
            for a, b in pairs:
                ka, va = kv[a][layer]
                kb, vb = kv[b][layer]
                k_cos.append(_cosines(ka[:, offset:need], kb[:, offset:need]))
                v_cos.append(_cosines(va[:, offset:need], vb[:, offset:need]))
            rows.append({"layer": layer, "same_prompt": same, "k_cosine": float(np.mean(k_cos)),
                         "v_cosine": float(np.mean(v_cos)), "pairs": len(pairs)})
    frame = pd.DataFrame(rows, columns=["layer", "same_prompt", "k_cosine", "v_cosine", "pairs"])
    return SimilarityResult(positions, offset, min_shared_tokens, frame)
