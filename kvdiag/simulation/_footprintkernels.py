"""Peak blocks held by live requests, with and without prefix sharing, compiled with numba
(:mod:`kvdiag.simulation.footprint`). Compiled code is cached like
:mod:`kvdiag.simulation._simkernels`'.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each function is decorated


@njit(cache=True)
def live_peaks(ids, offsets, private, pages, reqs, kinds, num_blocks):
    """Sweep arrivals (``kinds`` +1) and finishes (-1) of requests ``reqs``; return the peak of
    blocks held without sharing (sum of ``pages``) and with sharing (distinct chained blocks of
    live requests + their ``private`` blocks)."""
    count = np.zeros(max(num_blocks, 1), np.int64)
    unshared = 0
    shared = 0
    peak_unshared = 0
    peak_shared = 0
    for k in range(len(reqs)):
        r = reqs[k]
        kind = kinds[k]
        unshared += kind * pages[r]
        shared += kind * private[r]
        for i in range(offsets[r], offsets[r + 1]):
            x = ids[i]
            if kind > 0:
                if count[x] == 0:
                    shared += 1
                count[x] += 1
            else:
                count[x] -= 1
                if count[x] == 0:
                    shared -= 1
        if unshared > peak_unshared:
            peak_unshared = unshared
        if shared > peak_shared:
            peak_shared = shared
    return peak_unshared, peak_shared
