"""A gauge binned by event time: one value per bin (the last one observed in it)."""

from __future__ import annotations

from typing import Optional

from kvdiag.live.snapshot import History


class Series:
    """One value per bin (the last one observed in it)."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def set(self, bin_idx: int, value: float) -> None:
        self.values[bin_idx] = value

    def history(self, first: int, last: int, carry_bins: int) -> History:
        """Values of bins first..last; a gauge carries its last value over at most
        ``carry_bins`` empty bins (it is still the current reading), then shows a gap."""
        out: list[Optional[float]] = []
        current: Optional[float] = None
        age = 0
        earlier = [b for b in self.values if b < first]
        if earlier:
            b = max(earlier)
            current, age = self.values[b], first - b - 1
        for b in range(first, last + 1):
            if b in self.values:
                current, age = self.values[b], 0
            else:
                age += 1
            out.append(current if current is not None and age <= carry_bins else None)
        return tuple(out)

    def trim(self, before: int) -> None:
        old = [b for b in self.values if b < before]
        keep = max(old) if old else None
        for b in old:
            if b != keep:
                del self.values[b]
