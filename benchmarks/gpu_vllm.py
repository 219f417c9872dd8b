"""kvdiag's plugin in a CUDA vLLM, in one process: prints what it verified, exits 1 on a failure.

Runs vLLM's offline ``LLM`` with one worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the engine core and its worker here) and ``KVDIAG_AGENT=1``, every decode step measured by the
worker's shadow (``KVDIAG_SHADOW_RATE=1``, no budget, all layers), and checks in the log:

1. the FlashAttention KV layout kvdiag reads (``gather_kv(..., "flash")``) holds exactly the
   key and value rows vLLM wrote for the last token (captured from ``do_kv_cache_update``);
2. shadow compression and locality events from the worker, finite, on CUDA copies (the Triton
   quantization kernels: the shadow's int4 runs on the device);
3. the allocator in the worker: ``AllocatorSample`` events and a snapshot written; NVML samples.

Usage: python3 benchmarks/gpu_vllm.py --model MODEL_DIR --out OUT_DIR  (MODEL_DIR: a converted
SmolLM2 folder, or one with only its config.json and tokenizer: ``--dummy`` loads random weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dummy", action="store_true", help="random weights (vLLM's load_format=dummy)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "vllm-gpu.kvlog"
    os.environ.update(KVDIAG_AGENT="1", KVDIAG_LOG=str(log), KVDIAG_SHADOW_RATE="1", KVDIAG_SHADOW_BUDGET="0",
                      KVDIAG_SHADOW_LAYERS="0", KVDIAG_SHADOW_METHODS="fp8_e4m3:s=1,int4",
                      KVDIAG_SOCKET=str(out / "agent.sock"), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_NO_USAGE_STATS="1")
    try:
        import torch
        import vllm
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    except Exception as exc:
        print(f"SKIPPED: no CUDA vLLM with FlashAttention here ({type(exc).__name__}: {exc})")
        return 2
    if not torch.cuda.is_available():
        print("SKIPPED: torch sees no CUDA device")
        return 2
    print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))

    from kvdiag.collectors.vllm_kv_layout import gather_kv

    layout_checks: list[bool] = []
    update = FlashAttentionImpl.do_kv_cache_update

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, *a, **kw):
        result = update(self, layer, key, value, kv_cache, slot_mapping, *a, **kw)
        if layer.layer_name.endswith("layers.0.self_attn.attn") and key.shape[0] >= 1 and len(layout_checks) < 8:
            slot = int(slot_mapping[key.shape[0] - 1])
            block = kv_cache.shape[2]
            k, v = gather_kv(kv_cache, [slot // block], slot % block + 1, "flash")
            layout_checks.append(bool(torch.equal(k[0, :, -1], key[key.shape[0] - 1].to(k.dtype))
                                      and torch.equal(v[0, :, -1], value[key.shape[0] - 1].to(v.dtype))))
        return result

    FlashAttentionImpl.do_kv_cache_update = do_kv_cache_update
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=2048, enforce_eager=True,
              gpu_memory_utilization=0.3, load_format="dummy" if args.dummy else "auto")
    llm.generate(["The quick brown fox jumps over the lazy dog. " * 30] * 2,
                 SamplingParams(max_tokens=8, temperature=0))
    from kvdiag.collectors import vllm_plugin
    hooks = vllm_plugin._HOOKS
    snapshot = None
    if hooks is not None and hooks.worker is not None and hooks.worker.allocator is not None:
        snapshot = hooks.worker.allocator.snapshot("check")
    from kvdiag import agent
    agent.stop()

    events = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    by_type: dict[str, list] = {}
    for e in events:
        by_type.setdefault(e.get("type", "?"), []).append(e)
    checks = {
        "flash layout read = rows vLLM wrote": bool(layout_checks) and all(layout_checks),
        "worker shadow compression events": len(by_type.get("shadow_compression", [])) > 0,
        "all compression errors finite": all(math.isfinite(e["attn_out_rel_error"])
                                             for e in by_type.get("shadow_compression", [])),
        "worker locality events": len(by_type.get("shadow_locality", [])) > 0,
        "no collector errors": not by_type.get("collector_error"),
        "allocator samples from the worker": len(by_type.get("allocator_sample", [])) > 0,
        "allocator snapshot written": snapshot is not None and Path(snapshot).is_file(),
        "NVML samples": len(by_type.get("nvml_sample", [])) > 0,
    }
    for e in by_type.get("collector_error", [])[:5]:
        print("  collector error:", e["collector"], e["message"][:200])
    for e in by_type.get("collector_status", []):
        if not e["available"]:
            print("  not available:", e["collector"], e["hint"][:200])
    for name, ok in checks.items():
        print(f"{'OK  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
