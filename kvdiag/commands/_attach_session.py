"""The collectors of one `kvdiag attach`, sampled from its main loop: the outside collectors
(shared with ``top --pid``) and py-spy, whose status is probed first."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Optional


class Session:
    """The collectors of one attach, sampled from the main loop: the outside collectors
    (:class:`kvdiag.collectors.outside.OutsideCollectors`, shared with ``top --pid``) and py-spy."""

    def __init__(self, args, procs, writer) -> None:
        from kvdiag.collectors.outside import OutsideCollectors, OutsideOptions
        self.args, self.procs, self.writer = args, procs, writer
        self.outside = OutsideCollectors(procs, writer, OutsideOptions.from_args(
            args, kv_events_raw=Path(str(args.out_path) + ".kvevents.jsonl")))
        self.recorder = None
        self.pyspy_failed: Optional[str] = None

    def sample(self) -> None:
        self.outside.sample()  # raises TargetGone

    def pyspy_tick(self, remaining_s: float) -> None:
        from kvdiag.collectors import pyspy
        if self.args.no_pyspy or self.pyspy_failed:
            return
        if self.recorder is not None and self.recorder.done():
            self._finish_window(self.recorder.result)
        if self.recorder is None and remaining_s >= 1.0:
            window = min(self.args.pyspy_window, remaining_s)
            try:
                self.recorder = pyspy.PySpyRecorder(self.args.pid, window, rate_hz=self.args.pyspy_rate,
                                                    exclude_pids=self.procs.excluded_pids())
            except (pyspy.PySpyError, OSError) as exc:  # not installed, or not executable
                self._pyspy_unavailable(str(exc))

    def _finish_window(self, get) -> None:
        from kvdiag.collectors import pyspy
        try:
            raw = get()
            if raw.stacks:
                self.writer.record(pyspy.phase_profile(raw))
        except pyspy.PySpyError as exc:
            self._pyspy_unavailable(str(exc))
        self.recorder = None

    def _pyspy_unavailable(self, message: str) -> None:
        """Phases become N/A for the rest of the session; the reason is recorded once."""
        from kvdiag.collectors import pyspy
        from kvdiag.events.schema import CollectorError
        self.pyspy_failed = message
        self.writer.record(CollectorError(ts_ns=time.time_ns(), collector=pyspy.NAME, message=message))

    def close(self) -> None:
        if self.recorder is not None:
            self._finish_window(self.recorder.stop)
        self.outside.close()


PYSPY_PROBES = 3


def check_pyspy(pid: int, writer) -> Optional[str]:
    """Record py-spy's status; returns a fatal message (no permission) or None."""
    from kvdiag.collectors import pyspy
    from kvdiag.events.schema import CollectorStatus
    st = pyspy.status()
    if not st.available:
        writer.record(st)
        return None
    # a non-blocking dump reads the target's memory while it runs and can catch it mid-update
    # (py-spy then fails to copy an object): only a dump that fails every time, or for want of
    # permission, makes the phases N/A
    for attempt in range(PYSPY_PROBES):
        try:
            pyspy.dump(pid)
            break
        except (pyspy.PySpyError, subprocess.TimeoutExpired) as exc:
            msg = str(exc)
            if "may not read" in msg or attempt == PYSPY_PROBES - 1:
                writer.record(CollectorStatus(ts_ns=time.time_ns(), collector=pyspy.NAME, available=False,
                                              hint=msg))
                return msg if "may not read" in msg else None
    writer.record(CollectorStatus(ts_ns=time.time_ns(), collector=pyspy.NAME, available=True,
                                  hint="non-blocking sampling"))
    return None
