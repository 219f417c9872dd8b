"""Run by test_triton_interpret.py in a subprocess with TRITON_INTERPRET=1 (set before triton
is imported): every format and layout through the Triton kernels vs the torch reference."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

from kvdiag.kernels.quant import FORMATS, QuantSpec, dequantize, quant_step, quantize  # noqa: E402

EXACT = {"fp16", "int8", "int4", "int2"}  # the interpreter casts to bf16/fp8 by truncation


def check(name: str, x: torch.Tensor, group: int = 32) -> None:
    for fmt in FORMATS:
        for axis in ("token", "channel"):
            spec = QuantSpec(fmt, axis=axis, group_size=group, residual_tokens=3)
            ref, tri = quantize(x, spec, "torch"), quantize(x, spec, "triton")
            x_ref, x_tri = dequantize(ref, "torch"), dequantize(tri, "triton")
            assert tri.nbytes() == ref.nbytes()
            if ref.scale is not None:
                assert torch.equal(ref.scale, tri.scale), (name, fmt, axis, "scale")
            if ref.zero is not None:
                assert torch.equal(ref.zero, tri.zero), (name, fmt, axis, "zero")
            if fmt in EXACT:
                assert torch.equal(ref.payload.view(torch.uint8), tri.payload.view(torch.uint8)), (name, fmt, axis)
                assert torch.equal(x_ref, x_tri), (name, fmt, axis)
            else:
                # within one step of the format (the float cast rounds differently)
                t = ref.quant_tokens
                head = x[:, :, :t].float()
                step = quant_step(ref)
                if fmt == "bf16":
                    step = (head.abs() * 2.0 ** -7).clamp_min(1e-30)
                diff = (x_ref[:, :, :t] - x_tri[:, :, :t]).abs()
                assert (diff <= step * 1.001 + 1e-7).all(), (name, fmt, axis, float(diff.max()))
            # the Triton decoder reads the reference encoding identically, in every format
            assert torch.equal(dequantize(ref, "triton"), x_ref), (name, fmt, axis, "decode")
            print(name, fmt, axis, "ok")


torch.manual_seed(0)
check("random", torch.randn(1, 2, 67, 64) * 3)
# tiles the kernels cut differently: 4-value groups (8 groups per channel-axis program, the last
# of each stream holding 2), one 128-token group per program with a 64-wide token group, and
# head_dim 128 in 3 streams, its payload rows spanning streams in dequantization
check("group4", torch.randn(2, 1, 43, 16) * 3, group=4)
check("group128", torch.randn(1, 2, 264, 64) * 3, group=128)
check("dim128", torch.randn(1, 3, 35, 128) * 3)
if len(sys.argv) > 1:
    k, v = torch.load(sys.argv[1])
    check("real-k", k)
    check("real-v", v)
print("ALL OK")
