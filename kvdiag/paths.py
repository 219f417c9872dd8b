"""Where kvdiag keeps things on the user's machine.

- cache dir: ``$KVDIAG_HOME`` if set, else ``$XDG_CACHE_HOME/kvdiag`` (default
  ``~/.cache/kvdiag``): converted models, downloaded wheels.
- runtime dir: ``$XDG_RUNTIME_DIR/kvdiag`` or ``/tmp/kvdiag-$UID``: agent sockets. Created with
  mode 0700 and used only when it is a real folder (no symlink), owned by this uid, with no
  group or other permission bits; otherwise :class:`RuntimeDirError`.
- log dir: ``<cache dir>/logs``: event logs recorded by ``kvdiag demo`` unless ``--log`` says.
- numba dir: ``<cache dir>/numba``: numba's compiled code (never inside the installed package).

Private files: everything kvdiag writes (logs, Parquet datasets, raw KV-event captures,
allocator snapshots, reports, rules files, screenshots, server output) is created with mode
0600 and every folder it creates with mode 0700, whatever the umask, through
:func:`open_private`, :func:`write_private_atomic` and :func:`make_private_dirs`. The mode is
given when the file is created (no chmod afterwards, which would leave a window); a file or
folder that already exists keeps its mode (kvdiag does not chmod what the user made).
"""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
import tempfile
from pathlib import Path
from typing import IO


class RuntimeDirError(PermissionError):
    """The runtime dir may not be trusted (owner, mode or symlink); the message says why and
    what to do (one line)."""


PRIVATE_FILE_MODE = 0o600  # read and write for the owner only
PRIVATE_DIR_MODE = 0o700  # the owner only may list, enter or create in it


def private_opener(path: str | os.PathLike, flags: int) -> int:
    """An ``opener`` for :func:`open` that creates a missing file with mode 0600."""
    return os.open(path, flags | os.O_CLOEXEC, PRIVATE_FILE_MODE)


def open_private(path: str | os.PathLike, mode: str = "w", **kwargs) -> IO:
    """:func:`open`, but a file it creates has mode 0600 from the start (an existing file
    keeps its mode). Missing parent folders are created 0700 (:func:`make_private_dirs`)."""
    make_private_dirs(Path(path).parent)
    return open(path, mode, opener=private_opener, **kwargs)


def create_private(path: str | os.PathLike) -> Path:
    """Make sure ``path`` exists, creating it empty with mode 0600 when missing, so that a
    library that opens it by name afterwards ("w" truncates but keeps the mode) writes a
    private file."""
    make_private_dirs(Path(path).parent)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE))
    return Path(path)


def write_private_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a 0600 temporary file in the same folder and a
    rename: ``path`` is the old file or the whole new one, never half-written, and the new one
    has mode 0600 whatever the old one had."""
    path = Path(path)
    make_private_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w",
                       **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def make_private_dirs(path: str | os.PathLike) -> Path:
    """Create ``path`` and its missing parents, each with mode 0700 whatever the umask; a
    folder that already exists keeps its mode."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR_MODE)
        except FileExistsError:  # made meanwhile by someone else: theirs, keep its mode
            if not d.is_dir():
                raise
            continue
        os.chmod(d, PRIVATE_DIR_MODE)  # ours, just made 0700 or less: give back what the umask took
    if not path.is_dir():
        raise NotADirectoryError(f"{path}: exists and is not a folder")
    return path


def cache_dir() -> Path:
    """The kvdiag cache folder (created on demand, 0700)."""
    home = os.environ.get("KVDIAG_HOME")
    if home:
        path = Path(home).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(xdg).expanduser() / "kvdiag"
    return make_private_dirs(path)


