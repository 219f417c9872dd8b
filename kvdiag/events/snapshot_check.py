"""Check an allocator snapshot's shape before anything summarises it, in time linear in its size.

A snapshot file is untrusted. A pickle can nest containers far deeper than any summary can
recurse, refer to itself, or reference one container many times (pickle's memo): a 40 KB file
can describe 10^8 blocks. :func:`check_snapshot` therefore rejects, with ``where: ...`` in one
line:

- nesting deeper than :data:`MAX_DEPTH` levels, and cycles (a container inside itself);
- a segment, a ``blocks`` list, a block, a ``device_traces`` list or a trace entry that is the
  same object as another one (torch never writes one twice; frames may be shared);
- missing required keys (``segments[i].blocks``, ``.total_size``; a block's ``size``,
  ``address``, ``state``) and fields of the wrong type or range: sizes and addresses are
  integers in ``[0, 2**63)``.

Each distinct container is visited once, so the check and the summaries after it cost time
linear in the number of references the file holds, i.e. in its serialized size.
"""

from __future__ import annotations

from typing import Any, Iterator

MAX_DEPTH = 64
"""Deepest nesting accepted (a torch snapshot nests 7 containers: the snapshot, segments, a
segment, blocks, a block, frames, a frame)."""
SMALL_LEAF = 8
"""Containers of at most this many items and no container inside (frames, most blocks) are
re-scanned where referenced rather than remembered: linear still, without a table entry each."""
INT64_LIMIT = 1 << 63


class SnapshotFormatError(ValueError):
    """The snapshot is not torch's plain structure; the message is ``where: expected ...``."""


def _children(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, (tuple, frozenset)):
                yield k
            yield v
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj


def _is_container(obj: Any) -> bool:
    return isinstance(obj, (dict, list, tuple, set, frozenset))


def _small_leaf(obj: Any) -> bool:
    return len(obj) <= SMALL_LEAF and not any(_is_container(k) for k in _children(obj))


def check_depth(root: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """Raise unless every path from ``root`` is at most ``limit`` containers long and acyclic;
    iterative, each distinct container visited once (heights memoised by id, but small leaves)."""
    if not _is_container(root):
        return
    height: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, _children(root), 0)]  # (container, its children left, height so far)
    on_path.add(id(root))
    while stack:
        node, kids, h = stack[-1]
        for kid in kids:
            if not _is_container(kid):
                continue
            if id(kid) in on_path:
                raise SnapshotFormatError(f"{where}: snapshot contains itself (a cycle); expected plain data")
            known = 0 if _small_leaf(kid) else height.get(id(kid))
            if known is None:
                if len(stack) >= limit:
                    raise SnapshotFormatError(f"{where}: snapshot nested deeper than {limit} levels")
                stack[-1] = (node, kids, h)
                stack.append((kid, _children(kid), 0))
                on_path.add(id(kid))
                break
            h = max(h, known + 1)
            if len(stack) + 1 + known > limit:
                raise SnapshotFormatError(f"{where}: snapshot nested deeper than {limit} levels")
            stack[-1] = (node, kids, h)
        else:
            stack.pop()
            on_path.discard(id(node))
            height[id(node)] = h
            if stack:
                parent, pkids, ph = stack[-1]
                stack[-1] = (parent, pkids, max(ph, h + 1))


