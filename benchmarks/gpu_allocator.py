"""Record a real CUDA allocator snapshot and memory_stats from a CUDA run of the model, run
kvdiag's fragmentation analysis on it, and write the snapshot as JSON (a test fixture).

    python benchmarks/gpu_allocator.py [--model-dir DIR] [--out tests/data/cuda_allocator]

The model is SmolLM2-135M (the converted folder from ``kvdiag fetch-model``); with only its
config.json at hand (no weights), the same architecture is built with random weights: the
allocator sees the same tensor shapes either way, and the output says which was used. The
workload is batched generation with the growing DynamicCache (torch.cat per step: the
allocation pattern that fragments) over prompts of different lengths. Without CUDA the script
says so and exits 0 without writing anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def load_model(model_dir: Path, torch):
    from transformers import AutoConfig, LlamaForCausalLM
    if (model_dir / "model.safetensors").exists():
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float16)
        return model, "real weights"
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float16), "random weights (config only)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", help="converted SmolLM2 folder (default: kvdiag's cache)")
    parser.add_argument("--out", default="tests/data/cuda_allocator", help="folder for the fixture")
    parser.add_argument("--history-entries", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    import torch
    if not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}): nothing recorded")
        return 0

    from kvdiag.diagnosis import fragmentation as fr
    from kvdiag.collectors.allocator import AllocatorCollector, sample_from_stats
    from kvdiag.events.snapshot_io import load_snapshot, save_snapshot_json
    from kvdiag.events.sinks import ListSink

    model_dir = Path(args.model_dir) if args.model_dir else None
    if model_dir is None:
        from kvdiag.demo.smollm import default_model_dir
        model_dir = default_model_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    sink = ListSink()
    col = AllocatorCollector(sink, snapshot_dir=out, history_entries=args.history_entries)
    st = col.start()
    print(f"allocator collector: available={st.available} ({st.hint})")
    model, weights = load_model(model_dir, torch)
    model = model.to("cuda").eval()
    print(f"model: {model_dir} ({weights}), {torch.cuda.get_device_name(0)}")
    torch.manual_seed(1)
    t0 = time.time()
    with torch.no_grad():
        for r in range(args.rounds):
            batch = 4 + 4 * (r % 3)
            prompt_len = 64 + 97 * r
            ids = torch.randint(10, 40000, (batch, prompt_len), device="cuda")
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32 + 16 * r,
                           do_sample=False, pad_token_id=2)
            col.sample()
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats(0)
    snapshot = torch.cuda.memory._snapshot()
    col.stop()

    snap_path = save_snapshot_json(snapshot, out / "snapshot.json")
    (out / "memory_stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True))
    back = load_snapshot(snap_path)
    segs = fr.segment_frame(back)  # asserts the per-segment invariants
    dev = fr.device_frame(back).iloc[0]
    s = sample_from_stats(stats, 0, time.time_ns())
    print(f"ran {args.rounds} rounds in {time.time() - t0:.1f} s; {len(segs)} segments, "
          f"{sum(len(t) for t in back.get('device_traces', []))} trace entries")
    print(f"reserved: snapshot {int(dev['reserved_bytes'])} vs memory_stats {s.reserved_bytes}"
          f" -> {'equal' if int(dev['reserved_bytes']) == s.reserved_bytes else 'DIFFERENT'}")
    print(f"allocated: snapshot {int(dev['allocated_bytes'])} vs memory_stats {s.allocated_bytes}"
          f" -> {'equal' if int(dev['allocated_bytes']) == s.allocated_bytes else 'DIFFERENT'}")
    print(f"inactive split: snapshot {int(dev['inactive_split_bytes'])} vs memory_stats {s.inactive_split_bytes}")
    print(f"external fragmentation {dev['external_fragmentation']:.3f}; slack {int(dev['slack_bytes'])} bytes")
    print("pools:\n" + fr.pool_frame(back).to_string(index=False))
    print(f"unservable size classes: {fr.unservable_size_classes(back)['size_class_bytes'].tolist()}")
    print(f"fragmenting allocations: {len(fr.fragmenting_allocations(back))}")
    f = fr.allocator_fragmentation_finding(back)
    print(f"[{f.status}] {f.rule}: {f.message}")
    (out / "expected.json").write_text(json.dumps({
        "weights": weights, "reserved_bytes": s.reserved_bytes, "allocated_bytes": s.allocated_bytes,
        "inactive_split_bytes": s.inactive_split_bytes, "device": fr.snapshot_summary(back)["devices"][0],
    }, indent=1, default=int))
    print(f"wrote {snap_path} ({snap_path.stat().st_size} bytes), memory_stats.json, expected.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
