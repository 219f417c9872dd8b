"""Differential KV writes: the delta codec round-trips within its stated bound and its byte
count matches a brute-force count; on real KV, full >= dedup >= delta on every block;
duplicates, rewrites and the attention error agree with direct computations; the driver
reuses shared blocks and rewrites partial ones; the report gets its section."""

import math

import numpy as np
import pytest
import torch

from kvdiag.kernels import delta as D
from kvdiag.events.schema import ShadowDelta
from kvdiag.events.sinks import ListSink


def _random_block(seed: int, t: int, h: int = 3, d: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, h, t, d, generator=g) * torch.rand(2, h, 1, d, generator=g) * 4
    x[0, 0, :, 3] += 40.0  # an outlier channel, as RoPE'd keys have
    return x


def _bound_ok(x, x_hat, bound):
    eps = torch.from_numpy(D.eps_of(x, bound)).double()[:, :, None, None]
    err = (x.double() - x_hat.double()).abs()
    slack = x_hat.double().abs() * 2.0 ** -24  # fp32 rounding of x_hat
    return bool((err <= eps + slack + 1e-300).all()), float((err / eps).max())


def _brute_force_bytes(x, ref, bound) -> int:
    """Stream size recomputed element by element from the docstring's layout."""
    s, h, t, d = x.shape
    eps = D.eps_of(x, bound)
    total = D.fixed_header_bytes(h) + math.ceil(s * h * t / 2)
    for a in range(s):
        for b in range(h):
            step = 2.0 * float(eps[a, b])
            for i in range(t):
                biggest = 0
                for j in range(d):
                    diff = float(x[a, b, i, j]) - (float(ref[a, b, i, j]) if ref is not None else 0.0)
                    biggest = max(biggest, abs(round(diff / step)))
                width = next((w for w, lim in zip((0, 2, 4, 8, 16), (0, 1, 7, 127, 32767)) if biggest <= lim), 32)
                total += d * width // 8
    return total


@pytest.mark.parametrize("t", [32, 17, 1])
@pytest.mark.parametrize("bound", [0.05, 0.01, 0.001])
def test_round_trip_within_the_stated_bound(t, bound):
    x = _random_block(t, t)
    near = x + 0.003 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    far = _random_block(99, t)
    for ref in (None, near, far, x.clone()):
        enc = D.encode(x, ref, bound, ref_id=5)
        x_hat = D.decode(enc.blob, ref, x.shape[1], x.shape[3])
        ok, worst = _bound_ok(x, x_hat, bound)
        assert ok, worst
        assert sum(enc.rows_by_class) == 2 * 3 * t
    same = D.encode(x, x.clone(), bound)
    assert same.rows_by_class[0] == 2 * 3 * t  # identical reference: every row is zero codes
    assert same.nbytes == D.fixed_header_bytes(3) + 3 * t


def test_byte_count_matches_a_brute_force_count():
    x = _random_block(3, 20)
    near = x + 0.02 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    for ref in (None, near):
        assert D.encode(x, ref, 0.01).nbytes == _brute_force_bytes(x, ref, 0.01)


def test_rows_beyond_16_bits_are_stored_exactly():
    x = _random_block(4, 8)
    x[1, 2, 5, 7] = 3e7  # makes its row's code huge relative to a tight bound
    enc = D.encode(x, None, 1e-6)
    assert enc.rows_by_class[5] >= 1
    x_hat = D.decode(enc.blob, None, 3, 64)
    assert x_hat[1, 2, 5, 7] == x[1, 2, 5, 7]
    assert _bound_ok(x, x_hat, 1e-6)[0]


