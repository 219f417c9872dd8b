"""The layer contracts of pyproject.toml's ``[tool.importlinter]`` hold: imports point down the
layers, no circle between subpackages (nor between the commands' modules), and the UI
libraries (textual, plotly) are imported only by ``kvdiag.tui`` and ``kvdiag.reports``. Each
contract is also shown to break on a violation planted in a copy of the package, so the check
cannot pass because it checks nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "pyproject.toml"


def _lint(package_parent: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the repository's contracts over the kvdiag under ``package_parent``."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        pytest.fail("lint-imports is not installed: pip install '.[test]' (import-linter)")
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([lint, "--no-cache", "--no-logo", str(CONFIG)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_contracts_hold(tmp_path):
    out = _lint(ROOT, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 3 kept, 0 broken." in out.stdout, out.stdout


PLANTS = {
    # a bottom-layer module importing the agent: an upward import
    "layers": {"events/_planted_climb.py": "import kvdiag.agent\n"},
    # two commands' modules importing each other
    "acyclic": {"commands/_planted_a.py": "from kvdiag.commands import _planted_b\n",
                "commands/_planted_b.py": "from kvdiag.commands import _planted_a\n"},
    # a headless module importing a UI library
    "ui": {"diagnosis/_planted_ui.py": "import plotly\n"},
}


@pytest.mark.parametrize("contract", sorted(PLANTS))
def test_a_planted_violation_breaks_its_contract(tmp_path, contract):
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "kvdiag", copy / "kvdiag", ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in PLANTS[contract].items():
        (copy / "kvdiag" / rel).write_text(text)
    out = _lint(copy, cwd=tmp_path)
    assert out.returncode != 0, out.stdout
    name = {"layers": "Imports point down the layers", "acyclic": "No circle between",
            "ui": "UI libraries (textual, plotly)"}[contract]
    assert re.search(rf"^{re.escape(name)}.* BROKEN\b", out.stdout, re.M), out.stdout
    # the report names the planted module (the first one of the plant)
    leaf = Path(next(iter(PLANTS[contract]))).stem
    assert leaf in out.stdout.split("Broken contracts", 1)[1], out.stdout
