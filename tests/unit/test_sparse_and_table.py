"""Sparse selection vs brute force; per-group table and recommendation vs a direct groupby."""

import math

import pytest
import torch

from kvdiag.diagnosis.compression import compression_table, frame_of, parse_groups, recommend
from kvdiag.kernels import sparse
from kvdiag.events.schema import ShadowCompression


def test_sparse_rules_match_brute_force():
    torch.manual_seed(1)
    k, v = torch.randn(2, 3, 40, 8), torch.randn(2, 3, 40, 8)
    mass = torch.rand(2, 3, 40)
    n = 10
    top = sparse.topk_norm(k, v, 0.25)
    heavy = sparse.h2o(k, v, 0.25, mass, recent_frac=0.5)
    stream = sparse.streaming(k, v, 0.25, sinks=4)
    for b in range(2):
        for h in range(3):
            norms = [float(k[b, h, i].norm()) for i in range(40)]
            assert set(top.indices[b, h].tolist()) == set(sorted(range(40), key=lambda i: -norms[i])[:n])
            older = sorted(range(35), key=lambda i: -float(mass[b, h, i]))[:5]
            assert set(heavy.indices[b, h].tolist()) == set(older) | set(range(35, 40))
            assert stream.indices[b, h].tolist() == [0, 1, 2, 3] + list(range(34, 40))
    k_hat, v_hat = stream.decode()
    keep = stream.keep_mask()
    assert torch.equal(k_hat[keep], k[keep]) and (k_hat[~keep] == 0).all() and torch.equal(v_hat[keep], v[keep])
    assert stream.nbytes() == 2 * 2 * 3 * n * 8 * 4 + 2 * 3 * n * 2  # kept rows + int16 indices
    assert stream.ratio() == pytest.approx(2 * 2 * 3 * 40 * 8 * 4 / stream.nbytes())


def test_parse_groups():
    assert parse_groups("1-6,7-12,13+") == [("1-6", 1, 6), ("7-12", 7, 12), ("13+", 13, None)]
    assert parse_groups("13+", num_layers=30) == [("13+", 13, 30)]
    with pytest.raises(ValueError, match="expected N, N-M or N\\+"):
        parse_groups("1-6,x")


def _ev(step, layer, head, method, ratio, err, seq=100, enc=1000):
    return ShadowCompression(ts_ns=step, layer=layer, head=head, method=method, seq_len_tokens=seq,
                             ratio=ratio, k_rel_error=err, v_rel_error=err, attn_score_error=err,
                             attn_out_rel_error=err, encode_ns=enc, decode_ns=2 * enc)


def test_table_and_recommendation():
    events = []
    for step in range(2):
        for layer in range(14):  # 0-based; layers 0-5 -> "1-6", 6-11 -> "7-12", 12-13 -> "13+"
            for head in range(3):
                e = 0.001 * (layer + 1) + 0.0001 * head + 0.00001 * step
                seq = 600 if layer >= 12 else 100
                events += [_ev(step, layer, head, "int8", 2.6, e, seq), _ev(step, layer, head, "int4", 3.6, 10 * e, seq),
                           _ev(step, layer, head, "h2o", 7.9, 0.5 * e, seq)]
    df = frame_of(events, ShadowCompression)
    table = compression_table(df)
    assert list(dict.fromkeys(table["group"])) == ["1-6", "7-12", "13+"]
    row = table[(table.group == "7-12") & (table.method == "int4")].iloc[0]
    direct = [ev.attn_out_rel_error for ev in events if 6 <= ev.layer <= 11 and ev.method == "int4"]
    assert row["attn_out_rel_error"] == pytest.approx(sum(direct) / len(direct))
    assert row["samples"] == len(direct)
    assert row["decode_us"] == pytest.approx(3 * 2000 / 1e3)  # 3 heads' decode per layer-step
    rec = recommend(table, error_budget=0.03).set_index("group")
    mean_int4_1_6 = sum(ev.attn_out_rel_error for ev in events if ev.layer < 6 and ev.method == "int4") / 36
    assert (rec.loc["1-6", "method"] == "int4") == (mean_int4_1_6 <= 0.03)
    assert rec.loc["7-12", "method"] == "int8"  # h2o is cheaper but sequences are < 512 tokens
    assert rec.loc["13+", "method"] == "h2o"  # median 600 tokens: sparse allowed
    rec_none = recommend(table, error_budget=1e-9)
    assert rec_none["method"].isna().all()
    assert math.isclose(rec_none["ratio"].iloc[0], 1.0)
