"""Triton kernels (under TRITON_INTERPRET=1, in a subprocess so the variable does not leak) vs
the torch reference, on random and real KV."""

import pytest
import os
import subprocess
import sys
from pathlib import Path

import torch

from kv_model import prefill_kv

pytestmark = pytest.mark.model


def test_triton_kernels_match_torch_reference(tmp_path):
    _, kv = prefill_kv()
    k, v = kv[7]
    path = tmp_path / "kv.pt"
    torch.save((k[:, :, :70].clone(), v[:, :, :70].clone()), path)
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).parent.parent / "triton_check.py"
    out = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "ALL OK" in out.stdout
    assert out.stdout.count(" ok") == 6 * 7 * 2  # 6 tensors x 7 formats x 2 axes


def test_gpu_benchmark_script_without_cuda():
    script = Path(__file__).parents[2] / "benchmarks" / "gpu_kernels.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "no CUDA" in out.stdout, out.stderr[-2000:]
    dry = subprocess.run([sys.executable, str(script), "--interpret-cpu"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    assert dry.stdout.count("exact") + dry.stdout.count("1step:") == 14 and "MISMATCH" not in dry.stdout