@pytest.mark.model
def test_writer_on_real_kv_orders_bytes_and_finds_duplicates_and_rewrites():
    from kv_model import prefill_kv

    _, kv = prefill_kv()
    sink = ListSink()
    w = D.DeltaWriter(sink, bound=0.01)
    h, d = kv[0][0].shape[1], kv[0][0].shape[3]
    w.write("a", 0, kv, 0, 16)  # a partial block
    w.write("a", 0, kv, 0, 32)  # rewritten with more tokens
    w.write("b", 0, kv, 0, 32)  # the same block under another key: a bitwise duplicate
    w.write("c", 1, kv, 32, 64)
    # the same positions with slightly different content: a near duplicate
    noisy = [(k + 1e-3 * torch.randn_like(k), v + 1e-3 * torch.randn_like(v)) for k, v in kv]
    w.write("d", 1, noisy, 32, 64)
    ev = sink.events
    layers = len(kv)
    assert len(ev) == 5 * layers and all(isinstance(e, ShadowDelta) for e in ev)
    for e in ev:
        assert e.full_bytes == 2 * h * e.block_tokens * d * 4  # fp32 K and V
        assert e.full_bytes >= e.dedup_bytes >= e.delta_bytes, e
        assert e.k_rel_error <= 0.01 and e.v_rel_error <= 0.01  # elementwise bound => Frobenius bound
    first, rewrite, dup, fresh, near = (ev[i * layers:(i + 1) * layers] for i in range(5))
    assert all(not e.rewrite and e.prev_bytes is None for e in first)
    assert all(e.rewrite and e.prev_bytes is not None and e.prev_bytes < e.quant_bytes for e in rewrite)
    assert all(e.reference == "previous" for e in rewrite)
    assert all(e.reference == "duplicate" and e.dedup_bytes == D.REF_BYTES == e.delta_bytes for e in dup)
    assert all(e.dedup_bytes == e.full_bytes for e in fresh + near)
    assert all(e.reference == "other" and e.delta_bytes < e.quant_bytes for e in near)


