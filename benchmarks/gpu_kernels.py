"""Triton KV quantization kernels vs the torch reference on a CUDA device, in one run.

For each format and grouping axis: checks the Triton result against the torch reference (int
formats and fp16 bit-exact; bf16/fp8 within one step of the format), then reports each
kernel's effective bandwidth (bytes read + bytes written) as a fraction of a device-to-device
copy of the same input (``clone``: its bytes read + written), goal >= 0.7. Exits 0 with
"no CUDA" where there is no CUDA device.
"""

import argparse
import sys

import torch


def timed_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="16,8,4096,128", help="B,H,T,D")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: this benchmark needs a CUDA device (nothing measured)")
        return 0
    from kvdiag.kernels.quant import FORMATS, INT_BITS, QuantSpec, dequantize, quant_step, quantize

    torch.manual_seed(0)
    x = torch.randn(*map(int, args.shape.split(",")), device="cuda", dtype=getattr(torch, args.dtype))
    copy_ms = timed_ms(lambda: x.clone(), args.iters)
    copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
    print(f"{torch.cuda.get_device_name()}  tensor {tuple(x.shape)} {args.dtype}; clone {copy_gbs:.0f} GB/s")
    print(f"{'format':9s} {'axis':8s} {'check':7s} {'quant_frac':>10s} {'dequant_frac':>12s} {'torch_q_frac':>12s}")
    failures = 0
    for fmt in FORMATS:
        for axis in ("token", "channel"):
            spec = QuantSpec(fmt, axis=axis, group_size=32)
            ref, tri = quantize(x, spec, "torch"), quantize(x, spec, "triton")
            x_ref, x_tri = dequantize(ref, "torch"), dequantize(tri, "triton")
            if fmt in INT_BITS or fmt == "fp16":
                ok = torch.equal(ref.payload.view(torch.uint8), tri.payload.view(torch.uint8)) and torch.equal(x_ref, x_tri)
            else:
                step = quant_step(ref).to(x.device) if fmt != "bf16" else x.float().abs() * 2.0 ** -7
                ok = bool(((x_ref.float() - x_tri.float()).abs() <= step * 1.001 + 1e-6).all())
            failures += not ok
            in_bytes = x.numel() * x.element_size()
            q_ms = timed_ms(lambda: quantize(x, spec, "triton"), args.iters)
            dq_ms = timed_ms(lambda: dequantize(tri, "triton"), args.iters)
            tq_ms = timed_ms(lambda: quantize(x, spec, "torch"), max(3, args.iters // 10))
            moved = in_bytes + tri.nbytes()
            frac = lambda ms: moved / ms / 1e6 / copy_gbs  # noqa: E731
            print(f"{fmt:9s} {axis:8s} {'ok' if ok else 'MISMATCH':7s} {frac(q_ms):10.3f} {frac(dq_ms):12.3f} {frac(tq_ms):12.3f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
