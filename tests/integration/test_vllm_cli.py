"""The vLLM commands without vLLM: one line that says what to run, a documented exit code, no
traceback, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVDIAG_VLLM_ENV=str(tmp_path / "no-vllm-here"), KVDIAG_HOME=str(tmp_path / "home"))
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


def test_demo_engine_vllm_without_vllm_says_what_to_run(tmp_path, model_dir):
    proc = _run(["demo", "--engine", "vllm", "--model", str(model_dir), "--requests", "1"], tmp_path)
    assert proc.returncode == 1
    assert "kvdiag fetch-engine vllm" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not (tmp_path / "no-vllm-here").exists()


def test_top_engine_vllm_without_vllm_says_what_to_run(tmp_path):
    proc = _run(["top", "--engine", "vllm"], tmp_path)
    assert proc.returncode == 2
    assert "kvdiag fetch-engine vllm" in proc.stderr and "Traceback" not in proc.stderr


def test_top_engine_goes_only_with_the_demo(tmp_path):
    proc = _run(["top", "--engine", "vllm", "--pid", "1"], tmp_path)
    assert proc.returncode == 2 and "--engine" in proc.stderr
