#!/usr/bin/env bash
# kvdiag's vLLM plugin on a CUDA machine, in one go (prints what it verified; exit 0 all OK,
# 1 a check failed, 2 no CUDA vLLM here): the worker's shadow on vLLM's FlashAttention KV
# (layout read against the rows vLLM wrote, Triton kernels on the device), the allocator
# collector and a snapshot in the worker, NVML: benchmarks/gpu_vllm.py. Then the other GPU
# checks (benchmarks/gpu_check.sh) unless --vllm-only.
# Usage: benchmarks/gpu_vllm_check.sh OUT_DIR MODEL_DIR [--dummy] [--vllm-only]
set -uo pipefail
out="${1:?usage: gpu_vllm_check.sh OUT_DIR MODEL_DIR [--dummy] [--vllm-only]}"
model="${2:?usage: gpu_vllm_check.sh OUT_DIR MODEL_DIR [--dummy] [--vllm-only]}"
shift 2
dummy=""; only=0
for arg in "$@"; do
    case "$arg" in
        --dummy) dummy="--dummy" ;;
        --vllm-only) only=1 ;;
        *) echo "unknown option $arg" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
echo "== kvdiag plugin in a CUDA vLLM"
python3 benchmarks/gpu_vllm.py --model "$model" --out "$out/vllm" $dummy
status=$?
if [ "$only" = 0 ]; then
    benchmarks/gpu_check.sh "$out" "$model" || status=1
fi
echo "gpu_vllm_check: exit $status"
exit $status
