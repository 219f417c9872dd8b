"""The latency sketches (kvdiag.diagnosis.sketch): quantiles within ALPHA of numpy's exact
percentiles (the bound is the construction's guarantee), exact merges, and a series whose
state depends on its samples only (order, splits and merges do not matter) in bounded memory."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from kvdiag.diagnosis.latency import quantile as exact_quantile
from kvdiag.diagnosis.sketch import ALPHA, MAX_BUCKETS, Sketch, SketchSeries

QS = (0.0, 0.01, 0.1, 0.25, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)


def _samples(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "lognormal":  # engine steps: ms with a long tail, in ns
        return rng.lognormal(np.log(20e6), 1.0, n)
    if kind == "pareto":
        return (rng.pareto(1.5, n) + 1) * 1e5
    if kind == "bimodal":
        return np.r_[rng.normal(5e6, 1e5, n // 2), rng.normal(4e9, 1e8, n - n // 2)]
    if kind == "ties":  # integer ns with many repeats, zeros included
        return rng.integers(0, 50, n).astype("float64") * 1000
    if kind == "signed":  # clock skew: some negative waits
        return rng.normal(0, 1e6, n)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["lognormal", "pareto", "bimodal", "ties", "signed"])
@pytest.mark.parametrize("n", [1, 7, 100, 5_000])
def test_quantiles_within_alpha_of_numpy(kind, n):
    rng = np.random.default_rng(n)
    x = _samples(kind, n, rng)
    sk = Sketch()
    sk.add(x)
    assert sk.count == n and sk.min == x.min() and sk.max == x.max()
    assert sk.sum == pytest.approx(x.sum(), rel=1e-12, abs=1e-6)
    xs = np.sort(x)
    for q in QS:
        # brute force: the ceil(q n)-th smallest, q n in exact rational arithmetic (numpy's
        # inverted_cdf, whose float product q * n can round up past an integer)
        exact = float(xs[min(max(math.ceil(Fraction(str(q)) * n), 1), n) - 1])
        assert exact == exact_quantile(x, q)  # the doctor's quantile
        est = sk.quantile(q)
        assert abs(est - exact) <= ALPHA * abs(exact) * (1 + 1e-12), (kind, n, q, est, exact)


def test_bin_edges_keep_the_bound():
    """Values on and next to the bins' edges gamma^k (where floating point rounding of the
    logarithm would put them in the neighbouring bin)."""
    gamma = (1 + ALPHA) / (1 - ALPHA)
    k = np.arange(-50, 2_000)
    edges = gamma ** k.astype("float64")
    x = np.r_[edges, np.nextafter(edges, 0), np.nextafter(edges, np.inf)]
    for v in x:
        sk = Sketch()
        sk.add([v, v])  # min == max would clamp: check the bin's own value via a neighbour
        sk.add([v * 1e6])
        assert abs(sk.quantile(0.5) - v) <= ALPHA * v * (1 + 1e-12)


def test_merge_is_the_sketch_of_the_union():
    rng = np.random.default_rng(1)
    x = _samples("lognormal", 3_000, rng)
    whole, a, b = Sketch(), Sketch(), Sketch()
    whole.add(x)
    a.add(x[:1_234])
    b.add(x[1_234:])
    assert a.merge(b) == whole
    assert [a.quantile(q) for q in QS] == [whole.quantile(q) for q in QS]


def test_series_is_a_function_of_its_samples():
    """Any order and any split into batches or merged parts give the same buckets and width."""
    rng = np.random.default_rng(2)
    n = 20_000
    ts = np.sort(rng.integers(0, 3_600 * 10**9, n))  # an hour
    v = _samples("lognormal", n, rng)
    one = SketchSeries()
    one.add(ts, v)
    shuffled = SketchSeries()
    order = rng.permutation(n)
    for chunk in np.array_split(order, 37):
        shuffled.add(ts[chunk], v[chunk])
    parts = [SketchSeries() for _ in range(3)]
    for i, p in enumerate(parts):
        p.add(ts[i::3], v[i::3])
    merged = parts[1].merge(parts[0]).merge(parts[2])
    assert one == shuffled == merged
    assert len(one.buckets) <= MAX_BUCKETS
    assert one.count == n
    # the width is the smallest power-of-two multiple of the base whose buckets hold the span
    span = ts.max() // one.width_ns - ts.min() // one.width_ns + 1
    assert span <= MAX_BUCKETS < ts.max() // (one.width_ns // 2) - ts.min() // (one.width_ns // 2) + 1
    # a window of whole buckets is the sketch of exactly those samples
    cut = int(sorted(one.buckets)[len(one.buckets) // 2] * one.width_ns)
    direct = Sketch()
    direct.add(v[ts >= cut])
    assert one.total(start_ns=cut) == direct


def test_series_of_different_widths_merge_into_the_series_of_the_union():
    rng = np.random.default_rng(4)
    short_ts = 10**12 + rng.integers(0, 10**9, 500)  # one second: 1 ms buckets
    long_ts = rng.integers(0, 7 * 86_400 * 10**9, 500)  # a week: wide buckets
    v1, v2 = _samples("pareto", 500, rng), _samples("lognormal", 500, rng)
    a, b, both = SketchSeries(), SketchSeries(), SketchSeries()
    a.add(short_ts, v1)
    b.add(long_ts, v2)
    both.add(np.r_[short_ts, long_ts], np.r_[v1, v2])
    assert a.width_ns < b.width_ns
    assert a.copy().merge(b) == both == b.copy().merge(a)


def test_a_day_long_series_stays_flat():
    """Memory of a series fed a day of samples equals that after an hour's within a factor set by
    the cap: at most MAX_BUCKETS sketches of at most the value range's bins."""
    rng = np.random.default_rng(3)
    series = SketchSeries()
    sizes = []
    for hour in range(24):
        ts = hour * 3_600 * 10**9 + np.sort(rng.integers(0, 3_600 * 10**9, 50_000))
        series.add(ts, _samples("lognormal", len(ts), rng))
        sizes.append(series.nbytes())
        assert len(series.buckets) <= MAX_BUCKETS
    bins_max = int(np.log(1e12) / np.log((1 + ALPHA) / (1 - ALPHA))) + 1  # 1 ns .. 1000 s
    assert sizes[-1] <= MAX_BUCKETS * bins_max * 8
    assert series.count == 24 * 50_000


