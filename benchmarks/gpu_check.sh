#!/usr/bin/env bash
# Every GPU check kvdiag has, in one go on a CUDA machine (each prints what it verified):
#   1. the Triton KV quantization kernels against the torch reference, and their bandwidth as a
#      share of a device-to-device copy (fp16 and bf16 inputs): benchmarks/gpu_kernels.py
#   2. the allocator collector, its OOM observer and NVML against torch's and the driver's own
#      counters: benchmarks/gpu_collectors.py
#   3. a real CUDA allocator snapshot of SmolLM2's architecture run through kvdiag's
#      fragmentation analysis (benchmarks/gpu_allocator.py), then the test that checks such a
#      snapshot against torch's memory_stats (it records into OUT_DIR/cuda_allocator)
# Usage: benchmarks/gpu_check.sh OUT_DIR [MODEL_DIR]   (MODEL_DIR: a converted SmolLM2 folder,
# or one holding only its config.json: random weights, the same tensor shapes)
set -uo pipefail
out="${1:?usage: gpu_check.sh OUT_DIR [MODEL_DIR]}"
model="${2:-}"
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for dtype in float16 bfloat16; do
    echo "== Triton kernels, $dtype input"
    python3 benchmarks/gpu_kernels.py --dtype "$dtype" || status=1
done
echo "== collectors"
python3 benchmarks/gpu_collectors.py --out "$out/oom" || status=1
echo "== allocator snapshot"
python3 benchmarks/gpu_allocator.py ${model:+--model-dir "$model"} --out "$out/cuda_allocator" || status=1
echo "== the snapshot test on this CUDA device"
python3 -m pytest -q -p no:cacheprovider tests/integration/test_fragmentation.py -k cuda_snapshot || status=1
echo "gpu_check: exit $status"
exit $status