@pytest.mark.model
def test_attention_error_matches_a_direct_computation():
    from kv_model import prefill_kv

    _, kv = prefill_kv()
    k, v = kv[5]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 1, k.shape[-1], generator=g) * 3
    x = torch.stack([k[0, :, 32:64], v[0, :, 32:64]])
    enc = D.encode(x, None, 0.05)
    x_hat = D.decode(enc.blob, None, k.shape[1], k.shape[3])
    got = D.attn_out_rel_error(q, k, v, 32, 64, x_hat)
    # by hand, in float64 numpy: softmax over all positions, query head i reads kv head i // 3
    kn, vn = k[0].double().numpy(), v[0].double().numpy()
    kh, vh = kn.copy(), vn.copy()
    kh[:, 32:64], vh[:, 32:64] = x_hat[0].double().numpy(), x_hat[1].double().numpy()
    num = den = 0.0
    for head in range(9):
        qv = q[0, head, 0].double().numpy()
        outs = []
        for kk, vv in ((kn, vn), (kh, vh)):
            s = kk[head // 3] @ qv / math.sqrt(k.shape[-1])
            p = np.exp(s - s.max())
            outs.append((p / p.sum()) @ vv[head // 3])
        num += ((outs[0] - outs[1]) ** 2).sum()
        den += (outs[0] ** 2).sum()
    assert got == pytest.approx(math.sqrt(num / den), rel=1e-3)
    assert got > 0


def test_table_savings_are_the_sums_of_the_events():
    from kvdiag.diagnosis.compression import frame_of
    from kvdiag.diagnosis.delta_writes import delta_table

    rows = []
    for layer in range(14):
        for i, ref in enumerate(("zero", "duplicate", "previous")):
            rows.append(ShadowDelta(ts_ns=1, layer=layer, block_index=i, block_tokens=32, seq_len_tokens=100,
                                    rewrite=ref == "previous", full_bytes=1000, dedup_bytes=8 if ref == "duplicate" else 1000,
                                    delta_bytes=8 if ref == "duplicate" else 300 + layer, quant_bytes=500,
                                    prev_bytes=200 if ref == "previous" else None, reference=ref, error_bound=0.01,
                                    k_rel_error=0.01, v_rel_error=0.02, attn_out_rel_error=0.001 * layer,
                                    encode_ns=1000, decode_ns=500))
    table = delta_table(frame_of(rows, ShadowDelta)).set_index("group")
    assert list(table.index) == ["1-6", "7-12", "13+", "all"]
    first = [r for r in rows if r.layer < 6]
    full = sum(r.full_bytes for r in first)
    assert table.loc["1-6", "dedup_saving"] == pytest.approx(1 - sum(r.dedup_bytes for r in first) / full)
    assert table.loc["1-6", "delta_saving"] == pytest.approx(1 - sum(r.delta_bytes for r in first) / full)
    assert table.loc["all", "quant_saving"] == pytest.approx(0.5)
    assert table.loc["all", "prev_saving"] == pytest.approx(0.8)
    assert table.loc["13+", "rewrites"] == 2
    prev = [r for r in rows if r.reference == "previous"]
    assert table.loc["all", "delta_vs_quant_referenced"] == pytest.approx(
        1 - sum(r.delta_bytes for r in prev) / sum(r.quant_bytes for r in prev))
    assert table.loc["all", "ref_duplicate"] == pytest.approx(1 / 3)
    assert table.loc["all", "encode_us"] == pytest.approx(1.0)


@pytest.mark.model
def test_driver_shares_prefixes_rewrites_partial_blocks_and_reports(tmp_path):
    from kv_model import model_and_tokenizer

    from kvdiag.shadow.delta_traffic import delta_traffic

    model, tok = model_and_tokenizer()
    system = "You are a helpful assistant for a small bookshop. " * 12
    turns = [("c0", system, "Do you sell maps?"), ("c1", system, "When do you open?"),
             ("c0", system, "And atlases?")]
    sink = ListSink()
    run = delta_traffic(model, tok, D.DeltaWriter(sink, 0.01), turns, max_new_tokens=4, block_tokens=32)
    assert run.turns == 3 and run.reused_tokens >= 2 * 32  # c1 and c0's follow-up reuse shared blocks
    ev = sink.events
    assert all(e.full_bytes >= e.dedup_bytes >= e.delta_bytes for e in ev)
    assert any(e.reference == "duplicate" for e in ev)  # c1's system-prompt blocks: bitwise c0's
    assert any(e.rewrite and e.prev_bytes is not None for e in ev)  # c0's grown partial block
    assert run.blocks_written < run.blocks_seen  # c0's unchanged blocks are not written again

    from kvdiag.cli import main
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter

    log = tmp_path / "delta.jsonl"
    with LogWriter(log, make_header()) as w:
        for e in ev:
            w.record(e)
    assert main(["report", str(log), "--format", "md", "-o", str(tmp_path / "r.md")]) == 0
    body = (tmp_path / "r.md").read_text().split("## Differential KV writes\n", 1)[1].split("\n## ", 1)[0]
    assert "| all |" in body and "dedup_saving" in body


@pytest.mark.parametrize("bad", [["--turns", "0"], ["--block-tokens", "0"], ["--delta-bound", "0"],
                                 ["--delta-bound", "1.5"]])
def test_bad_delta_options_exit_2_with_one_line(bad, capsys):
    from kvdiag.cli import main

    assert main(["shadow", "--delta", *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--delta-bound" in err


def test_full_bytes_are_in_the_served_dtype_and_the_order_holds_for_fp16():
    x = _random_block(7, 64).half()
    kv = [(x[0][None], x[1][None])]
    sink = ListSink()
    w = D.DeltaWriter(sink, bound=0.01)
    w.write("a", 0, kv, 0, 32)
    w.write("b", 0, kv, 0, 32)
    for e in sink.events:
        assert e.full_bytes == 2 * 3 * 32 * 64 * 2
        assert e.full_bytes >= e.dedup_bytes >= e.delta_bytes
    assert sink.events[1].reference == "duplicate"
