"""The one hook helper for engine adapters: wrap a method, check its signature, contain errors.

Every adapter that runs code inside an engine (the vLLM plugin, the transformers adapter, the
shadow runner's measurements) follows one error policy, :class:`HookErrors`:

- every error is counted, per place (``where``: the hooked method, or the shadow method);
- the first error of each (where, exception type) is reported at once, as one
  ``CollectorError`` (``collector = "<adapter>:<where>"``, ``count`` 1); later ones of the same
  pair only count (a hook that fails on every step must not flood the log);
- :meth:`HookErrors.report_totals` (at uninstall or close) reports, for each place that
  failed more than once, the errors not reported yet (``count``): the ``count`` of a place's
  ``CollectorError`` events add up to its errors, as the live view and the exporter sum them;
- nothing is ever raised into the engine: neither the hook's error nor a failing sink's.

:class:`MethodHooks` wraps methods (``before`` may take a note, the engine's method runs
unchanged, ``after`` records), or replaces them through a factory, after checking that the
method exists and takes the parameters the hook reads: a method whose signature changed is
skipped and said (:meth:`MethodHooks.statuses`: ``CollectorStatus`` events), never a crash.
:func:`step_phase` names an engine step from its prefill and decode work. The module imports
only the event schema and sinks, so collectors and the shadow may both use it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator, Optional

from kvdiag.events.schema import CollectorError, CollectorStatus
from kvdiag.events.sinks import NullSink, Sink

MESSAGE_CHARS = 500
"""At most this many characters of an error's text go into its ``CollectorError``."""


def step_phase(prefill_tokens: int, decode_tokens: int) -> str:
    """The phase of an engine step: ``mixed`` when it computed both prompt (prefill) tokens and
    generated (decode) tokens, ``decode`` when only generated ones, else ``prefill``."""
    if prefill_tokens and decode_tokens:
        return "mixed"
    return "decode" if decode_tokens else "prefill"


