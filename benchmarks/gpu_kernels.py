"""Triton KV quantization kernels vs the torch reference on a CUDA device, in one run.

For each format and grouping axis: checks the Triton result against the torch reference
("exact", or "1step:N" when N values differ by one quantization step, e.g. where the GPU fuses a
multiply-add; anything larger is a MISMATCH and exits 1), then reports each
kernel's effective bandwidth (bytes read + bytes written) as a fraction of a device-to-device
copy of the same input (``clone``: its bytes read + written), goal >= 0.7. Exits 0 with
"no CUDA" where there is no CUDA device. ``--interpret-cpu`` runs the same checks on the CPU
under TRITON_INTERPRET=1 (small tensor; its timings mean nothing), to test this script itself.
"""

import argparse
import os
import sys
import time


def timed_ms(fn, iters: int) -> float:
    import torch

    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
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
    ap.add_argument("--interpret-cpu", action="store_true", help="dry run on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.interpret_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.interpret_cpu:
        print("no CUDA: this benchmark needs a CUDA device (nothing measured)")
        return 0
    if args.interpret_cpu:
        args.shape, args.iters = "1,2,64,64", 1
    from kvdiag.kernels.quant import FORMATS, INT_BITS, QuantSpec, _unpack, dequantize, quant_step, quantize

    torch.manual_seed(0)
    x = torch.randn(*map(int, args.shape.split(",")), device=device, dtype=getattr(torch, args.dtype))
    copy_ms = timed_ms(lambda: x.clone(), args.iters)
    copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(f"{name}  tensor {tuple(x.shape)} {args.dtype}; clone {copy_gbs:.0f} GB/s")
    print(f"{'format':9s} {'axis':8s} {'check':12s} {'quant_frac':>10s} {'dequant_frac':>12s} {'torch_q_frac':>12s}")
    failures = 0
    for fmt in FORMATS:
        for axis in ("token", "channel"):
            spec = QuantSpec(fmt, axis=axis, group_size=32)
            ref, tri = quantize(x, spec, "torch"), quantize(x, spec, "triton")
            x_ref, x_tri = dequantize(ref, "torch"), dequantize(tri, "triton")
            if torch.equal(x_ref, x_tri):
                check = "exact"
            elif fmt in INT_BITS:
                codes = (_unpack(ref.payload, INT_BITS[fmt]).int() - _unpack(tri.payload, INT_BITS[fmt]).int()).abs()
                check = f"1step:{int((codes > 0).sum())}" if int(codes.max()) <= 1 else "MISMATCH"
            else:
                step = quant_step(ref).to(x.device) if fmt != "bf16" else x.float().abs() * 2.0 ** -7
                diff = (x_ref.float() - x_tri.float()).abs()
                ok = bool((diff <= step * 1.001 + 1e-6).all())
                check = f"1step:{int((diff > 0).sum())}" if ok else "MISMATCH"
            failures += check == "MISMATCH"
            in_bytes = x.numel() * x.element_size()
            q_ms = timed_ms(lambda: quantize(x, spec, "triton"), args.iters)
            dq_ms = timed_ms(lambda: dequantize(tri, "triton"), args.iters)
            tq_ms = timed_ms(lambda: quantize(x, spec, "torch"), max(3, args.iters // 10))
            moved = in_bytes + tri.nbytes()
            frac = lambda ms: moved / ms / 1e6 / copy_gbs  # noqa: E731
            print(f"{fmt:9s} {axis:8s} {check:12s} {frac(q_ms):10.3f} {frac(dq_ms):12.3f} {frac(tq_ms):12.3f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
