"""Where ``kvdiag top`` gets its events: a recorded log replayed as if live, the kvdiag agent's
Unix socket stream of a running server, a served engine without the agent read from outside by
attach's collectors (its /metrics and KV events), or a host-level view of a process.

Every source has the same small interface: ``poll()`` returns the events available now,
``now_ns()`` is the source's event-time clock (wall clock when live, the replay position when
replaying), ``pause()``/``resume()``/``seek(seconds)``, ``finished``, ``header`` and ``close()``.
Pure data: no UI library is imported here.

The sources, one module each: :mod:`kvdiag.live.replay_source` (a log),
:mod:`kvdiag.live.socket_source` (the agent's stream), :mod:`kvdiag.live.outside_sources` (a
process or served engine read from outside), :mod:`kvdiag.live.merged_source` (a source plus the
host view), :mod:`kvdiag.live.demo_source` (top's demo); :mod:`kvdiag.live.pid_source` picks one
for a PID. This module holds what they share: the errors, the clock type, what every live source does
alike (:class:`LiveSource`), the queue drain and the agent-socket lookup.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from kvdiag.events import schema as s
from kvdiag.collectors import agent_client

Clock = Callable[[], float]


class NoEngineError(Exception):
    """The process serves no recognised engine (exit status
    :data:`kvdiag.collectors.agent_client.NO_ENGINE_EXIT`)."""


class SourceError(Exception):
    """A source that cannot be opened; the message says what to do (one line)."""


class LiveSource:
    """What a live source (a running server, the demo, a process read from outside) does alike:
    its clock is the wall clock, it cannot seek, and pausing freezes only what top shows (its
    events are still folded as they arrive)."""

    paused = False

    def now_ns(self) -> int:
        return time.time_ns()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def seek(self, seconds: float) -> None:
        """A live view cannot seek."""


def drain(queue, limit: Optional[int]) -> list[s.Event]:
    """Up to ``limit`` events (all when None) taken from the left of a live source's deque,
    which its reader thread appends to."""
    out = []
    while queue and (limit is None or len(out) < limit):
        out.append(queue.popleft())
    return out


def find_agent_socket(pid: int) -> Optional[Path]:
    """The kvdiag agent socket serving any PID of a served process tree (see
    :func:`kvdiag.collectors.agent_client.find_agent_socket`), if one exists."""
    return agent_client.find_agent_socket(pid)
