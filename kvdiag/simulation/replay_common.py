"""What the replays of :mod:`kvdiag.simulation` share: requests cut into consecutive batches of
about :data:`CHUNK_REFS` block references (the progress granularity), and log2-binned
histograms as frames."""

from __future__ import annotations


import numpy as np
import pandas as pd


CHUNK_REFS = 1 << 16  # progress granularity


def request_chunks(offsets: np.ndarray, refs_per_chunk: int) -> list[tuple[int, int]]:
    """Split requests into consecutive ranges of about ``refs_per_chunk`` references."""
    r = len(offsets) - 1
    if r <= 0:
        return []
    cuts = np.searchsorted(offsets, np.arange(refs_per_chunk, offsets[-1], refs_per_chunk))
    bounds = np.unique(np.concatenate([[0], np.clip(cuts, 1, r), [r]]))
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def log2_frame(hist: np.ndarray, what: str, unit: str, count: str) -> pd.DataFrame:
    bins = np.nonzero(hist)[0]
    lo = np.where(bins == 0, 0, 1 << np.maximum(bins - 1, 0))
    hi = np.where(bins == 0, 0, (1 << bins) - 1)
    return pd.DataFrame({f"{what}_min({unit})": lo, f"{what}_max({unit})": hi,
                         count: hist[bins]})
