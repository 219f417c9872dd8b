"""The README is a test: its install line and main command, verbatim, as a newcomer types them.

A fresh virtual environment and an empty home directory (no pip cache, no kvdiag cache, no
model); a copy of the checkout's tracked files stands in for a fresh clone. The main command
fetches the model itself, serves it, and prints the path of a log that ``kvdiag doctor`` reads.
It runs once from the checkout's root, where a stale ``kvdiag/`` folder could shadow the
installed package in child processes, and once from an empty folder. Then the install is
taken apart and put back in every order (plain and editable), with compiled numba code in
between: ``kvdiag --version`` must keep working and nothing may be left inside the package.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.readme]

SMALL_REQUESTS = "3"


def readme_block(heading: str) -> list[str]:
    """The command lines of the first ```bash block after ``heading`` in README.md."""
    text = (ROOT / "README.md").read_text()
    start = text.index(heading)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, f"README.md: expected a ```bash block after {heading!r}"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def main_command() -> str:
    """The README's install line and main command for a machine without a GPU, with a small
    ``--requests`` (the only change)."""
    lines = [line for line in readme_block("## Install and run the main job") if "whl/cpu" in line]
    assert len(lines) == 1, "README.md: expected one install line that names PyTorch's CPU index"
    line, count = re.subn(r"--requests \d+", f"--requests {SMALL_REQUESTS}", lines[0])
    assert count == 1 and "kvdiag demo" in line
    return line


