"""The vLLM plugin's shared state: the wrapped methods, the sink they record into, their error
counts and what the hooks remember between calls (:class:`Hooks`), and the block key the plugin
records (:func:`fold_hash`). The hooks themselves: :mod:`kvdiag.collectors.vllm_scheduler_hooks`.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional

from kvdiag.events.hooks import HookErrors, MethodHooks, UsesHookErrors
from kvdiag.pool.prefix_cache import fold_block_hash
from kvdiag.events.sinks import NullSink

ENGINE = "vllm"
COLLECTOR = "vllm-plugin"


def now_ns() -> int:
    """Wall-clock time of an event, ns."""
    return time.time_ns()


def fold_hash(key: Any) -> Optional[int]:
    """A block's key in vLLM's pool (its hash bytes followed by a 4-byte group id) as the key
    vLLM publishes for it in its KV events (the hash's low 64 bits, big-endian, as
    ``maybe_convert_block_hash`` makes it), folded by :func:`kvdiag.pool.prefix_cache.fold_block_hash`:
    a block's ``BlockStored`` from the plugin and its ``PrefixCacheStored`` share one key."""
    if key is None:
        return None
    return fold_block_hash(int.from_bytes(bytes(key)[:-4], "big"))


# ------------------------------------------------------------------------------ hook plumbing


class Hooks(UsesHookErrors):
    """The wrapped methods, the sink they record into, and their error counts."""

    def __init__(self) -> None:
        # the one error policy and method wrapping of engine adapters (kvdiag.events.hooks)
        self.error_policy = HookErrors(NullSink(), COLLECTOR, clock_ns=now_ns)
        self.methods = MethodHooks(self.error_policy, os.environ.get("KVDIAG_FAIL_HOOK", ""))
        # prompts as token ids (KVDIAG_RECORD_TOKENS=1) or chunk hashes under the log's salt
        self.record_token_ids = False
        self.content_salt: Optional[str] = None
        self.current_request: Optional[str] = None  # inside allocate_slots
        self.cached_tokens: dict[str, int] = {}  # request -> prefix hits at first admission
        self.scheduled: set[str] = set()  # requests given their first slots
        self.first_token_ns: dict[str, int] = {}  # request -> time to its first output token
        self.step_started: dict[int, int] = {}  # id(scheduler output) -> ns
        self.step_id = 0
        self.sample_interval_ns = int(float(os.environ.get("KVDIAG_SAMPLE_INTERVAL_S", "0.5")) * 1e9)
        self.next_sample_ns = 0
        self.scheduler: Any = None
        self.agent: Any = None
        self.agent_api: Any = None  # kvdiag.agent (start, stop), handed in by register
        self.lock = threading.Lock()
        self.block_size_tokens = 0  # the pool's, for the tokens of a prefix hit
        self.last_step_ns = 0  # when the engine last finished a step (0: none yet)
        self.sample_lock = threading.Lock()  # the step's sample and the idle thread's, one at a time
        self.idle_stop = threading.Event()
        self.idle_thread: Optional[threading.Thread] = None
        self.worker: Any = None  # kvdiag.collectors.vllm_worker.WorkerShadow (None: shadow off)
        self.inbox: Any = None  # kvdiag.collectors.vllm_worker_link.WorkerInbox: workers' events, here

    @property
    def skipped(self) -> dict[str, str]:
        """Hooks not installed -> why."""
        return self.methods.skipped

    def record(self, event) -> None:
        self.sink.record(event)

    def failed(self, hook: str, exc: BaseException) -> None:
        """The error policy of :class:`kvdiag.events.hooks.HookErrors`: counted, the first of each
        (hook, type) reported at once, never raised into vLLM."""
        self.error_policy.failed(hook, exc)

    def wrap(self, cls: type, name: str, params: tuple[str, ...],
             after: Callable[..., None], before: Optional[Callable[..., Any]] = None) -> None:
        """Wrap ``cls.name`` (:meth:`kvdiag.events.hooks.MethodHooks.wrap`): vLLM's method runs
        unchanged; ``before(self, *a, **kw)`` may take a note first, ``after(note, result, self,
        *a, **kw)`` records. Skipped (and said) when the method or one of ``params`` is missing."""
        self.methods.wrap(cls, name, after, before, params)

    def unwrap(self) -> None:
        self.methods.restore()
