"""The fused CPU kernels (backend="numba") against the torch reference, the oracle: integer
codes, fp8 codes, scales, zeros and x_hat bit-identical on random and adversarial tensors."""

import numba
import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvdiag
from kvdiag.kernels import quant_simd
from kvdiag.kernels.quant import (FP8_DTYPES, INT_BITS, QuantSpec, dequantize, quantize, quantized_nbytes,
                                  round_trip, use_numba)

GROUPED = tuple(FP8_DTYPES) + tuple(INT_BITS)


def _bits(t):
    """A tensor's raw bits, so that -0.0 and 0.0 (or two fp8 patterns) are told apart."""
    if t is None:
        return None
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def assert_same_as_reference(x: torch.Tensor, spec: QuantSpec) -> None:
    ref = quantize(x, spec, "torch")
    fused = quantize(x, spec, "numba")
    assert fused.quant_tokens == ref.quant_tokens and fused.payload.dtype == ref.payload.dtype
    for name in ("payload", "scale", "zero"):
        a, b = getattr(ref, name), getattr(fused, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape, name
            if name == "zero":  # -0.0 vs 0.0 zero points compare equal as values
                assert torch.equal(a, b), name
            else:  # integers (and fp8 codes) bit for bit
                assert torch.equal(_bits(a), _bits(b)), name
    assert fused.nbytes() == ref.nbytes()
    x_ref, x_fused = dequantize(ref, "torch"), dequantize(fused, "numba")
    assert x_fused.dtype == x_ref.dtype and torch.equal(x_fused, x_ref)
    # the fused round trip (no payload) gives the same x_hat, and the stored size from shapes
    x_rt = round_trip(x, spec, "numba")
    assert x_rt.dtype == x_ref.dtype and torch.equal(x_rt, x_ref)
    assert quantized_nbytes(tuple(x.shape), x.dtype, spec) == ref.nbytes()


@pytest.mark.parametrize("fmt", GROUPED)
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_random_kv_matches_reference(fmt, axis):
    torch.manual_seed(1)
    # odd token count, a residual window, and for axis=channel tokens that do not fill a group
    x = torch.randn(2, 3, 77, 64) * torch.linspace(0.01, 20, 64)
    assert_same_as_reference(x, QuantSpec(fmt, axis=axis, group_size=32, residual_tokens=5))


@pytest.mark.parametrize("fmt", GROUPED)
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_adversarial_groups_match_reference(fmt, axis):
    """Constant groups (scale 0), zeros, the fp16 extremes and values down in fp16's (and
    fp8's) subnormal range, in one tensor."""
    torch.manual_seed(2)
    x = torch.randn(1, 2, 64, 32)
    x[0, 0, :32] = 3.25          # constant: token groups and channel groups alike
    x[0, 0, 32:40] = 0.0
    x[0, 1, :16] = torch.randn(16, 32) * 1e-6   # scales in fp16's subnormal range
    x[0, 1, 16:20] = torch.tensor([6.0e4, -6.0e4, 1e-30, -1e-30]).repeat(4, 8)
    x[0, 1, 20:24, ::2] = -0.0
    assert_same_as_reference(x, QuantSpec(fmt, axis=axis, group_size=16))


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_fewer_tokens_than_a_group_keep_everything_in_full_precision(axis):
    x = torch.randn(1, 3, 5, 64)
    spec = QuantSpec("int4", axis=axis, group_size=32, residual_tokens=7)
    q = quantize(x, spec, "numba")
    assert q.quant_tokens == 0 and torch.equal(dequantize(q, "numba"), x)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(GROUPED), axis=st.sampled_from(["token", "channel"]),
       heads=st.integers(1, 3), tokens=st.integers(1, 70), head_dim=st.sampled_from([16, 32, 64, 128]),
       group=st.sampled_from([4, 8, 16, 32, 64]), residual=st.integers(0, 9),
       log_scale=st.integers(-20, 12), seed=st.integers(0, 2**31 - 1))
def test_any_shape_and_magnitude_matches_reference(fmt, axis, heads, tokens, head_dim, group, residual,
                                                    log_scale, seed):
    """Magnitudes from 2**-20 (fp16-subnormal scales) to 2**12 (groups near fp16's range but
    NaN-free: a zero beyond 65504 would be inf in the reference too). Per token, groups of 16
    values and more (what the kernels cover); per channel, any group."""
    if axis == "token":
        group = max(group, 16)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, heads, tokens, head_dim, generator=gen) * 2.0 ** log_scale
    spec = QuantSpec(fmt, axis=axis, group_size=group, residual_tokens=residual)
    assert use_numba(x, spec, "auto")
    assert_same_as_reference(x, spec)


@pytest.mark.parametrize("fmt", ["int4", "int2", "fp8_e5m2"])
@pytest.mark.parametrize("head_dim", [80, 112])
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_head_dims_of_an_odd_number_of_vectors_match_reference(fmt, head_dim, axis):
    """5 and 7 vectors of 16 channels a row: packed in runs of 4, 2 and 1 vectors."""
    torch.manual_seed(3)
    x = torch.randn(1, 2, 40, head_dim) * torch.linspace(0.01, 20, head_dim)
    spec = QuantSpec(fmt, axis=axis, group_size=16)
    assert use_numba(x, spec, "auto")
    assert_same_as_reference(x, spec)


@pytest.mark.parametrize("axis, group, head_dim", [("token", 8, 64), ("token", 32, 8), ("channel", 32, 40)])
def test_layouts_the_kernels_do_not_cover_stay_on_the_reference(axis, group, head_dim):
    x = torch.randn(1, 2, 64, head_dim)
    spec = QuantSpec("int4", axis=axis, group_size=group)
    assert not use_numba(x, spec, "auto")
    assert torch.equal(round_trip(x, spec), dequantize(quantize(x, spec, "torch"), "torch"))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize(x, spec, "numba")


def test_non_fp32_input_round_trips_in_its_dtype():
    x = torch.randn(1, 2, 64, 64).to(torch.bfloat16)
    assert_same_as_reference(x, QuantSpec("int8", axis="channel"))


def test_auto_uses_the_fused_kernels_for_grouped_formats_on_cpu():
    x = torch.randn(1, 1, 32, 64)
    assert use_numba(x, QuantSpec("int4"), "auto") and use_numba(x, QuantSpec("fp8_e4m3", axis="channel"), "auto")
    assert use_numba(x, QuantSpec("fp8_e5m2"), "auto")  # per token too, since the kernels are vectorized
    assert not use_numba(x, QuantSpec("fp16"), "auto") and not use_numba(x, QuantSpec("int4"), "torch")


def test_compiled_code_is_not_cached_inside_the_package():
    encode = quant_simd.token_kernels(8, 32)[1]
    assert encode._cache is not None
    package_dir = str(kvdiag.__path__[0])
    assert not str(numba.config.CACHE_DIR or "").startswith(package_dir)
    locator = encode._cache._cache_path
    assert not str(locator).startswith(package_dir)