# ---------------------------------------------------------------- the latency series of a log

DATA = Path(__file__).parent.parent / "data"
RECORDED = sorted(p for p in DATA.rglob("*") if p.name.endswith((".kvlog", ".kvlog.gz")))


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.parent.name + "/" + p.name)
def test_live_fold_equals_the_doctors_and_its_quantiles_the_raw_ones(path):
    """top's LiveRules fold of a replayed log holds the same latency series as the doctor's
    fold of the file, and each series' P50/P99 lies within ALPHA of the exact quantile of the
    raw samples (kvdiag.diagnosis.latency.samples over the log's frames)."""
    from kvdiag.diagnosis import latency_facts as latencyfacts
    from kvdiag.diagnosis import latency
    from kvdiag.diagnosis.frames import load
    from kvdiag.events.eventlog import iter_events
    from kvdiag.live.rules import LiveRules

    rules = LiveRules(clock=lambda: 0.0)
    batch: list = []
    for ev in iter_events(path):
        batch.append(ev)
        if len(batch) == 1_000:
            rules.record(batch)
            batch = []
    rules.record(batch)
    live = rules.latency.copy_series()
    logs = load([path])[0]
    offline = latencyfacts.series(logs)
    assert live == offline
    finished = logs.frame("request_finished")
    finished = finished[finished["status"] == "finished"] if len(finished) else finished
    for metric in latencyfacts.SERIES:
        raw = latency.samples(logs, metric)
        if metric == "step" and len(finished):  # the warm-up: a node's steps up to its first finish
            since = raw["node"].map(finished.groupby("node")["ts_ns"].min())
            raw = raw[since.isna() | (raw["ts_ns"] > since)]
        raw = raw["value_ns"].to_numpy()
        total = offline[metric].total()
        assert total.count == len(raw), metric
        for q in (0.5, 0.99):
            if len(raw):
                exact = latency.quantile(raw, q)
                assert abs(total.quantile(q) - exact) <= ALPHA * abs(exact) * (1 + 1e-12), (metric, q)
