"""Release paths: are KV blocks and other cache objects given back when their owner is done?

Two tools:

- :class:`ReleaseMonitor`, a sink for an engine adapter's block events that keeps a live
  :class:`~kvdiag.pool.blockledger.BlockLedger` (the one pool ledger: blocks held per request,
  cached, free, finished requests still holding, bad releases; flat memory) and forwards every
  event to an inner sink;
- :class:`Tracker` behind ``kvdiag.track(obj, nbytes, owner=...)``, for engines without an
  adapter: it holds only weak references, and reports objects still alive after their owner
  (an object, or a key ended with :meth:`Tracker.end_owner`) is gone.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Hashable, Optional

from kvdiag.pool.blockledger import BlockLedger
from kvdiag.events.schema import Event
from kvdiag.events.sinks import NullSink, Sink


class ReleaseMonitor:
    """Sink: applies each event to a ledger (under a lock) and forwards it to ``inner``. Read
    ``ledger`` under ``lock``."""

    def __init__(self, inner: Optional[Sink] = None) -> None:
        self.inner = inner or NullSink()
        self.ledger = BlockLedger()
        self.lock = threading.Lock()

    def record(self, event: Event) -> None:
        try:
            with self.lock:
                self.ledger.apply(event)
        except Exception:  # accounting must never break the engine's release path
            pass
        self.inner.record(event)

    def flush(self) -> None:
        self.inner.flush()


@dataclass(frozen=True, slots=True)
class Outliver:
    """A tracked object still alive ``outlived_s`` seconds after its owner ended."""

    token: int
    label: str
    type_name: str
    nbytes: int
    owner: str
    outlived_s: float


@dataclass(slots=True)
class _Entry:
    ref: Any  # weakref to the object
    nbytes: int
    owner_key: Hashable
    label: str
    type_name: str


class Tracker:
    """Weak-reference registry of cache objects and their owners (thread-safe)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._owner_ended_ns: dict[Hashable, int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def track(self, obj: Any, nbytes: int, owner: Any, label: str = "") -> int:
        """Register ``obj`` (``nbytes`` of cache memory) as belonging to ``owner``. ``owner``
        is an object (ended when it is garbage-collected) or a hashable key such as a request
        id (ended by :meth:`end_owner`). Returns a token. Raises TypeError if ``obj`` cannot be
        weakly referenced (wrap plain lists/dicts in an object)."""
        token = next(self._ids)
        try:
            ref = weakref.ref(obj, lambda _r, t=token: self._forget(t))
        except TypeError:
            raise TypeError(f"kvdiag.track: cannot weakly reference a {type(obj).__name__}; "
                            "track an object that supports weak references (e.g. a tensor)") from None
        if isinstance(owner, Hashable) and isinstance(owner, (str, int, tuple)):
            key = owner
        else:
            key = ("object", id(owner), type(owner).__name__)
            try:
                weakref.finalize(owner, self.end_owner, key)
            except TypeError:
                raise TypeError(f"kvdiag.track: owner {type(owner).__name__} is neither a key "
                                "(str/int/tuple) nor weakly referenceable") from None
        with self._lock:
            self._entries[token] = _Entry(ref, int(nbytes), key, label or type(obj).__name__,
                                          type(obj).__name__)
        return token

    def end_owner(self, owner: Hashable) -> None:
        """Mark an owner key as done (a request finished); its objects should go soon."""
        with self._lock:
            self._owner_ended_ns.setdefault(owner, time.monotonic_ns())

    def _forget(self, token: int) -> None:
        with self._lock:
            entry = self._entries.pop(token, None)
            if entry is not None and not any(e.owner_key == entry.owner_key for e in self._entries.values()):
                self._owner_ended_ns.pop(entry.owner_key, None)

    def live_bytes(self) -> int:
        """Bytes of tracked objects still alive."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.ref() is not None)

    def outliving(self, grace_s: float = 0.0) -> list[Outliver]:
        """Objects alive more than ``grace_s`` after their owner ended, largest first."""
        now = time.monotonic_ns()
        out = []
        with self._lock:
            for token, e in self._entries.items():
                ended = self._owner_ended_ns.get(e.owner_key)
                if ended is None or e.ref() is None:
                    continue
                age = (now - ended) / 1e9
                if age >= grace_s:
                    owner = e.owner_key[2] if isinstance(e.owner_key, tuple) and e.owner_key[:1] == ("object",) \
                        else str(e.owner_key)
                    out.append(Outliver(token, e.label, e.type_name, e.nbytes, owner, age))
        return sorted(out, key=lambda o: -o.nbytes)


_default: Optional[Tracker] = None
_default_lock = threading.Lock()


def default_tracker() -> Tracker:
    """The process-wide tracker used by ``kvdiag.track``."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Tracker()
        return _default
