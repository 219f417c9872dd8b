"""Percentiles, their bootstrap, Cliff's delta and P99 regression detection, against brute force
and against generated samples whose true shift is known (property tests)."""

from __future__ import annotations

import numpy as np
import pytest

from kvdiag.diagnosis import latency


def test_quantile_is_numpy_inverted_cdf():
    rng = np.random.default_rng(1)
    for n in (1, 7, 100, 1001):
        x = rng.lognormal(size=n)
        for q in (0.5, 0.95, 0.99):
            assert latency.quantile(x, q) == np.quantile(x, q, method="inverted_cdf")


def test_order_statistic_bootstrap_matches_resampling():
    """The Beta-distributed order-statistic draws have the distribution of the P99 of real
    resamples (brute force: resample with replacement, take the quantile)."""
    rng = np.random.default_rng(2)
    x = np.sort(rng.lognormal(0, 0.4, 300))
    fast = latency.bootstrap_quantile(x, 0.99, 20000, np.random.default_rng(3))
    idx = rng.integers(0, len(x), (4000, len(x)))
    brute = np.quantile(x[idx], 0.99, axis=1, method="inverted_cdf")
    for p in (0.05, 0.25, 0.5, 0.75, 0.95):
        a, b = np.quantile(fast, p), np.quantile(brute, p)
        # both are order statistics of x: compare ranks, allowing Monte Carlo noise of 1 rank
        assert abs(np.searchsorted(x, a) - np.searchsorted(x, b)) <= 1


def test_cliffs_delta_brute_force():
    rng = np.random.default_rng(4)
    b = rng.integers(0, 20, 150).astype(float)  # ties on purpose
    c = rng.integers(3, 25, 90).astype(float)
    brute = (np.sign(c[:, None] - b[None, :])).mean()
    assert latency.cliffs_delta(b, c) == pytest.approx(brute)


def test_quantiles_ci_cover_the_estimate():
    x = np.random.default_rng(5).lognormal(0, 0.3, 2000)
    q = latency.quantiles_ci(x)
    assert list(q["quantile"]) == [0.5, 0.95, 0.99]
    assert (q["ci_low"] <= q["value"]).all() and (q["value"] <= q["ci_high"]).all()
    assert latency.quantiles_ci(x[:5]).empty


def test_change_point_finds_injected_shift():
    rng = np.random.default_rng(6)
    v = np.r_[rng.lognormal(0, 0.2, 400), rng.lognormal(np.log(1.5), 0.2, 300)]
    assert abs(latency.change_point(v) - 400) <= 25


def test_too_few_samples_for_a_p99_comparison():
    x = np.random.default_rng(7).lognormal(size=latency.MIN_P99_SAMPLES - 1)
    assert latency.compare(x, x * 2) is None


def _trials(n_base: int, n_cur: int, sigma: float, shift: float) -> int:
    flagged = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        b = rng.lognormal(0, sigma, n_base)
        c = rng.lognormal(0, sigma, n_cur) * shift  # every quantile, P99 included, moves by `shift`
        flagged += latency.compare(b, c, seed=seed).flagged
    return flagged


# (samples per side, sigma of log latency) where a +20% P99 shift must be found. The demo logs
# recorded on this 2-core machine hold ~20 requests and ~100 steps per run with sigma 0.5-1.0,
# where no valid P99 interval is narrow enough (too few samples: compare() returns None);
# benchmarks/bench_regression_power.py --log LOG prints the power at a log's own sizes.
DEMO_SIZES = [(2000, 0.2), (500, 0.1)]


@pytest.mark.parametrize("n,sigma", DEMO_SIZES)
def test_detects_plus_20pct_p99_shift(n, sigma):
    assert _trials(n, n, sigma, 1.2) >= 95


@pytest.mark.parametrize("n,sigma", DEMO_SIZES + [(100, 0.5), (100, 0.2), (500, 0.3)])
def test_flags_nothing_on_identical_distributions(n, sigma):
    assert _trials(n, n, sigma, 1.0) <= 5


@pytest.mark.parametrize("n,sigma", [(300, 0.3), (2000, 0.5)])
def test_within_log_change_point_rarely_flags_a_stationary_series(n, sigma):
    """The split is chosen where the two sides differ most; even so a series without any
    change is flagged in at most 5 of 100 trials."""
    flagged = 0
    for seed in range(100):
        v = np.random.default_rng(seed).lognormal(0, sigma, n)
        i = latency.change_point(v, latency.MIN_P99_SAMPLES)
        c = latency.compare(v[:i], v[i:], seed=seed)
        flagged += c is not None and c.flagged
    assert flagged <= 5
