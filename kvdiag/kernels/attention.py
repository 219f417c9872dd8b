"""Per-head attention locality, recomputed in shadow from a layer's queries and cached keys.

Fast attention kernels (sdpa, paged attention) never materialise the attention probabilities,
so kvdiag recomputes them on sampled decode steps: p = softmax(q k^T * scaling) over the
positions the query may see (causal), for each query head, with grouped-query heads reading
their shared kv head. Definitions, for one query at position T-1 over T cached positions:

- recent window: the last ceil(0.2 * T) positions; ``recent_mass`` = sum of p over it.
- sinks: the first min(4, T - recent) positions; ``sink_mass`` = sum of p over them.
- ``other_mass`` = 1 - recent - sink (computed as the sum over the remaining positions).
- ``entropy_nats`` = -sum p log p.
- distance = T - 1 - position; ``distance_hist[i]`` = mass at distances in
  [DISTANCE_EDGES[i], DISTANCE_EDGES[i+1]) (last bin open-ended).
- ``outside_share`` of head h = (sink + other mass of h) / sum over the layer's query heads of
  (sink + other mass): the head's share of the layer's attention outside the recent window.

With a batch, every metric is the mean over the sequences of the batch.
:class:`QueryCapture` captures the post-RoPE queries of a transformers model's decode step.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Optional

import torch

from kvdiag.events.schema import DISTANCE_EDGES
from kvdiag.events.schema import ShadowLocality

RECENT_FRAC = 0.2
SINK_TOKENS = 4


def window_sizes(tokens: int) -> tuple[int, int]:
    """(recent positions, sink positions) for a query that sees ``tokens`` positions."""
    recent = math.ceil(RECENT_FRAC * tokens)
    return recent, min(SINK_TOKENS, tokens - recent)


def attention_probs(q: torch.Tensor, k: torch.Tensor, scaling: float,
                    keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention probabilities [B, QH, Tq, T] (fp32) of queries [B, QH, Tq, D] over keys
    [B, KH, T, D]; the Tq queries sit at the last Tq positions. ``keep`` [B, KH, T]: positions
    absent from a sparse cache get no attention."""
    b, qh, tq, _ = q.shape
    kh, t = k.shape[1], k.shape[2]
    group = qh // kh
    kf = k.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scaling
    if tq > 1:
        future = torch.arange(t, device=q.device)[None, :] > (t - tq + torch.arange(tq, device=q.device))[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    if keep is not None:
        scores = scores.masked_fill(~keep.repeat_interleave(group, dim=1)[:, :, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def locality_metrics(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Metrics of the module docstring for probabilities ``p`` [B, QH, T] of one query per
    sequence at position T-1; each value [QH] (``distance_hist``: [QH, bins]), batch-averaged."""
    p = p.double()
    t = p.shape[-1]
    recent, sinks = window_sizes(t)
    recent_mass = p[..., t - recent:].sum(-1)
    sink_mass = p[..., :sinks].sum(-1)
    other_mass = p[..., sinks: t - recent].sum(-1)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    distance = torch.arange(t - 1, -1, -1, device=p.device)
    edges = torch.tensor(DISTANCE_EDGES[1:], device=p.device)
    bins = torch.bucketize(distance, edges, right=True)
    hist = torch.zeros(*p.shape[:-1], len(DISTANCE_EDGES), dtype=p.dtype, device=p.device)
    hist.scatter_add_(-1, bins.expand_as(p), p)
    outside = sink_mass + other_mass
    share = outside / outside.sum(-1, keepdim=True).clamp_min(1e-300)
    out = {"recent_mass": recent_mass, "sink_mass": sink_mass, "other_mass": other_mass,
           "entropy_nats": entropy, "outside_share": share, "distance_hist": hist}
    return {k: v.mean(0) for k, v in out.items()}


def locality_events(layer: int, p: torch.Tensor, ts_ns: Optional[int] = None) -> list[ShadowLocality]:
    """One :class:`ShadowLocality` per query head of ``layer`` from ``p`` [B, QH, T]."""
    m = locality_metrics(p)
    ts = ts_ns or time.time_ns()
    return [ShadowLocality(ts_ns=ts, layer=layer, head=h, seq_len_tokens=p.shape[-1],
                           recent_mass=float(m["recent_mass"][h]), sink_mass=float(m["sink_mass"][h]),
                           other_mass=float(m["other_mass"][h]), entropy_nats=float(m["entropy_nats"][h]),
                           outside_share=float(m["outside_share"][h]),
                           distance_hist=[float(x) for x in m["distance_hist"][h]])
            for h in range(p.shape[1])]


class QueryCapture:
    """Post-RoPE queries of every attention layer of a transformers decoder, on demand.

    A forward pre-hook on each ``self_attn`` keeps references to its input hidden states and
    (cos, sin) while ``armed``; :meth:`queries` recomputes q = RoPE(q_proj(h)) from them, so a
    step that is not sampled costs one attribute check per layer and no copy.
    """

    def __init__(self, model) -> None:
        self.layers = [layer.self_attn for layer in _decoder_layers(model)]
        self.armed = False
        self._inputs: list[Optional[tuple]] = [None] * len(self.layers)
        self._handles = [attn.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, attn in enumerate(self.layers)]

    def _hook(self, index: int):
        def hook(module, args, kwargs):
            if self.armed:
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                rope = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
                self._inputs[index] = (hidden, rope)
        return hook

    def scaling(self, layer: int = 0) -> float:
        return float(self.layers[layer].scaling)

    def queries(self) -> list[torch.Tensor]:
        """[B, QH, Tq, D] per layer for the last armed forward."""
        return [self.query(layer) for layer in range(len(self.layers))]

    def query(self, layer: int) -> torch.Tensor:
        """[B, QH, Tq, D] of one layer for the last armed forward."""
        attn, captured = self.layers[layer], self._inputs[layer]
        if captured is None:
            raise RuntimeError("QueryCapture: no forward ran while armed")
        hidden, (cos, sin) = captured
        with torch.no_grad():
            q = attn.q_proj(hidden).view(*hidden.shape[:-1], -1, attn.head_dim).transpose(1, 2)
            rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb")
            q, _ = rope(q, q, cos, sin)
        return q

    def clear(self) -> None:
        self._inputs = [None] * len(self.layers)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _decoder_layers(model):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: expected a decoder with .model.layers")
    return layers
