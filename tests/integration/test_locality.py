"""Locality recomputed by kvdiag from captured queries + cached keys == the same metrics from
transformers' own eager attention weights (output_attentions=True), on the real model."""

import pytest
import math

import torch
from transformers import DynamicCache

from kvdiag.diagnosis import locality as analysis
from kvdiag.kernels.attention import QueryCapture, locality_events
from kvdiag.events.schema import ShadowLocality

from kv_model import model_and_tokenizer, prefill_kv

EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

pytestmark = pytest.mark.model


def _brute_force(p_row: list[float]) -> dict:
    """The documented definitions, one position at a time."""
    t = len(p_row)
    recent = math.ceil(0.2 * t)
    sinks = min(4, t - recent)
    out = {"recent_mass": 0.0, "sink_mass": 0.0, "other_mass": 0.0, "entropy_nats": 0.0,
           "distance_hist": [0.0] * len(EDGES)}
    for pos, p in enumerate(p_row):
        if pos >= t - recent:
            out["recent_mass"] += p
        elif pos < sinks:
            out["sink_mass"] += p
        else:
            out["other_mass"] += p
        if p > 0:
            out["entropy_nats"] -= p * math.log(p)
        d = t - 1 - pos
        out["distance_hist"][max(i for i, e in enumerate(EDGES) if d >= e)] += p
    return out


def test_locality_matches_eager_attention_weights():
    model, _ = model_and_tokenizer()
    ids, _ = prefill_kv()
    cache = DynamicCache(config=model.config)
    capture = QueryCapture(model)
    try:
        with torch.no_grad():
            model(input_ids=ids[:, :-1], cache=cache, use_cache=True)
            capture.armed = True
            out = model(input_ids=ids[:, -1:], cache=cache, use_cache=True, output_attentions=True)
            queries = capture.queries()
    finally:
        capture.close()
    assert len(out.attentions) == model.config.num_hidden_layers
    from kvdiag.kernels.attention import attention_probs

    for layer in (0, 11, 29):
        k = cache.layers[layer].keys
        p = attention_probs(queries[layer], k, capture.scaling(layer))[:, :, -1, :]
        eager = out.attentions[layer][:, :, -1, :]
        assert torch.allclose(p, eager, atol=1e-5), float((p - eager).abs().max())
        events = locality_events(layer, p)
        outside = []
        for h, ev in enumerate(events):
            ref = _brute_force(eager[0, h].double().tolist())
            for key in ("recent_mass", "sink_mass", "other_mass", "entropy_nats"):
                assert abs(getattr(ev, key) - ref[key]) < 1e-5, (layer, h, key)
            assert max(abs(a - b) for a, b in zip(ev.distance_hist, ref["distance_hist"])) < 1e-5
            outside.append(ref["sink_mass"] + ref["other_mass"])
        for h, ev in enumerate(events):
            assert abs(ev.outside_share - outside[h] / sum(outside)) < 1e-5


def _events(rows):
    return [ShadowLocality(ts_ns=i, layer=l, head=h, seq_len_tokens=10, recent_mass=r, sink_mass=s,
                           other_mass=1 - r - s, entropy_nats=1.0, outside_share=o, distance_hist=[1.0] + [0.0] * 14)
            for i, (l, h, r, s, o) in enumerate(rows)]


def test_analysis_heatmap_and_top_heads():
    from kvdiag.diagnosis.compression import frame_of

    rows = [(0, h, 0.1 * h, 0.05, o) for h, o in enumerate([0.1, 0.4, 0.2, 0.3])]
    rows += [(0, 1, 0.3, 0.05, 0.4)]  # a second sample of head 1: means over samples
    df = frame_of(_events(rows), ShadowLocality)
    heat = analysis.heatmap(df, "recent_mass")
    assert heat.shape == (1, 4)
    assert abs(heat.loc[0, 1] - 0.2) < 1e-12
    top = analysis.top_heads(df, k=3).iloc[0]
    assert top["top_heads"] == [1, 3, 2]
    assert abs(top["top_share"] - 0.9) < 1e-12
    assert analysis.by_head(df.iloc[0:0]).empty
    # distance profile: per layer, the mean of the heads' and steps' histograms, bin by bin
    hists = [[0.5, 0.5] + [0.0] * 13, [0.1, 0.2, 0.7] + [0.0] * 12, [0.0] * 14 + [1.0]]
    evs = [ShadowLocality(ts_ns=i, layer=layer, head=i, seq_len_tokens=10, recent_mass=0.5, sink_mass=0.1,
                          other_mass=0.4, entropy_nats=1.0, outside_share=0.5, distance_hist=h)
           for i, (layer, h) in enumerate(zip([0, 0, 3], hists))]
    prof = analysis.distance_profile(frame_of(evs, ShadowLocality)).set_index("layer")
    labels = [f"[{lo},{hi})" for lo, hi in zip(EDGES, EDGES[1:])] + [f"[{EDGES[-1]},inf)"]
    assert list(prof.columns) == labels and prof.index.tolist() == [0, 3]
    assert prof.loc[0].tolist() == pytest.approx([(a + b) / 2 for a, b in zip(hists[0], hists[1])], abs=1e-15)
    assert prof.loc[3].tolist() == hists[2]
