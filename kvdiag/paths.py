"""Where kvdiag keeps things on the user's machine.

- cache dir: ``$KVDIAG_HOME`` if set, else ``$XDG_CACHE_HOME/kvdiag`` (default
  ``~/.cache/kvdiag``): converted models, downloaded wheels.
- runtime dir: ``$XDG_RUNTIME_DIR/kvdiag`` or ``/tmp/kvdiag-$UID`` (mode 0700): agent sockets.
- log dir: ``<cache dir>/logs``: event logs recorded by ``kvdiag demo`` unless ``--log`` says.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The kvdiag cache folder (created on demand)."""
    home = os.environ.get("KVDIAG_HOME")
    if home:
        path = Path(home).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(xdg).expanduser() / "kvdiag"
    path.mkdir(parents=True, exist_ok=True)
    return path


def runtime_dir() -> Path:
    """A private folder (mode 0700) for the agent's Unix sockets."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(xdg) / "kvdiag" if xdg else Path(f"/tmp/kvdiag-{os.getuid()}")
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def log_dir() -> Path:
    """Default folder for recorded event logs."""
    path = cache_dir() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def agent_socket_path(pid: int | None = None) -> Path:
    """The live-event socket of the agent in process ``pid`` (default: this process)."""
    return runtime_dir() / f"agent-{pid if pid is not None else os.getpid()}.sock"
