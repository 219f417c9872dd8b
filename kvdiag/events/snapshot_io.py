"""Load and save CUDA allocator snapshots without trusting the file.

``torch.cuda.memory._dump_snapshot`` writes a pickle, and unpickling runs whatever callables the
file names. :func:`load_snapshot` therefore unpickles through :class:`PlainUnpickler`, which
refuses every global (no class, no function, no ``__reduce__``) so that only dicts, lists,
tuples, sets, strings, bytes, numbers, booleans and None can come out. JSON snapshots (what
kvdiag writes) are read as plain JSON. Either way the result then passes
:func:`kvdiag.events.snapshot_check.check_snapshot` (depth, shared references, keys, types, ranges),
so that summarising it takes time linear in the file's size.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

from kvdiag.events.snapshot_check import MAX_DEPTH, SnapshotFormatError, check_depth, check_snapshot


class SnapshotLoadError(SnapshotFormatError):
    """The file is not a plain snapshot; the message is ``file: expected ...`` or
    ``file: segments[i].blocks[j].size: expected ...``."""


class PlainUnpickler(pickle.Unpickler):
    """An unpickler that admits only plain containers, numbers and strings.

    Every opcode that would import a name (GLOBAL, STACK_GLOBAL, INST, OBJ, REDUCE targets)
    goes through ``find_class``, which always refuses; persistent ids are refused too. So a
    malicious pickle fails before any of its callables can run.
    """

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"refused global {module}.{name}: only plain containers, numbers and strings are allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id: only plain data is allowed")


def loads_plain(data: bytes) -> Any:
    """Unpickle ``data`` admitting only plain data; raises ``pickle.UnpicklingError`` otherwise."""
    return PlainUnpickler(io.BytesIO(data)).load()


def load_snapshot(path: str | os.PathLike) -> dict:
    """Read a snapshot dict (``segments``, ``device_traces``) from a pickle or JSON file.

    Raises :class:`SnapshotLoadError` with ``file: expected ...`` for anything that is not
    plain data of that shape (:func:`kvdiag.events.snapshot_check.check_snapshot`); never runs code
    from the file.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SnapshotLoadError(f"{path}: expected a readable snapshot file ({exc.strerror})") from None
    if raw[:1] in (b"{", b"[") or path.suffix == ".json":
        try:
            snapshot = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            line = getattr(exc, "lineno", 1)
            raise SnapshotLoadError(f"{path}:{line}: expected a JSON snapshot ({exc})") from None
        except RecursionError:  # Python's decoder recurses: far deeper than MAX_DEPTH
            raise SnapshotLoadError(f"{path}: snapshot nested deeper than {MAX_DEPTH} levels") from None
        except ValueError as exc:  # e.g. an integer of more digits than Python converts
            raise SnapshotLoadError(f"{path}: expected a JSON snapshot ({exc})") from None
    else:
        try:
            snapshot = loads_plain(raw)
        except pickle.UnpicklingError as exc:
            raise SnapshotLoadError(f"{path}: expected a plain-data snapshot pickle; {exc}") from None
        except Exception as exc:  # truncated or garbage bytes
            raise SnapshotLoadError(f"{path}: expected a snapshot pickle ({type(exc).__name__}: {exc})") from None
    try:
        return check_snapshot(snapshot, str(path))
    except SnapshotFormatError as exc:
        raise SnapshotLoadError(str(exc)) from None


def _jsonable(obj: Any, memo: dict[int, Any]) -> Any:
    """``obj`` as JSON types; a container referenced many times is converted once (``memo``);
    callers bound the depth first (:func:`check_depth`)."""
    if isinstance(obj, (dict, list, tuple, set, frozenset)):
        done = memo.get(id(obj))
        if done is None:
            if isinstance(obj, dict):
                done = {str(k): _jsonable(v, memo) for k, v in obj.items()}
            else:
                done = [_jsonable(v, memo) for v in obj]
            memo[id(obj)] = done
        return done
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def save_snapshot_json(snapshot: dict, path: str | os.PathLike) -> Path:
    """Write ``snapshot`` as JSON (tuples become lists), atomically: no half-written file;
    mode 0600 (a snapshot holds the process's stack traces)."""
    from kvdiag.paths import write_private_atomic

    path = Path(path)
    check_depth(snapshot, str(path))
    return write_private_atomic(path, json.dumps(_jsonable(snapshot, {})))
