"""Quantize+dequantize throughput on the CPU as a fraction of ``torch.clone`` bandwidth on the
same tensor (goal >= 0.5), for the fused numba kernels and the torch reference side by side.

Ratio = median over repetitions of clone time / (quantize + dequantize) time, clone and round
trip timed in the same repetition, so 1.0 means the round trip moves the tensor as fast as a
copy of it (pairing matters on a shared machine: phases where every call runs several times
slower would otherwise land in one median and not the other). Columns: ``fused``:
``dequantize(quantize(x))`` with ``backend="auto"`` (the fused numba kernels for the grouped
formats, payload materialised: what a stored cache costs); ``rt``: :func:`quant.round_trip`,
the same x_hat in one pass without the payload (what the shadow's error measurement needs);
``torch``: the reference.

Roofline (details in docs/shadow-compression.md): per 16 fp32 values clone is one vector load and
one store. The kernels (kvdiag/kernels/quant_simd.py) keep every value in 16-lane vectors from
load to store; the exact integer round trip still needs about 16 vector operations per 16 values
per token (min, max and a share of the butterfly that reduces 16 groups at once, then subtract,
multiply, add, clamp twice, truncate, multiply, add) and about 12 per channel (no horizontal
reduction), without fused multiply-add (the reference rounds twice). On one core of the
development machine the kernels alone run at about 0.55-0.68 of clone per token and 0.8-0.9 per
channel; with the payload (a second pass over a fresh output, and about 10 us of Python per
call) at 0.22-0.60. Table and discussion: docs/shadow-compression.md.
The tensor is one layer's K (V has the same shape) of
the embedded model (SmolLM2-135M: 3 KV heads, head_dim 64) at 4096 tokens, fp32 as the model
runs on the CPU. Repetitions of clone, fused and reference are interleaved so that noise from
other processes hits all three alike; each row states the thread count and the 1-minute load
average when it was measured. numba compiles into a temporary folder removed at exit (first
calls are warm-ups outside the timed region); nothing else is written.
"""

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time

if not os.environ.get("NUMBA_CACHE_DIR"):  # before kvdiag imports numba's kernels
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvdiag-bench-numba-")
    atexit.register(shutil.rmtree, os.environ["NUMBA_CACHE_DIR"], True)

import torch  # noqa: E402

from kvdiag.kernels.quant import FORMATS, QuantSpec, dequantize, quantize  # noqa: E402
from kvdiag.kernels.quant import round_trip as fused_round_trip  # noqa: E402


def round_trip(x: torch.Tensor, spec: QuantSpec, backend: str) -> torch.Tensor:
    return dequantize(quantize(x, spec, backend), backend)


def interleaved_times_s(fns: dict, repeat: int) -> dict:
    """Seconds per call of each function, calls interleaved: a, b, c, a, b, c, ..."""
    for fn in fns.values():
        fn()  # compile or warm up outside the timed region
    times: dict = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratio(times: dict, name: str, clone: str = "clone") -> float:
    """Median over repetitions of clone time / ``name`` time, each pair from the same repetition
    (adjacent calls): a slow phase of the shared machine hits both sides of a pair alike."""
    return statistics.median(c / f for c, f in zip(times[clone], times[name]))


def best_ratio(times: dict, name: str) -> float:
    """Fastest clone / fastest ``name``: each side's least disturbed call, the estimate least
    moved by other work on the machine (best_f/c, best_rt/c)."""
    return min(times["clone"]) / min(times[name])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,3,4096,64", help="B,H,T,D of the fp32 KV tensor")
    ap.add_argument("--repeat", type=int, default=60, help="interleaved repetitions per row")
    ap.add_argument("--threads", default="1,2", help="torch (and numba) thread counts to measure")
    args = ap.parse_args()
    x = torch.randn(*map(int, args.shape.split(",")))
    print(f"tensor {tuple(x.shape)} fp32 = {x.numel() * 4 / 2**20:.1f} MiB (one layer's K or V); "
          f"median of {args.repeat} interleaved repetitions; {os.cpu_count()} CPUs")
    print(f"{'threads':>7s} {'format':9s} {'axis':8s} {'clone_ms':>8s} {'fused_ms':>8s} {'rt_ms':>8s} {'torch_ms':>8s} "
          f"{'fused/clone':>11s} {'rt/clone':>8s} {'torch/clone':>11s} {'best_f/c':>8s} {'best_rt/c':>9s} "
          f"{'compression':>11s} {'load1':>5s}")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for fmt in FORMATS:
            for axis in ("token", "channel"):
                spec = QuantSpec(fmt, axis=axis)
                times = interleaved_times_s({
                    "clone": lambda: x.clone(),
                    "fused": lambda: round_trip(x, spec, "auto"),
                    "rt": lambda: fused_round_trip(x, spec, "auto"),
                }, args.repeat)
                # the reference on its own, interleaved with clone: its many large temporaries,
                # freed, make the allocator hand fresh pages to whichever call comes next
                times.update(interleaved_times_s({
                    "clone_ref": lambda: x.clone(),
                    "torch": lambda: round_trip(x, spec, "torch"),
                }, max(3, args.repeat // 5)))
                med = {name: statistics.median(ts) for name, ts in times.items()}
                load1 = os.getloadavg()[0]
                print(f"{threads:7d} {fmt:9s} {axis:8s} {med['clone'] * 1e3:8.3f} {med['fused'] * 1e3:8.3f} "
                      f"{med['rt'] * 1e3:8.3f} {med['torch'] * 1e3:8.3f} {paired_ratio(times, 'fused'):11.3f} "
                      f"{paired_ratio(times, 'rt'):8.3f} {paired_ratio(times, 'torch', 'clone_ref'):11.3f} "
                      f"{best_ratio(times, 'fused'):8.3f} {best_ratio(times, 'rt'):9.3f} "
                      f"{quantize(x, spec, 'torch').ratio():11.2f} {load1:5.2f}")


if __name__ == "__main__":
    main()
