"""Power and false-alarm rate of P99 regression detection, by sample size and dispersion.

For each (n, sigma): 100 seeded trials of two lognormal samples of n values each with log-std
sigma; in "shift" trials the second is multiplied by 1.2 (its P99 is 20% higher), in "same"
trials it is not. Printed: how many trials were flagged of 100, side by side, and the
smallest n reaching 95/100 per sigma. With --log, sigma and n are also measured on a recorded
log (log-latency MAD x 1.4826 per metric, n = half the samples, as after a mid-log change).
Usage: python benchmarks/bench_regression_power.py [--log LOG]
"""

from __future__ import annotations

import argparse

import numpy as np

from kvdiag.diagnosis import latency

SIZES = (100, 200, 500, 1000, 2000, 5000)
SIGMAS = (0.05, 0.1, 0.2, 0.3, 0.5)


def flagged(n: int, sigma: float, shift: float, trials: int = 100) -> int:
    hits = 0
    for seed in range(trials):
        rng = np.random.default_rng(seed)
        b, c = rng.lognormal(0, sigma, n), rng.lognormal(0, sigma, n) * shift
        cmp = latency.compare(b, c, seed=seed)
        if cmp is None:
            return -1  # fewer samples than a P99 comparison needs
        hits += cmp.flagged
    return hits


def measured(path: str) -> list[tuple[str, int, float]]:
    from kvdiag.diagnosis.frames import load
    logs, _ = load([path])
    out = []
    for metric in latency.METRICS:
        v = latency.samples(logs, metric)["value_ns"].to_numpy()
        v = np.log(v[v > 0])
        if len(v) >= 2 * latency.MIN_SAMPLES:
            out.append((metric, len(v) // 2, float(np.median(np.abs(v - np.median(v))) * 1.4826)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log")
    args = ap.parse_args()
    print("flagged of 100 trials: +20% P99 shift / identical distributions")
    print("sigma  " + "".join(f"{n:>12}" for n in SIZES))
    for sigma in SIGMAS:
        cells = [f"{flagged(n, sigma, 1.2):>5}/{flagged(n, sigma, 1.0):<5}" for n in SIZES]
        print(f"{sigma:<6} " + " ".join(f"{c:>11}" for c in cells))
    if args.log:
        print(f"\nmeasured on {args.log}:")
        for metric, n, sigma in measured(args.log):
            if n < latency.MIN_P99_SAMPLES:
                print(f"  {metric:<10} n={n:<6} sigma={sigma:.3f}: too few samples for a P99 "
                      f"comparison (< {latency.MIN_P99_SAMPLES} per side)")
                continue
            print(f"  {metric:<10} n={n:<6} sigma={sigma:.3f}: shift detected "
                  f"{flagged(n, sigma, 1.2)}/100, identical flagged {flagged(n, sigma, 1.0)}/100")


if __name__ == "__main__":
    main()
