"""A primary source (the agent's stream, top's demo) merged with the host view of its process
tree (:class:`kvdiag.live.outside_sources.ProcessSource`)."""

from __future__ import annotations

from typing import Optional

from kvdiag.events import schema as s
from kvdiag.live.outside_sources import ProcessSource


class MergedSource:
    """A primary source (agent stream, demo) plus the host view of its process tree (RSS, GPU
    memory) sampled from outside; clock, header, pause and seek are the primary's."""

    live = True

    def __init__(self, primary, host: ProcessSource) -> None:
        self.primary, self.host = primary, host

    description = property(lambda self: self.primary.description)
    header = property(lambda self: self.primary.header)
    paused = property(lambda self: self.primary.paused)
    finished = property(lambda self: self.primary.finished)

    def now_ns(self) -> int:
        return self.primary.now_ns()

    def poll(self, limit: Optional[int] = None) -> list[s.Event]:
        return self.primary.poll(limit) + self.host.poll()

    def pause(self) -> None:
        self.primary.pause()

    def resume(self) -> None:
        self.primary.resume()

    def seek(self, seconds: float) -> None:
        self.primary.seek(seconds)

    def close(self) -> None:
        self.host.close()
        self.primary.close()


def with_host_view(primary, pid: int):
    """``primary`` merged with the outside view of ``pid`` (``primary`` alone when that
    process cannot be read)."""
    try:
        return MergedSource(primary, ProcessSource(pid, has_agent=True))
    except Exception:  # the process went away or is unreadable: the primary still works
        return primary
