"""Every package folder is installed, and the repository root shadows no one else's package."""

import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


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
    def found_from(folder) -> str:
        return subprocess.run([sys.executable, "-c", probe], cwd=folder, capture_output=True,
                              text=True, check=True).stdout.strip()

    # from the root, `import kernels` finds exactly what it finds anywhere else (the installed
    # package, or nothing): the root adds no module of that name
    seen, elsewhere = found_from(ROOT), found_from(tempfile.gettempdir())
    assert seen == elsewhere, f"`import kernels` from the repository root finds {seen}"
