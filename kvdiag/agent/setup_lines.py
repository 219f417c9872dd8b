"""What the agent's live socket tells a client that joins late, before any new event: the
latest ``KVPoolInfo``, every ``CollectorStatus``, the latest ``ShadowSharing`` of each
configuration (a late client takes its counters as the baseline of its window) and the latest
``ProcessSample`` of each process (its memory shows at once, not at the next sample).

Each kind has its own bound, so that many processes (workers restarting, short-lived pids)
never crowd out a collector that starts later: at most :data:`MAX_SETUP_LINES` setup lines (a
new key beyond it is not kept) and :data:`MAX_PROCESS_LINES` processes (the one sampled
longest ago goes first)."""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from kvdiag.events.schema import CollectorStatus, Event, KVPoolInfo, ProcessSample, ShadowSharing

SETUP_TYPES = (KVPoolInfo, CollectorStatus, ShadowSharing)
KEPT_TYPES = (*SETUP_TYPES, ProcessSample)
"""The event types :meth:`SetupLines.keep` keeps: the socket's ``record()`` tests this first, so
the engine's other events (nearly all) pay one ``isinstance``, not a call."""
MAX_SETUP_LINES = 256
MAX_PROCESS_LINES = 64


def setup_key(event) -> str:
    """Which setup line ``event`` replaces: one per pool, collector, shadow configuration."""
    if isinstance(event, KVPoolInfo):
        return "pool"
    if isinstance(event, CollectorStatus):
        return f"status:{event.collector}"
    return f"shadow:{event.policy}:{event.block_size_tokens}:{event.capacity_blocks}"


class SetupLines:
    """The encoded lines of the module docstring. :meth:`keep` runs on the engine's thread and
    never raises; :meth:`joined` on the socket's thread (each is one C-level dict operation
    under the GIL, so no lock)."""

    def __init__(self) -> None:
        self._encoder = msgspec.json.Encoder()
        self._setup: dict[str, bytes] = {}
        self._processes: OrderedDict[int, bytes] = OrderedDict()

    def keep(self, event: Event) -> None:
        """Keep ``event``'s line when it is one (other events are ignored)."""
        try:
            if isinstance(event, SETUP_TYPES):
                key = setup_key(event)
                if key in self._setup or len(self._setup) < MAX_SETUP_LINES:
                    self._setup[key] = self._encoder.encode(event) + b"\n"
            elif isinstance(event, ProcessSample):
                self._processes[event.pid] = self._encoder.encode(event) + b"\n"
                self._processes.move_to_end(event.pid)
                while len(self._processes) > MAX_PROCESS_LINES:
                    self._processes.popitem(last=False)
        except Exception:
            pass

    def joined(self) -> bytes:
        """Every kept line, setup lines first."""
        return b"".join([*self._setup.values(), *self._processes.values()])
