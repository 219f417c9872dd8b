"""A short, bounded measurement of the machine's memory copy bandwidth, cached per host.

KV bandwidth utilisation (:mod:`kvdiag.diagnosis.bandwidth`) divides the KV bytes attention
must read per second by a peak; this module measures that peak once: copy a buffer larger
than the last-level cache a few times and keep the fastest copy. Copy bandwidth is counted as
STREAM's Copy counts it: (bytes read + bytes written) / seconds, i.e. 2 x buffer bytes per
copy. The result is a :class:`kvdiag.events.schema.MemoryBandwidthProbe` event that recorders write
into the log, so that offline analyses need not measure the machine they run on.

Bounded: at most ``budget_s`` (0.5 s by default) of copying after the buffers are touched;
cached in ``<cache dir>/bandwidth/<host>-<device>.json`` (:func:`kvdiag.paths.cache_dir`),
never inside the installed package.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path
from typing import Callable, Optional

from kvdiag.events.schema import MemoryBandwidthProbe

MIN_BUFFER_BYTES = 64 << 20
"""Smallest buffer copied: larger than the last-level cache of current CPUs (and a GPU's L2)."""
MAX_BUFFER_BYTES = 512 << 20
GPU_BUFFER_BYTES = 256 << 20
"""Copied on a GPU: several times its L2 (60 MiB on an H200), freed again after the probe."""
DEFAULT_REPETITIONS = 5
DEFAULT_BUDGET_S = 0.5


def last_level_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> Optional[int]:
    """The largest CPU cache of cpu0 (``/sys/.../cache/index*/size``), or None if unreadable."""
    sizes = []
    for index in sysfs.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", text)
        if m:
            sizes.append(int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)])
    return max(sizes) if sizes else None


def buffer_bytes_for(llc_bytes: Optional[int]) -> int:
    """2x the last-level cache (source and destination together 4x), within
    [MIN_BUFFER_BYTES, MAX_BUFFER_BYTES]."""
    return int(min(max(2 * (llc_bytes or 0), MIN_BUFFER_BYTES), MAX_BUFFER_BYTES))


def _copy_seconds_numpy(buffer_bytes: int) -> Callable[[], float]:
    import numpy as np
    src = np.ones(buffer_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # both touched: no page faults in the timed copies

    def once() -> float:
        t = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t
    return once


def _copy_seconds_torch_cuda(buffer_bytes: int, device: str) -> Callable[[], float]:
    import torch
    src = torch.ones(buffer_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)

    def once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return once


def measure(device: str = "cpu", buffer_bytes: Optional[int] = None,
            repetitions: int = DEFAULT_REPETITIONS, budget_s: float = DEFAULT_BUDGET_S,
            now_ns: Optional[int] = None,
            clock_s: Callable[[], float] = time.perf_counter) -> MemoryBandwidthProbe:
    """Copy bandwidth of ``device`` ("cpu", or a CUDA device such as "cuda:0"): the fastest
    of up to ``repetitions`` copies (at least one; no new copy starts once ``clock_s`` has
    passed ``budget_s`` after the first copy began)."""
    if device == "cpu":
        size = buffer_bytes or buffer_bytes_for(last_level_cache_bytes())
        once, method, name = _copy_seconds_numpy(size), "numpy", cpu_model()
    else:
        import torch
        size = buffer_bytes or GPU_BUFFER_BYTES
        once, method = _copy_seconds_torch_cuda(size, device), "torch"
        name = torch.cuda.get_device_name(torch.device(device))
    deadline = clock_s() + budget_s
    times = [once()]
    while len(times) < repetitions and clock_s() < deadline:
        times.append(once())
    best = max(min(times), 1e-9)
    del once  # the buffers
    if device != "cpu":
        import torch
        torch.cuda.empty_cache()  # give the memory back: the engine's pool comes next
    return MemoryBandwidthProbe(ts_ns=now_ns or time.time_ns(), device=device, device_name=name,
                                copy_bandwidth_bytes_per_s=2 * size / best, buffer_bytes=size,
                                repetitions=len(times), method=method)


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def default_device() -> str:
    """"cuda:0" when this process already initialised CUDA through torch, else "cpu". Neither
    torch nor CUDA is initialised for the question: a CUDA driver initialised before an
    engine forks its workers breaks them."""
    import sys
    torch = sys.modules.get("torch")
    try:
        return "cuda:0" if torch is not None and torch.cuda.is_initialized() else "cpu"
    except Exception:
        return "cpu"


def cache_path(device: str, host: Optional[str] = None) -> Path:
    """Where the probe of ``device`` on ``host`` (default: this host) is cached."""
    from kvdiag.paths import cache_dir
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{host or socket.gethostname()}-{device}")
    return cache_dir() / "bandwidth" / f"{safe}.json"


def probe(device: str = "cpu", use_cache: bool = True, **kwargs) -> MemoryBandwidthProbe:
    """The cached probe of ``device`` on this host (``cached=True``, stamped now), else a
    fresh :func:`measure` written to the cache. A cache that cannot be read or written is
    ignored: the probe is measured again."""
    now = time.time_ns()
    path = cache_path(device)
    if use_cache:
        try:
            import msgspec
            old = msgspec.json.decode(path.read_bytes(), type=MemoryBandwidthProbe)
            return MemoryBandwidthProbe(**{**{f: getattr(old, f) for f in old.__struct_fields__},
                                           "ts_ns": now, "cached": True})
        except (OSError, ValueError):
            pass
    result = measure(device, now_ns=now, **kwargs)
    try:
        import msgspec
        from kvdiag.paths import write_private_atomic
        write_private_atomic(path, msgspec.json.encode(result))
    except OSError:
        pass
    return result
