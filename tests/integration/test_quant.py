"""Quantization round trips, ratios from real bytes, and the KIVI finding on real keys."""

import pytest
import torch

from kvdiag.kernels.quant import FORMATS, INT_BITS, QuantSpec, dequantize, quant_step, quantize, _unpack

from kv_model import prefill_kv


def _storage_bytes(q) -> int:
    """Bytes of the storages behind the stored tensors (no views of larger buffers)."""
    return sum(t.untyped_storage().nbytes() for t in (q.payload, q.scale, q.zero, q.residual) if t is not None)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_round_trip_error_within_half_step_and_ratio_is_real_bytes(fmt, axis):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 75, 64) * torch.linspace(0.1, 8, 64)
    spec = QuantSpec(fmt, axis=axis, group_size=32, residual_tokens=7)
    q = quantize(x, spec, "torch")
    x_hat = dequantize(q, "torch")
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert torch.equal(x_hat[:, :, q.quant_tokens:], x[:, :, q.quant_tokens:])  # residual exact
    head, head_hat = x[:, :, : q.quant_tokens], x_hat[:, :, : q.quant_tokens]
    if fmt == "fp16":
        assert torch.equal(head_hat, head.half().float())
    elif fmt == "bf16":
        assert torch.equal(head_hat, head.bfloat16().float())
    else:
        # round to nearest: half a step (slack for fp32 arithmetic)
        err = (head - head_hat).abs()
        assert (err <= quant_step(q) * (0.5 + 1e-3) + head.abs() * 1e-6 + 1e-6).all()
    # real bytes: the tensors' storages, and the layout formula, agree with nbytes()
    assert _storage_bytes(q) == q.nbytes()
    b, h, t, d = x.shape
    tq = q.quant_tokens
    expected_tq = (t - 7) // 32 * 32 if axis == "channel" and fmt not in ("fp16", "bf16") else t - 7
    assert tq == expected_tq
    bits = {"fp16": 16, "bf16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8, **INT_BITS}[fmt]
    groups = 0 if fmt in ("fp16", "bf16") else b * h * tq * d // 32
    per_group = 4 if fmt in INT_BITS else 2  # fp16 scale (+ fp16 zero for integers)
    expected = b * h * tq * d * bits // 8 + groups * per_group + b * h * (t - tq) * d * 4
    assert q.nbytes() == expected
    assert q.ratio() == pytest.approx(x.numel() * 4 / expected)


def test_packing_low_bits_first():
    codes = torch.tensor([[[[1, 2, 3, 0, 3, 3, 0, 1]]]], dtype=torch.uint8)
    from kvdiag.kernels.quant import _pack

    packed = _pack(codes, 2)
    assert packed.tolist() == [[[[1 | 2 << 2 | 3 << 4 | 0 << 6, 3 | 3 << 2 | 0 << 4 | 1 << 6]]]]
    assert torch.equal(_unpack(packed, 2), codes)


@pytest.mark.model
def test_real_kv_round_trips_every_format():
    """On real K and V the same bounds as on random data: casts equal torch's own casts, the
    residual is exact, and every other value is within half a quantization step."""
    _, kv = prefill_kv()
    k, v = kv[10]
    for fmt in FORMATS:
        for axis in ("token", "channel"):
            for x in (k, v):
                q = quantize(x, QuantSpec(fmt, axis=axis, group_size=32, residual_tokens=5), "torch")
                x_hat = dequantize(q, "torch")
                tq = q.quant_tokens
                assert tq > 0 and torch.equal(x_hat[:, :, tq:], x[:, :, tq:])
                head, head_hat = x[:, :, :tq], x_hat[:, :, :tq]
                if fmt in ("fp16", "bf16"):
                    cast = torch.float16 if fmt == "fp16" else torch.bfloat16
                    assert torch.equal(head_hat, head.to(cast).float()), (fmt, axis)
                else:
                    err = (head - head_hat).abs()
                    assert (err <= quant_step(q) * (0.5 + 1e-3) + head.abs() * 1e-6 + 1e-6).all(), (fmt, axis)


@pytest.mark.model
def test_kivi_keys_per_channel_beat_per_token_on_real_model():
    """KIVI: keys have outlier channels, so grouping keys per channel loses less than per token."""
    _, kv = prefill_kv()
    num = {"channel": 0.0, "token": 0.0}
    den = 0.0
    for k, _ in kv:
        t = k.shape[2] // 32 * 32
        k = k[:, :, :t]
        den += k.pow(2).sum().item()
        for axis in num:
            q = quantize(k, QuantSpec("int4", axis=axis, group_size=32), "torch")
            num[axis] += (dequantize(q, "torch") - k).pow(2).sum().item()
    err = {axis: (n / den) ** 0.5 for axis, n in num.items()}
    print(f"int4 key relative error over all layers: per-channel {err['channel']:.4f}, per-token {err['token']:.4f}")
    assert err["channel"] < err["token"]
