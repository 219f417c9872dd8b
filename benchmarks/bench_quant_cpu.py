"""Quantize+dequantize throughput of the torch path on the CPU, as a fraction of torch.clone
bandwidth on the same tensor (goal >= 0.25). Ratio = clone time / (quantize + dequantize time),
best of N, measured side by side in one run with one torch thread."""

import argparse
import time

import torch

from kvdiag.kernels.quant import FORMATS, QuantSpec, dequantize, quantize


def best_s(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="8,3,1024,64", help="B,H,T,D of the fp32 KV tensor")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(*map(int, args.shape.split(",")))
    print(f"tensor {tuple(x.shape)} fp32, {x.numel() * 4 / 2**20:.1f} MiB")
    print(f"{'format':10s} {'axis':8s} {'ratio_vs_clone':>14s} {'compression':>11s}")
    for fmt in FORMATS:
        for axis in ("token", "channel"):
            spec = QuantSpec(fmt, axis=axis)
            t_clone = best_s(lambda: x.clone(), args.repeat)
            t_q = best_s(lambda: dequantize(quantize(x, spec, "torch"), "torch"), args.repeat)
            print(f"{fmt:10s} {axis:8s} {t_clone / t_q:14.3f} {quantize(x, spec, 'torch').ratio():11.2f}")


if __name__ == "__main__":
    main()
