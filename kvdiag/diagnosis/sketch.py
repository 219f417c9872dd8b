"""Mergeable latency sketches per time bucket: the rules' latency inputs in bounded memory.

:class:`Sketch` is a DDSketch-style log-bucketed histogram (Masson, Rim, Lee, "DDSketch", VLDB
2019) with relative accuracy :data:`ALPHA` (1%): a value ``x > 0`` is counted in bin
``i = ceil(log_gamma(x))`` with ``gamma = (1 + ALPHA) / (1 - ALPHA)``, i.e. ``gamma^(i-1) < x <=
gamma^i``; bin ``i`` stands for ``2 gamma^i / (gamma + 1)``, which is within ``ALPHA`` of every
value of the bin (relative). Negative values are counted alike in a mirrored store, zeros in a
zero count. Counts, sums, minimum and maximum are exact; two sketches merge by adding their
bins, exactly (the merge of two sketches is the sketch of the union of their values).

Quantiles follow :func:`kvdiag.diagnosis.latency.quantile` (the inverse empirical CDF: the
``ceil(q n)``-th smallest value). The sketch returns the value standing for the bin that holds
that rank, clamped to the exact [min, max]; the exact ``ceil(q n)``-th smallest value lies in
that bin, so **the sketch's quantile differs from numpy's ``inverted_cdf`` percentile of the
same values by at most ALPHA relative** (``|est - exact| <= ALPHA |exact|``), a property of the
construction, not a measured tolerance (``tests/integration/test_sketch.py`` checks it against brute force).

:class:`SketchSeries` keeps one sketch per time bucket of fixed width. Bucket ``k`` holds the
samples with ``k = ts_ns // width_ns``; the width starts at :data:`BASE_WIDTH_NS` and doubles
(merging buckets ``2k`` and ``2k + 1`` into ``k``) whenever the buckets from the first sample to
the last would exceed :data:`MAX_BUCKETS`. The width is therefore the smallest
``BASE_WIDTH_NS x 2^j`` under which the span fits, and the series is a function of the samples
alone, whatever order they came in or how they were split and merged: a live fold and a fold of
the recorded log give the same series. Memory: at most ``MAX_BUCKETS`` sketches of at most
``log_gamma(max / min) + 1`` bins each (8 bytes a bin: ~1,100 bins from 1 us to 1 h in ns), so
a day-long session stays flat (a bucket then spans 2^j ms for the smallest j with
``span / 2^j ms <= MAX_BUCKETS``: ~11 minutes for a day).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np

ALPHA = 0.01
"""Relative accuracy of every quantile a :class:`Sketch` returns (1%)."""
GAMMA = (1 + ALPHA) / (1 - ALPHA)
_LOG_GAMMA = math.log(GAMMA)
BASE_WIDTH_NS = 1_000_000
"""Narrowest time bucket of a :class:`SketchSeries` (1 ms); widths are this times a power of 2."""
MAX_BUCKETS = 256
"""Most time buckets a :class:`SketchSeries` keeps between its first and last sample."""


def _keys(x: np.ndarray) -> np.ndarray:
    """``ceil(log_gamma(x))`` of positive ``x``, corrected so that ``gamma^(k-1) < x <= gamma^k``
    holds in floating point too (the guarantee rests on it)."""
    k = np.ceil(np.log(x) / _LOG_GAMMA).astype(np.int64)
    k += (x > np.power(GAMMA, k.astype("float64"))).astype(np.int64)
    k -= (x <= np.power(GAMMA, (k - 1).astype("float64"))).astype(np.int64)
    return k


def _value(k) -> np.ndarray:
    """The value bin ``k`` stands for: within ALPHA of every x with gamma^(k-1) < x <= gamma^k."""
    return 2.0 * np.power(GAMMA, np.asarray(k, dtype="float64")) / (GAMMA + 1.0)


class _Store:
    """Counts of consecutive bins ``offset .. offset + len(counts) - 1`` (int64)."""

    __slots__ = ("offset", "counts")

    def __init__(self) -> None:
        self.offset = 0
        self.counts = np.zeros(0, dtype=np.int64)

    def add(self, keys: np.ndarray, counts: Optional[np.ndarray] = None) -> None:
        if not len(keys):
            return
        lo, hi = int(keys.min()), int(keys.max())
        self._extend(lo, hi)
        self.counts += np.bincount(keys - self.offset, weights=counts,
                                   minlength=len(self.counts)).astype(np.int64)

    def _extend(self, lo: int, hi: int) -> None:
        if not len(self.counts):
            self.offset, self.counts = lo, np.zeros(hi - lo + 1, dtype=np.int64)
            return
        new_lo, new_hi = min(lo, self.offset), max(hi, self.offset + len(self.counts) - 1)
        if new_lo == self.offset and new_hi == self.offset + len(self.counts) - 1:
            return
        out = np.zeros(new_hi - new_lo + 1, dtype=np.int64)
        out[self.offset - new_lo:self.offset - new_lo + len(self.counts)] = self.counts
        self.offset, self.counts = new_lo, out

    def merge(self, other: "_Store") -> None:
        if len(other.counts):
            self._extend(other.offset, other.offset + len(other.counts) - 1)
            start = other.offset - self.offset
            self.counts[start:start + len(other.counts)] += other.counts

    def copy(self) -> "_Store":
        out = _Store()
        out.offset, out.counts = self.offset, self.counts.copy()
        return out

    def __eq__(self, other) -> bool:
        a, b = np.trim_zeros(self.counts, "f"), np.trim_zeros(other.counts, "f")
        return (np.array_equal(np.trim_zeros(a, "b"), np.trim_zeros(b, "b"))
                and (not a.any() or self.offset + int(np.argmax(self.counts != 0))
                     == other.offset + int(np.argmax(other.counts != 0))))


class Sketch:
    """A log-bucketed histogram of values (module docstring): ``count``, ``sum``, ``min``,
    ``max`` exact; :meth:`quantile` within :data:`ALPHA` relative of the exact one."""

    __slots__ = ("pos", "neg", "zeros", "count", "sum", "min", "max")

    def __init__(self) -> None:
        self.pos, self.neg = _Store(), _Store()
        self.zeros = 0
        self.count = 0
        self.sum = 0.0
        self.min, self.max = math.inf, -math.inf

    def add(self, values: Iterable[float]) -> None:
        """Count ``values`` (NaN and infinities are left out)."""
        x = np.asarray(values, dtype="float64").ravel()
        x = x[np.isfinite(x)]
        if not len(x):
            return
        self.pos.add(_keys(x[x > 0]))
        self.neg.add(_keys(-x[x < 0]))
        self.zeros += int((x == 0).sum())
        self.count += len(x)
        self.sum += float(x.sum())
        self.min, self.max = min(self.min, float(x.min())), max(self.max, float(x.max()))

    def merge(self, other: "Sketch") -> "Sketch":
        """Add ``other``'s counts into this sketch (exact); returns self."""
        self.pos.merge(other.pos)
        self.neg.merge(other.neg)
        self.zeros += other.zeros
        self.count += other.count
        self.sum += other.sum
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        return self

    def copy(self) -> "Sketch":
        out = Sketch()
        out.pos, out.neg = self.pos.copy(), self.neg.copy()
        out.zeros, out.count, out.sum, out.min, out.max = self.zeros, self.count, self.sum, self.min, self.max
        return out

    def bins(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, counts) of the non-empty bins in ascending order of value (negative bins,
        zeros, positive bins); the values are those the bins stand for."""
        nk = np.flatnonzero(self.neg.counts)[::-1]
        pk = np.flatnonzero(self.pos.counts)
        values = np.r_[-_value(nk + self.neg.offset), [0.0] if self.zeros else [], _value(pk + self.pos.offset)]
        counts = np.r_[self.neg.counts[nk], [self.zeros] if self.zeros else [], self.pos.counts[pk]]
        return values.astype("float64"), counts.astype(np.int64)

    def at_ranks(self, ranks: np.ndarray) -> np.ndarray:
        """The values standing for the ``ranks``-th smallest samples (1-based), clamped to the
        exact [min, max]: each within ALPHA relative of the exact order statistic."""
        values, counts = self.bins()
        cum = np.cumsum(counts)
        idx = np.searchsorted(cum, np.asarray(ranks, dtype=np.int64), side="left")
        return np.clip(values[np.minimum(idx, len(values) - 1)], self.min, self.max)

    def quantile(self, q: float) -> float:
        """The q-quantile (inverse empirical CDF: the ``ceil(q n)``-th smallest value, as
        :func:`kvdiag.diagnosis.latency.quantile`) within ALPHA relative; NaN when empty."""
        if not self.count:
            return math.nan
        rank = min(max(int(math.ceil(q * self.count - 1e-9)), 1), self.count)
        return float(self.at_ranks(np.array([rank]))[0])

    def nbytes(self) -> int:
        return self.pos.counts.nbytes + self.neg.counts.nbytes

    def __eq__(self, other) -> bool:
        return (isinstance(other, Sketch) and self.count == other.count and self.zeros == other.zeros
                and self.min == other.min and self.max == other.max and self.pos == other.pos
                and self.neg == other.neg and math.isclose(self.sum, other.sum, rel_tol=1e-12, abs_tol=1e-6))


class SketchSeries:
    """One :class:`Sketch` per time bucket (module docstring: width, cap, merging)."""

    __slots__ = ("width_ns", "buckets", "max_buckets")

    def __init__(self, max_buckets: int = MAX_BUCKETS, base_width_ns: int = BASE_WIDTH_NS) -> None:
        self.width_ns = base_width_ns
        self.buckets: dict[int, Sketch] = {}
        self.max_buckets = max_buckets

    def add(self, ts_ns: Iterable[int], values: Iterable[float]) -> None:
        """Count ``values`` measured at ``ts_ns`` (NaN and infinite values are left out)."""
        t = np.asarray(ts_ns, dtype=np.int64).ravel()
        v = np.asarray(values, dtype="float64").ravel()
        keep = np.isfinite(v)
        t, v = t[keep], v[keep]
        if not len(t):
            return
        lo, hi = int(t.min()), int(t.max())
        if self.buckets:
            lo, hi = min(lo, min(self.buckets) * self.width_ns), max(hi, max(self.buckets) * self.width_ns)
        self._fit(lo, hi)
        keys = t // self.width_ns
        order = np.argsort(keys, kind="stable")
        keys, v = keys[order], v[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        for a, b in zip(starts, np.r_[starts[1:], len(keys)]):
            k = int(keys[a])
            sk = self.buckets.get(k)
            if sk is None:
                sk = self.buckets[k] = Sketch()
            sk.add(v[a:b])

    def _fit(self, lo_ns: int, hi_ns: int) -> None:
        """Double the width until ``lo_ns .. hi_ns`` fits in ``max_buckets`` buckets."""
        width = self.width_ns
        while hi_ns // width - lo_ns // width + 1 > self.max_buckets:
            width *= 2
        while self.width_ns < width:
            self._double()

    def merge(self, other: "SketchSeries") -> "SketchSeries":
        """Add ``other``'s buckets (exact: the series of the union of both series' samples,
        at the width that union's span gives); returns self."""
        if not other.buckets:
            return self
        other = other.copy()
        width = max(self.width_ns, other.width_ns)
        for series in (self, other):
            while series.width_ns < width:
                series._double()
        lo = min([*self.buckets, *other.buckets]) * width
        hi = max([*self.buckets, *other.buckets]) * width
        for k, sk in other.buckets.items():
            into = self.buckets.get(k)
            self.buckets[k] = sk if into is None else into.merge(sk)
        self._fit(lo, hi)
        return self

    def _double(self) -> None:
        merged: dict[int, Sketch] = {}
        for k in sorted(self.buckets):
            into = merged.get(k // 2)
            merged[k // 2] = self.buckets[k] if into is None else into.merge(self.buckets[k])
        self.buckets = merged
        self.width_ns *= 2

    def copy(self) -> "SketchSeries":
        out = SketchSeries(self.max_buckets)
        out.width_ns = self.width_ns
        out.buckets = {k: sk.copy() for k, sk in self.buckets.items()}
        return out

    @property
    def count(self) -> int:
        return sum(sk.count for sk in self.buckets.values())

    def total(self, start_ns: Optional[int] = None, end_ns: Optional[int] = None) -> Sketch:
        """The merged sketch of the buckets that start at or after ``start_ns`` and before
        ``end_ns`` (bucket boundaries: a window is a whole number of buckets)."""
        out = Sketch()
        for k in sorted(self.buckets):
            t = k * self.width_ns
            if (start_ns is None or t >= start_ns) and (end_ns is None or t < end_ns):
                out.merge(self.buckets[k])
        return out

    def matrix(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bucket start times in ns, bin values, counts: buckets x bins) over the bins any
        bucket uses, in ascending order of time and value: for rank statistics over buckets."""
        keys = sorted(self.buckets)
        per = [self.buckets[k].bins() for k in keys]
        values = np.unique(np.concatenate([v for v, _ in per])) if per else np.zeros(0)
        m = np.zeros((len(keys), len(values)), dtype=np.int64)
        for row, (v, c) in enumerate(per):
            m[row, np.searchsorted(values, v)] = c
        return np.array(keys, dtype=np.int64) * self.width_ns, values, m

    def nbytes(self) -> int:
        return sum(sk.nbytes() for sk in self.buckets.values())

    def __eq__(self, other) -> bool:
        return (isinstance(other, SketchSeries) and self.width_ns == other.width_ns
                and sorted(self.buckets) == sorted(other.buckets)
                and all(self.buckets[k] == other.buckets[k] for k in self.buckets))