class HookErrors:
    """The error policy above. ``sink``: where reports go (may be swapped later, e.g. when an
    agent starts; a :class:`NullSink` means nobody listens, so the first of each kind is printed
    on stderr instead). ``collector``: the adapter's name, prefixed to ``where`` (None: ``where``
    is the collector). ``errors[where]`` counts every error at that place."""

    def __init__(self, sink: Optional[Sink] = None, collector: Optional[str] = None,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.sink: Sink = sink if sink is not None else NullSink()
        self.collector = collector
        self.clock_ns = clock_ns
        self.errors: Counter[str] = Counter()
        self._reported: set[tuple[str, str]] = set()
        self._told: Counter[str] = Counter()  # errors per place that reports counted already
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        """Errors counted at every place."""
        return sum(self.errors.values())

    def collector_of(self, where: str) -> str:
        return f"{self.collector}:{where}" if self.collector else where

    def failed(self, where: str, exc: BaseException) -> None:
        """Count ``exc`` at ``where``; report it if it is the first of its (where, type)."""
        kind = type(exc).__name__
        with self._lock:
            self.errors[where] += 1
            first = (where, kind) not in self._reported
            self._reported.add((where, kind))
            if first:
                self._told[where] += 1
        if not first:
            return
        message = f"{kind}: {exc}"[:MESSAGE_CHARS]
        if isinstance(self.sink, NullSink):
            print(f"kvdiag: {self.collector_of(where)}: {message}", file=sys.stderr)
        self._record(CollectorError(ts_ns=self.clock_ns(), collector=self.collector_of(where),
                                    message=message, count=1))

    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """``with errors.guard(where): ...``: an exception inside is counted and reported by
        the policy, and goes no further."""
        try:
            yield
        except Exception as exc:
            self.failed(where, exc)

    def record(self, event: Any) -> bool:
        """Send ``event`` to the sink; a failing sink is counted (``where="sink"``), never
        raised. True when it was recorded."""
        try:
            self.sink.record(event)
            return True
        except Exception as exc:
            with self._lock:
                self.errors["sink"] += 1
            del exc
            return False

    def report_totals(self) -> None:
        """One ``CollectorError`` per place with errors not reported yet, ``count`` = those
        (so a place's events sum to its errors); the message gives the total."""
        with self._lock:
            rest = [(where, n, n - self._told[where]) for where, n in self.errors.items()
                    if where != "sink" and n > self._told[where]]
            for where, n, _ in rest:
                self._told[where] = n
        for where, n, more in rest:
            self._record(CollectorError(ts_ns=self.clock_ns(), collector=self.collector_of(where),
                                        message=f"{n} errors in all", count=more))

    def _record(self, event: Any) -> None:
        try:
            self.sink.record(event)
        except Exception:  # the reporting sink failed too: counted, never raised
            with self._lock:
                self.errors["sink"] += 1


class UsesHookErrors:
    """Mixin for an adapter that keeps its errors in ``self.error_policy`` (a
    :class:`HookErrors`): its ``sink`` is the policy's (set it to redirect both) and
    ``errors`` counts every error per place."""

    error_policy: HookErrors

    @property
    def sink(self) -> Sink:
        return self.error_policy.sink

    @sink.setter
    def sink(self, sink: Sink) -> None:
        self.error_policy.sink = sink

    @property
    def errors(self) -> Counter[str]:
        return self.error_policy.errors


def missing_parameters(method: Any, params: tuple[str, ...]) -> Optional[list[str]]:
    """The names in ``params`` that ``method``'s signature lacks (None: no signature to read,
    e.g. a builtin, which then counts as lacking them all)."""
    try:
        have = set(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return None
    return [p for p in params if p not in have]


class MethodHooks:
    """Methods wrapped or replaced on engine classes, put back by :meth:`restore`, and the
    hooks skipped because the engine's method is missing or its signature changed."""

    def __init__(self, errors: HookErrors, fail_hook: str = "") -> None:
        self.errors = errors
        self.fail_hook = fail_hook  # a method name whose ``after`` raises (fault injection)
        self.installed: list[tuple[type, str, Any, bool]] = []  # (class, name, original, own)
        self.skipped: dict[str, str] = {}  # where -> why

    def _original(self, cls: type, name: str, params: tuple[str, ...],
                  where: str) -> Optional[Any]:
        """The attribute to hook, or None (and why, in ``skipped``) when it cannot be."""
        own = name in cls.__dict__
        original = cls.__dict__[name] if own else getattr(cls, name, None)
        if original is None:
            self.skipped[where] = "no such method in this engine version"
            return None
        target = original.fget if isinstance(original, property) else original
        if params:
            missing = missing_parameters(target, params)
            if missing is None:
                missing = list(params)
            if missing:
                self.skipped[where] = f"parameters {missing} not in this engine's signature"
                return None
        return original

    def replace(self, cls: type, name: str, make: Callable[[Any], Any],
                params: tuple[str, ...] = (), where: Optional[str] = None) -> bool:
        """Set ``cls.name`` to ``make(original)`` (which must contain its own errors, e.g. with
        ``errors.guard``). False, and the hook skipped, when the check fails."""
        where = where or f"{cls.__name__}.{name}"
        original = self._original(cls, name, params, where)
        if original is None:
            return False
        self.installed.append((cls, name, original, name in cls.__dict__))
        setattr(cls, name, make(original))
        return True

    def wrap(self, cls: type, name: str, after: Callable[..., None],
             before: Optional[Callable[..., Any]] = None, params: tuple[str, ...] = (),
             where: Optional[str] = None) -> bool:
        """Wrap ``cls.name``: ``before(obj, *a, **kw)`` may take a note, the engine's method
        runs unchanged and its result is returned, then ``after(note, result, obj, *a, **kw)``
        records. An error in ``before`` or ``after`` is handled by the policy (``note`` is
        then None); the engine's own errors pass through untouched."""
        where = where or f"{cls.__name__}.{name}"
        errors, fail = self.errors, self.fail_hook == name

        def make(original):
            def wrapper(obj, *args, **kwargs):
                note = None
                if before is not None:
                    try:
                        note = before(obj, *args, **kwargs)
                    except Exception as exc:  # never into the engine
                        errors.failed(where, exc)
                result = original(obj, *args, **kwargs)
                try:
                    if fail:
                        raise RuntimeError(f"fault injected into {where} (KVDIAG_FAIL_HOOK)")
                    after(note, result, obj, *args, **kwargs)
                except Exception as exc:  # never into the engine
                    errors.failed(where, exc)
                return result

            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            wrapper.__name__ = getattr(original, "__name__", name)
            wrapper.__doc__ = getattr(original, "__doc__", None)
            return wrapper

        return self.replace(cls, name, make, params, where)

    def restore(self) -> None:
        """Put back every class attribute exactly as it was (an inherited one is deleted from
        the subclass again), last hooked first."""
        for cls, name, original, own in reversed(self.installed):
            if own:
                setattr(cls, name, original)
            else:
                delattr(cls, name)
        self.installed.clear()

    def statuses(self, ts_ns: Optional[int] = None) -> list[CollectorStatus]:
        """One ``CollectorStatus(available=False)`` per skipped hook, saying why."""
        ts = self.errors.clock_ns() if ts_ns is None else ts_ns
        return [CollectorStatus(ts_ns=ts, collector=self.errors.collector_of(where), available=False,
                                hint=f"hook not installed: {why}")
                for where, why in self.skipped.items()]
