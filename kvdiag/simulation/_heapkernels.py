"""Indexed binary min-heap over block ids, compiled with numba (inlined into the simulators).

``heap[0..n-1]`` holds block ids ordered by ``hkey[id]`` (smallest first); ``hpos[id]`` is an
id's slot in ``heap`` (-1 when absent). Used by the LFU/OPT simulator
(:mod:`kvdiag.simulation._simkernels`) and the learned policies
(:mod:`kvdiag.simulation._policykernels`). Compiled code is cached like
:mod:`kvdiag.simulation._simkernels`'.
"""

from __future__ import annotations

from numba import njit

from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each function is decorated


@njit(cache=True, inline="always")
def _sift_up(i, heap, hpos, hkey):
    x = heap[i]
    k = hkey[x]
    while i > 0:
        parent = (i - 1) >> 1
        y = heap[parent]
        if hkey[y] <= k:
            break
        heap[i] = y
        hpos[y] = i
        i = parent
    heap[i] = x
    hpos[x] = i


@njit(cache=True, inline="always")
def _sift_down(i, n, heap, hpos, hkey):
    x = heap[i]
    k = hkey[x]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and hkey[heap[c + 1]] < hkey[heap[c]]:
            c += 1
        y = heap[c]
        if hkey[y] >= k:
            break
        heap[i] = y
        hpos[y] = i
        i = c
    heap[i] = x
    hpos[x] = i


@njit(cache=True, inline="always")
def _heap_push(x, key, n, heap, hpos, hkey):
    hkey[x] = key
    heap[n] = x
    hpos[x] = n
    _sift_up(n, heap, hpos, hkey)


@njit(cache=True, inline="always")
def _heap_update(x, key, n, heap, hpos, hkey):
    old = hkey[x]
    hkey[x] = key
    if key < old:
        _sift_up(hpos[x], heap, hpos, hkey)
    else:
        _sift_down(hpos[x], n, heap, hpos, hkey)


@njit(cache=True, inline="always")
def _heap_pop(n, heap, hpos, hkey):
    x = heap[0]
    hpos[x] = -1
    last = heap[n - 1]
    if n > 1:
        heap[0] = last
        hpos[last] = 0
        _sift_down(0, n - 1, heap, hpos, hkey)
    return x
