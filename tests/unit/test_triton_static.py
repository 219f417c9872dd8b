"""The packed int4/int2 Triton kernels, compiled for sm_90 without a GPU (benchmarks/
triton_static.py), read and write whole vectors: no global access narrower than 4 bytes, and few
accesses per thread (a (64, 128) fp16 tile on 128 threads is 8 loads of 16 bytes)."""

import importlib.util
import os
from pathlib import Path

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU target; not under the interpreter", allow_module_level=True)

_path = Path(__file__).parents[2] / "benchmarks" / "triton_static.py"
_spec = importlib.util.spec_from_file_location("triton_static", _path)
triton_static = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(triton_static)


def test_packed_kernels_access_memory_in_vectors(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    seen = 0
    for name, fn, sig, const, warps, rows in triton_static.kernels(head_dim=128, group=32, tokens=4096):
        if const["PPB"] == 1:
            continue
        ptx = triton_static.compile_kernel(fn, sig, const, warps, arch=90).asm["ptx"]
        accesses = triton_static.global_accesses(ptx)
        narrow = {k: n for k, n in accesses.items() if k.endswith(("8", "16"))}
        assert not narrow, (name, accesses)
        assert sum(accesses.values()) <= 16, (name, accesses)
        seen += 1
    assert seen == 8  # int4 and int2, token and channel, quant and dequant