class _Checker:
    """One pass over segments and device traces; ``seen`` holds the containers that must be
    distinct objects, ``frames_ok`` the frame lists already checked (those may be shared)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.seen: dict[int, str] = {}
        self.frames_ok: set[int] = set()

    def fail(self, path: str, expected: str, value: Any) -> None:
        if _is_container(value):
            shown = type(value).__name__
        elif type(value) is int and value.bit_length() > 64:
            shown = f"an integer of {value.bit_length()} bits"
        else:
            shown = repr(value)
        raise SnapshotFormatError(f"{self.where}: {path}: expected {expected}, found {shown[:80]}")

    def own(self, obj: Any, path: str) -> None:
        first = self.seen.setdefault(id(obj), path)
        if first != path:
            raise SnapshotFormatError(
                f"{self.where}: {path}: expected an object of its own, found the same object as {first} "
                "(a shared reference; torch never writes one)")

    def dict_at(self, obj: Any, path: str) -> dict:
        if not isinstance(obj, dict):
            self.fail(path, "a dict", obj)
        return obj

    def list_at(self, obj: Any, path: str) -> list:
        if not isinstance(obj, (list, tuple)):
            self.fail(path, "a list", obj)
        return obj

    def uint(self, d: dict, key: str, path: str, required: bool = False) -> None:
        if key not in d:
            if required:
                raise SnapshotFormatError(f"{self.where}: {path}: expected key {key!r}")
            return
        v = d[key]
        if type(v) is not int or not 0 <= v < INT64_LIMIT:
            self.fail(f"{path}.{key}", "an integer in [0, 2**63)", v)

    def typed(self, d: dict, key: str, path: str, types: tuple, what: str, required: bool = False) -> None:
        if key not in d:
            if required:
                raise SnapshotFormatError(f"{self.where}: {path}: expected key {key!r}")
            return
        if not isinstance(d[key], types) or isinstance(d[key], bool) and bool not in types:
            self.fail(f"{path}.{key}", what, d[key])

    def frames(self, d: dict, path: str) -> None:
        frames = d.get("frames")
        if frames is None or id(frames) in self.frames_ok:
            return
        for k, f in enumerate(self.list_at(frames, f"{path}.frames")):
            f = self.dict_at(f, f"{path}.frames[{k}]")
            self.typed(f, "filename", f"{path}.frames[{k}]", (str,), "a string")
            self.typed(f, "name", f"{path}.frames[{k}]", (str,), "a string")
            self.typed(f, "line", f"{path}.frames[{k}]", (int,), "an integer")
        self.frames_ok.add(id(frames))

    def segment(self, seg: Any, path: str) -> None:
        seg = self.dict_at(seg, path)
        self.own(seg, path)
        for key in ("total_size", "address", "device", "stream", "allocated_size", "active_size", "requested_size"):
            self.uint(seg, key, path, required=key == "total_size")
        self.typed(seg, "segment_type", path, (str,), "a string")
        self.typed(seg, "is_expandable", path, (bool, int), "a boolean")
        pool = seg.get("segment_pool_id")
        if pool is not None and (not isinstance(pool, (list, tuple)) or len(pool) != 2
                                 or any(type(x) is not int for x in pool)):
            self.fail(f"{path}.segment_pool_id", "a pair of integers", pool)
        if "blocks" not in seg:
            raise SnapshotFormatError(f"{self.where}: {path}: expected key 'blocks'")
        blocks = self.list_at(seg["blocks"], f"{path}.blocks")
        self.own(blocks, f"{path}.blocks")
        for j, b in enumerate(blocks):
            bp = f"{path}.blocks[{j}]"
            b = self.dict_at(b, bp)
            self.own(b, bp)
            self.uint(b, "size", bp, required=True)
            self.uint(b, "address", bp, required=True)
            self.uint(b, "requested_size", bp)
            self.typed(b, "state", bp, (str,), "a string", required=True)
            self.frames(b, bp)

    def traces(self, traces: Any) -> None:
        for d, trace in enumerate(self.list_at(traces, "device_traces")):
            tp = f"device_traces[{d}]"
            trace = self.list_at(trace, tp)
            self.own(trace, tp)
            for i, e in enumerate(trace):
                ep = f"{tp}[{i}]"
                e = self.dict_at(e, ep)
                self.own(e, ep)
                self.uint(e, "addr", ep)
                self.uint(e, "size", ep)
                self.typed(e, "action", ep, (str,), "a string")
                self.typed(e, "time_us", ep, (int, float), "a number")
                self.frames(e, ep)


def check_snapshot(snapshot: Any, where: str = "snapshot") -> dict:
    """Return ``snapshot`` if it has torch's snapshot shape (see the module docstring), else
    raise :class:`SnapshotFormatError` naming ``where`` and the offending path."""
    check_depth(snapshot, where)
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), (list, tuple)):
        raise SnapshotFormatError(f"{where}: expected a dict with a 'segments' list (torch.cuda.memory._snapshot())")
    checker = _Checker(where)
    for i, seg in enumerate(snapshot["segments"]):
        checker.segment(seg, f"segments[{i}]")
    if snapshot.get("device_traces") is not None:
        checker.traces(snapshot["device_traces"])
    return snapshot
