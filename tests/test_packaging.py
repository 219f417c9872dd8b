"""Every package folder is installed, and the repository root shadows no one else's package."""

import subprocess
import sys
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_under_kvdiag_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(ROOT, **config["packages"]["find"]))
    on_disk = {".".join(init.parent.relative_to(ROOT).parts)
               for init in (ROOT / "kvdiag").rglob("__init__.py")}
    assert on_disk == found, f"not installed: {sorted(on_disk - found)}"


def test_the_repository_root_holds_no_importable_package_but_kvdiag():
    """A top-level kernels/ once shadowed the PyPI `kernels` that transformers imports: every
    command run from the repository root failed when the model loaded."""
    names = [p.name for p in ROOT.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"]
    assert names == ["kvdiag"], f"move these under kvdiag/: {sorted(set(names) - {'kvdiag'})}"
    probe = ("import importlib.util as u; s = u.find_spec('kernels'); "
             "print(s.origin if s and s.origin else '')")
    seen = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert not seen or not Path(seen).resolve().is_relative_to(ROOT), \
        f"`import kernels` from the repository root finds {seen}"
