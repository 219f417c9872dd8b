"""Every package folder in the source tree is installed (pyproject lists them explicitly)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    on_disk = set()
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([package, *relative.parts]))
    assert on_disk <= listed, f"add to pyproject's packages and package-dir: {sorted(on_disk - listed)}"
    assert listed <= on_disk, f"listed but missing: {sorted(listed - on_disk)}"