def numba_cache_dir() -> str:
    """Where numba caches compiled kernels: ``<cache dir>/numba``, or a private temporary
    folder when there is no writable home (a service account). numba loads what it finds
    there (pickles): a shared-temp folder is used only when it passes
    :func:`check_private_dir`, else a fresh one (no cache across runs)."""
    try:
        return str(cache_dir() / "numba")
    except OSError:
        pass
    shared = Path(tempfile.gettempdir()) / f"kvdiag-numba-{os.getuid()}"
    try:
        make_private_dirs(shared)
        check_private_dir(shared)
        return str(shared)
    except OSError:  # another user's, a symlink, open to others: not ours to load code from
        return tempfile.mkdtemp(prefix="kvdiag-numba-")


def use_numba_cache_dir() -> None:
    """Point numba's on-disk cache at :func:`numba_cache_dir` unless ``$NUMBA_CACHE_DIR`` says
    otherwise. numba reads the setting when each function is decorated, so call this before."""
    if not os.environ.get("NUMBA_CACHE_DIR"):
        import numba

        numba.config.CACHE_DIR = numba_cache_dir()


def runtime_dir() -> Path:
    """The private folder for the agent's Unix sockets (created with mode 0700, then checked
    with :func:`check_private_dir`)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        Path(xdg).mkdir(parents=True, exist_ok=True, mode=0o700)
    path = Path(xdg) / "kvdiag" if xdg else Path(f"/tmp/kvdiag-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # ours, just made: whatever the umask took away
    except FileExistsError:
        pass
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Raise :class:`RuntimeDirError` unless ``path`` is a folder (not a symlink) owned by this
    uid with no group or other permission bits (the checks OpenSSH and systemd make)."""
    fix = "remove it, or set XDG_RUNTIME_DIR to a private folder"
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeDirError(f"runtime dir {path} is a symlink; refusing to use it ({fix})")
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime dir {path} is not a folder; refusing to use it ({fix})")
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"runtime dir {path} is owned by uid {st.st_uid}, not by this user "
                              f"(uid {os.getuid()}); refusing to use it ({fix})")
    if st.st_mode & 0o077:
        raise RuntimeDirError(f"runtime dir {path} has mode {stat.S_IMODE(st.st_mode):04o}, open to group or "
                              f"others; refusing to use it (chmod 700 it, or {fix})")


def log_dir() -> Path:
    """Default folder for recorded event logs."""
    return make_private_dirs(cache_dir() / "logs")


def agent_socket_path(pid: int | None = None) -> Path:
    """The live-event socket of the agent in process ``pid`` (default: this process)."""
    return runtime_dir() / f"agent-{pid if pid is not None else os.getpid()}.sock"


WORKER_INBOX_PREFIX = "worker-inbox-"
"""Name prefix of the private socket where a vLLM engine core's agent receives its workers'
events (:class:`kvdiag.collectors.vllm_worker_link.WorkerInbox`): not an agent socket, no client reads it."""


def worker_inbox_path() -> Path:
    """A fresh inbox path for the workers of the server this process starts (its pid and a
    random suffix, in the runtime dir)."""
    return runtime_dir() / f"{WORKER_INBOX_PREFIX}{os.getpid()}-{os.urandom(3).hex()}.sock"


def is_worker_inbox(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a workers' inbox (:func:`worker_inbox_path`)."""
    return Path(path).name.startswith(WORKER_INBOX_PREFIX)


_SOCKET_NAME = re.compile(r"(?:agent|demo)-(\d+)(?:-\d+)?\.sock")


def remove_stale_sockets(directory: Path) -> list[Path]:
    """Remove this uid's ``agent-<pid>.sock`` and ``demo-<pid>-<port>.sock`` sockets in
    ``directory`` whose process is gone and on which nothing listens; the removed paths."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _SOCKET_NAME.fullmatch(name)
        path = Path(directory) / name
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid() and not _listening(path):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        pass
    return True


def _listening(path: Path) -> bool:
    """Whether a connection to ``path`` is not refused (something listens there)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        code = probe.connect_ex(str(path))
    return code not in (errno.ECONNREFUSED, errno.ENOENT)
