"""The shadow's compression table and per-head attention locality, from its results
(``ShadowCompression``, ``ShadowLocality``, ``ShadowBudget``)."""

from __future__ import annotations

import math
from typing import Optional

import msgspec

from kvdiag.events import schema as s
from kvdiag.diagnosis.rules import compression_verdict
from kvdiag.shadow.sampling import sampling_line
from kvdiag.live.snapshot import LOCALITY_METRICS, CompressionRow, CompressionView, LocalityView

NO_SHADOW = "no shadow data: start with --shadow"


class ShadowFold:
    def __init__(self) -> None:
        self.compression: dict[tuple, s.ShadowCompression] = {}
        self.budget: Optional[s.ShadowBudget] = None  # the latest
        self.locality_sum: dict[tuple[int, int], list[float]] = {}
        self.locality_samples = 0
        self.handlers = {s.ShadowCompression: self.on_compression, s.ShadowLocality: self.on_locality,
                         s.ShadowBudget: self.on_budget}

    def on_budget(self, ev: s.ShadowBudget, b, idx: int) -> None:
        self.budget = ev

    def on_compression(self, ev: s.ShadowCompression, b, idx: int) -> None:
        self.compression[(ev.layer, ev.head, ev.method)] = ev

    def on_locality(self, ev: s.ShadowLocality, b, idx: int) -> None:
        sums = self.locality_sum.get((ev.layer, ev.head))
        if sums is None:
            sums = self.locality_sum[(ev.layer, ev.head)] = [0.0, 0.0, 0.0, 0.0, 0, 0]
        sums[0] += ev.recent_mass
        sums[1] += ev.sink_mass
        sums[2] += ev.entropy_nats
        if ev.outside_share is not None:
            sums[3] += ev.outside_share
            sums[5] += 1
        sums[4] += 1
        self.locality_samples += 1

    def _num_layers(self, pool_layers: int) -> int:
        layers = [k[0] for k in self.compression] + [k[0] for k in self.locality_sum]
        seen = max(layers) + 1 if layers else 0
        return max(pool_layers, seen)

    def compression_view(self, pool_layers: int) -> CompressionView:
        """Rows per third of the layers (``pool_layers``: the pool's layer count, 0 unknown)
        and method: mean ratio, worst K/V error, mean attention-output error and decode time."""
        if not self.compression:
            return CompressionView(rows=(), reason=NO_SHADOW)
        num_layers = self._num_layers(pool_layers)
        group = max(1, math.ceil(num_layers / 3))
        acc: dict[tuple[int, str], list] = {}
        for (layer, _head, method), ev in self.compression.items():
            a = acc.setdefault((layer // group, method), [0.0, 0.0, 0.0, 0, 0.0, 0, 0])
            a[0] += ev.ratio
            a[1] = max(a[1], ev.k_rel_error, ev.v_rel_error)
            if ev.attn_out_rel_error is not None:
                a[2] += ev.attn_out_rel_error
                a[3] += 1
            if ev.decode_ns is not None:
                a[4] += ev.decode_ns
                a[5] += 1
            a[6] += 1
        rows = []
        for (g, method), a in sorted(acc.items(), key=lambda kv: (kv[0][0], kv[1][0] / kv[1][6], kv[0][1])):
            lo, hi = g * group, min(num_layers, (g + 1) * group) - 1
            attn = a[2] / a[3] if a[3] else None
            rows.append(CompressionRow(
                layers=f"{lo}-{hi}" if hi > lo else str(lo), method=method, ratio=a[0] / a[6], error=a[1],
                attn_out_error=attn, decode_us=a[4] / a[5] / 1e3 if a[5] else None, samples=a[6],
                recommendation=compression_verdict(attn if attn is not None else a[1])))
        sampling = sampling_line(msgspec.structs.asdict(self.budget)) if self.budget else ""
        return CompressionView(rows=tuple(rows), reason="", sampling=sampling)

    def locality_view(self) -> LocalityView:
        """Per layer and head, the mean of each locality metric over its samples."""
        if not self.locality_sum:
            return LocalityView(0, 0, {m: () for m in LOCALITY_METRICS}, 0, NO_SHADOW)
        num_layers = max(k[0] for k in self.locality_sum) + 1
        num_heads = max(k[1] for k in self.locality_sum) + 1
        cells = {}
        for i, metric in enumerate(LOCALITY_METRICS):
            grid = [[None] * num_heads for _ in range(num_layers)]  # None: no sample there
            for (layer, head), sums in self.locality_sum.items():
                count = sums[5] if i == 3 else sums[4]
                grid[layer][head] = sums[i] / count if count else None
            cells[metric] = tuple(map(tuple, grid))
        return LocalityView(num_layers, num_heads, cells, self.locality_samples, "")