class Newcomer:
    """A shell on a fresh machine: an empty HOME and a new virtual environment on PATH."""

    def __init__(self, base: Path) -> None:
        self.home = base / "home"
        self.home.mkdir()
        self.venv = base / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True)
        # the machine's settings (pip's index and certificates) stay; the developer's go
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KVDIAG_", "XDG_", "NUMBA_", "PYTHON", "VIRTUAL_ENV", "CONDA"))}
        env.update(HOME=str(self.home), VIRTUAL_ENV=str(self.venv),
                   PATH=f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        self.env = env

    def sh(self, command: str, cwd: Path, timeout_s: float = 1500) -> subprocess.CompletedProcess:
        proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=self.env, capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        return proc

    def ok(self, command: str, cwd: Path, timeout_s: float = 1500) -> str:
        proc = self.sh(command, cwd, timeout_s)
        assert proc.returncode == 0, f"$ {command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    @property
    def site_packages(self) -> Path:
        rel = Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
        return self.venv / rel


def fresh_checkout(dest: Path) -> Path:
    """The checkout's tracked files (and uncommitted changes to them): a clean clone."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    dest.mkdir()
    for name in filter(None, files.decode().split("\0")):
        src, dst = ROOT / name, dest / name
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    return dest


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory):
    base = tmp_path_factory.mktemp("newcomer")
    return Newcomer(base), fresh_checkout(base / "kvdiag"), base


def _event_log(output: str) -> Path:
    match = re.search(r"^event log: (.+)$", output, re.M)
    assert match, f"no 'event log:' line in\n{output[-3000:]}"
    return Path(match.group(1))


def _doctor_reads(person: Newcomer, log: Path, cwd: Path) -> None:
    proc = person.sh(f"kvdiag doctor {shlex.quote(str(log))} --json", cwd)
    assert proc.returncode in (0, 1), proc.stderr  # 0 all pass, 1 a rule fails; 2 is a bad log
    assert '"rule"' in proc.stdout and "Traceback" not in proc.stderr


def _install_as_the_readme_says(person: Newcomer, checkout: Path) -> None:
    """The README's CPU install line (its main command up to ``kvdiag demo``) when the newcomer
    has not run it yet: the vLLM section follows the install, and this test must not lean on
    another test having run first (``-m vllm`` selects it alone)."""
    if person.sh("kvdiag --version", checkout).returncode == 0:
        return
    command = main_command()
    person.ok(command[:command.index("kvdiag demo")].rstrip().removesuffix("&&").rstrip(), cwd=checkout)


def test_readme_main_command_from_the_checkout_root_and_from_an_empty_folder(newcomer):
    person, checkout, base = newcomer
    command = main_command()
    out = person.ok(command, cwd=checkout)
    assert "Traceback" not in out
    assert len(re.findall(r"^model ready|fetching the default model", out, re.M)) == 1
    log = _event_log(out)
    assert log.is_file() and log.is_relative_to(person.home)  # under the user's cache, not the checkout
    _doctor_reads(person, log, checkout)

    empty = base / "empty"
    empty.mkdir()
    demo = command[command.index("kvdiag demo"):]
    out = person.ok(demo, cwd=empty)
    assert "Traceback" not in out and "fetching" not in out  # the model is fetched once
    log = _event_log(out)
    assert log.is_file()
    _doctor_reads(person, log, empty)
    assert not list(empty.iterdir())  # nothing written where the user stood


def test_uninstall_and_reinstall_in_any_order_keep_kvdiag_working(newcomer):
    """numba's compiled code goes to the user's cache; the package folder holds exactly what
    pip installed (its RECORD), so uninstalling removes it and any reinstall works."""
    person, checkout, base = newcomer
    site = person.site_packages
    trace = ROOT / "tests" / "data" / "demo_small" / "demo_24req_seed1.kvlog.gz"
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    compile_numba = f"kvdiag replay {shlex.quote(str(trace))} --policy lru --json > /dev/null"
    sequence = [("pip install -q --no-deps .", True), ("pip uninstall -y -q kvdiag", False),
                ("pip install -q --no-deps -e .", True), ("pip uninstall -y -q kvdiag", False),
                ("pip install -q --no-deps .", True), ("pip install -q --no-deps -e .", True),
                ("pip install -q --no-deps .", True)]
    for step, installed in sequence:
        person.ok(step, cwd=checkout)
        if not installed:
            assert not (site / "kvdiag").exists(), f"after `{step}`: left {list((site / 'kvdiag').rglob('*'))[:5]}"
            continue
        assert person.ok("kvdiag --version", cwd=elsewhere).strip() == "kvdiag 0.1.0"
        person.ok(compile_numba, cwd=elsewhere)
        if (site / "kvdiag").exists():  # a plain install: only pip's own files in the package
            record = next(site.glob("kvdiag-*.dist-info")) / "RECORD"
            listed = {line.split(",")[0] for line in record.read_text().splitlines()}
            stray = [str(p.relative_to(site)) for p in (site / "kvdiag").rglob("*")
                     if p.is_file() and str(p.relative_to(site)) not in listed
                     and not p.name.endswith(".pyc")]  # Python's own bytecode cache is fine
            assert not stray, f"after `{step}`: files inside the installed package: {stray[:5]}"
    assert list((person.home / ".cache" / "kvdiag" / "numba").rglob("*.nbi"))


@pytest.mark.vllm
def test_readme_vllm_commands(newcomer, vllm_python):
    """The README's vLLM line, verbatim but for ``--requests``, in the newcomer's environment
    (kvdiag installed from the copy of the checkout). The one liberty: vLLM's 3.5 GB
    environment is the one this machine already built (``$KVDIAG_VLLM_ENV``), so
    ``fetch-engine`` refreshes the kvdiag inside it from the newcomer's install instead of
    downloading vLLM again."""
    from kvdiag.demo.vllm_env import vllm_env_dir

    person, checkout, base = newcomer
    lines = readme_block("## On vLLM")
    assert len(lines) == 1 and "kvdiag fetch-engine vllm" in lines[0]
    line, count = re.subn(r"--requests \d+", f"--requests {SMALL_REQUESTS}", lines[0])
    assert count == 1 and "kvdiag demo --engine vllm" in line
    _install_as_the_readme_says(person, checkout)
    person.ok("pip install -q --no-deps .", cwd=checkout)
    person.env["KVDIAG_VLLM_ENV"] = str(vllm_env_dir())
    here = base / "vllm-user"
    here.mkdir()
    try:
        out = person.ok(line, cwd=here)
    finally:
        person.env.pop("KVDIAG_VLLM_ENV")
    assert "Traceback" not in out and "0 lost" in out
    log = _event_log(out)
    assert log.is_file() and log.is_relative_to(person.home)
    _doctor_reads(person, log, here)
    assert not list(here.iterdir())
