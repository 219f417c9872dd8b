"""kvdiag's GPU collectors against the CUDA driver's and torch's own counters, in one run.

    python benchmarks/gpu_collectors.py [--out DIR]

Checks, each printed as ``ok``/``FAIL`` with the figures compared (exit 1 on any FAIL):

- **allocator sample**: ``AllocatorCollector.sample()`` after known allocations equals
  ``torch.cuda.memory_stats`` (reserved, allocated) of the same moment, and allocated grew by
  the bytes this script allocated (rounded to the allocator's 512-byte blocks);
- **OOM observer**: an allocation larger than the device makes torch raise OutOfMemoryError;
  the collector's observer (``torch._C._cuda_attach_out_of_memory_observer``) fires inside it,
  writes a snapshot that kvdiag's safe loader reads back, and records a sample whose
  ``num_ooms`` is one more than before, and whose device totals equal ``memory_stats`` read
  right after the OOM (written beside it as snapshot.json and memory_stats.json: the real
  CUDA fixture of tests/integration/test_fragmentation.py); the process keeps running;
- **NVML**: ``NvmlCollector`` reads the device's used/total memory and this process's own
  memory; the total is CUDA's plus the driver's reserve (at most 1%); used memory agrees with ``torch.cuda.mem_get_info`` within what other processes and
  the driver's own reservations hold (reported), and this process holds at least torch's
  reserved bytes.

Without CUDA the script says so and exits 0 (nothing measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for the OOM snapshot (default: a temporary folder)")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}): nothing measured")
        return 0
    from kvdiag.diagnosis import fragmentation as fr
    from kvdiag.collectors.allocator import AllocatorCollector
    from kvdiag.collectors.nvml import NvmlCollector
    from kvdiag.events.sinks import ListSink
    from kvdiag.events.snapshot_io import load_snapshot

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvdiag-gpu-"))
    failures = 0

    def verdict(ok: bool, what: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}")

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    sink = ListSink()
    col = AllocatorCollector(sink, snapshot_dir=out, history_entries=10_000)
    st = col.start()
    verdict(st.available, f"allocator collector started: {st.hint}")

    before = col.sample()[0]
    n_bytes = [1 << 20, 3 * (1 << 20) + 17, 64 << 20]
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in n_bytes]
    torch.cuda.synchronize()
    sample, stats = col.sample()[0], torch.cuda.memory_stats(0)
    verdict(sample.reserved_bytes == stats["reserved_bytes.all.current"]
            and sample.allocated_bytes == stats["allocated_bytes.all.current"],
            f"sample equals memory_stats: reserved {sample.reserved_bytes} / {stats['reserved_bytes.all.current']}, "
            f"allocated {sample.allocated_bytes} / {stats['allocated_bytes.all.current']}")
    expected = sum((n + 511) // 512 * 512 for n in n_bytes)
    verdict(sample.allocated_bytes - before.allocated_bytes == expected,
            f"allocated grew {sample.allocated_bytes - before.allocated_bytes} bytes, expected {expected}")

    total = torch.cuda.get_device_properties(0).total_memory
    ooms_before = sample.num_ooms
    raised = False
    try:
        torch.empty(total * 2, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        raised = True
    stats_after_oom = torch.cuda.memory_stats(0)  # nothing allocated since the observer ran
    verdict(raised, f"an allocation of {2 * total >> 30} GiB raised OutOfMemoryError")
    snaps = [p for p in col.snapshots if "oom" in p.name]
    verdict(len(snaps) == 1, f"the OOM observer wrote {len(snaps)} snapshot(s)")
    if snaps:
        snap = load_snapshot(snaps[0])
        traces = sum(len(t) for t in snap.get("device_traces", []))
        ooms_in_trace = sum(e.get("action") == "oom" for t in snap.get("device_traces", []) for e in t)
        verdict(len(snap.get("segments", [])) > 0 and ooms_in_trace == 1,
                f"snapshot read back by kvdiag's loader: {len(snap['segments'])} segments, "
                f"{traces} trace entries, {ooms_in_trace} 'oom' trace entries ({snaps[0].stat().st_size} bytes)")
        dev = fr.device_frame(snap).iloc[0]
        verdict(int(dev["reserved_bytes"]) == stats_after_oom["reserved_bytes.all.current"]
                and int(dev["allocated_bytes"]) == stats_after_oom["allocated_bytes.all.current"],
                f"OOM snapshot totals equal memory_stats after the OOM: reserved {int(dev['reserved_bytes'])} / "
                f"{stats_after_oom['reserved_bytes.all.current']}, allocated {int(dev['allocated_bytes'])} / "
                f"{stats_after_oom['allocated_bytes.all.current']}")
        # a small real snapshot and the allocator's own counters of the same moment: the
        # fixture tests/integration/test_fragmentation.py checks kvdiag's snapshot analysis against
        (out / "snapshot.json").write_bytes(snaps[0].read_bytes())
        (out / "memory_stats.json").write_text(json.dumps(stats_after_oom, indent=1, sort_keys=True))
    after = col.sample()[0]
    verdict(after.num_ooms == ooms_before + 1, f"num_ooms {ooms_before} -> {after.num_ooms}")
    keep.append(torch.ones(1024, device="cuda"))
    verdict(float(keep[-1].sum()) == 1024.0, "the process allocates and computes after the OOM")

    nv = NvmlCollector(pids=lambda: [os.getpid()])
    nst = nv.start()
    verdict(nst.available, f"NVML: {nst.hint}; devices {nv.device_names()}")
    if nv.available:
        s = nv.sample()[0]
        free_b, total_b = torch.cuda.mem_get_info(0)
        reserved = torch.cuda.memory_reserved(0)
        # NVML counts the memory the driver reserves for itself; CUDA's total leaves it out
        verdict(total_b <= s.memory_total_bytes <= total_b * 1.01,
                f"NVML total {s.memory_total_bytes} vs cudaMemGetInfo total {total_b} "
                f"(driver reserve {(s.memory_total_bytes - total_b) >> 20} MiB)")
        used_cuda = total_b - free_b
        verdict(abs(s.memory_used_bytes - used_cuda) <= 1 << 30,
                f"NVML used {s.memory_used_bytes >> 20} MiB vs cudaMemGetInfo used {used_cuda >> 20} MiB")
        pm = s.process_memory_bytes
        verdict(pm is not None and pm >= reserved,
                f"NVML memory of this process {None if pm is None else pm >> 20} MiB >= torch reserved "
                f"{reserved >> 20} MiB (the rest: CUDA context){'; errors ' + str(nv.field_errors) if nv.field_errors else ''}")
        print(f"     power {s.power_mw} mW, energy {s.energy_mj} mJ, util {s.gpu_util_pct}%, {s.temperature_c} C")
        nv.close()
    col.stop()
    del keep
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
