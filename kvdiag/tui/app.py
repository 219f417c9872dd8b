"""The Textual app behind ``kvdiag top``.

A thread worker polls the event source, folds events into a :class:`LiveState` and posts one
immutable snapshot per interval; widgets render only from the latest snapshot. Quitting never
touches the target: stopping a demo child the app started is the caller's job.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Footer, Static
from textual.worker import get_current_worker

from kvdiag.live.rules import LiveRules
from kvdiag.paths import open_private
from kvdiag.live.state import LiveState
from kvdiag.live.snapshot import Snapshot
from kvdiag.tui.panel_base import Panel
from kvdiag.tui.panels import PANELS
from kvdiag.tui.panels_requests import RequestsPanel

CHUNK_EVENTS = 20_000
COMPACT_WIDTH = 110
COMPACT_HEIGHT = 30

HELP = """\
[b]kvdiag top[/b] — keys

  q          quit (an attached server keeps running; a demo started by top is stopped)
  p          pause / resume (a replayed log stops; a live view freezes)
  f / F      seek forward 10 s / 60 s (log replay); end: to the end of the log
  tab, ←/→   move focus between panels (shift+tab backwards)
  ↑/↓        move focus; in Requests, move the selection
  enter      details of the focused panel (the selected request in Requests)
  m          Locality: cycle recent / sink / entropy / share
  s          save a screenshot (SVG)
  r          start / stop recording the event stream to a log
  ?          this help          escape: close a window
"""


class SnapshotReady(Message):
    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot


class SnapshotFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class TextScreen(ModalScreen):
    """A scrollable text window (help, details); escape, enter or q closes it."""

    BINDINGS = [Binding("escape,enter,q", "dismiss", "close")]
    DEFAULT_CSS = """
    TextScreen { align: center middle; }
    TextScreen > VerticalScroll { width: 90%; height: 90%; border: round $accent; padding: 0 1;
                                  background: $surface; }
    """

    def __init__(self, title: str, body: Text | str) -> None:
        super().__init__()
        self.title_text = title
        self.body = body

    def compose(self) -> ComposeResult:
        scroll = VerticalScroll()
        scroll.border_title = self.title_text
        with scroll:
            yield Static(self.body, id="text")

    def action_dismiss(self) -> None:
        self.dismiss()


class KvTopApp(App):
    """``kvdiag top``: one source, one state, one snapshot per interval."""

    TITLE = "kvdiag top"
    CSS = """
    Screen { layout: vertical; }
    #status { height: 1; background: $primary-darken-3; color: $text; padding: 0 1; }
    #grid { layout: grid; grid-size: 3 3; grid-columns: 1fr 1fr 1fr; grid-rows: 1fr 1fr 1fr; height: 1fr; }
    #requestspanel { column-span: 2; }
    .compact #grid { grid-size: 2 4; grid-rows: 1fr 1fr 1fr 1fr; grid-columns: 1fr 1fr; }
    .compact #requestspanel { column-span: 1; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("p", "toggle_pause", "pause"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("enter", "detail", "detail"),
        Binding("s", "screenshot", "screenshot"),
        Binding("r", "toggle_record", "record"),
        Binding("f", "seek(10)", "+10s"),
        Binding("F", "seek(60)", "+60s", show=False),
        Binding("end", "seek(1e12)", "end of log", show=False),
        Binding("left,up", "app.focus_previous", "focus", show=False),
        Binding("right,down", "app.focus_next", "focus", show=False),
    ]

    def __init__(self, source, state: Optional[LiveState] = None, interval_s: float = 1.0,
                 output_dir: str | Path = ".", wall_clock=time.time) -> None:
        super().__init__()
        self.source = source
        self.state = state or LiveState(source=source.description)
        if source.header is not None:
            self.state.set_header(source.header)
        self.interval_s = interval_s
        self.doctor = LiveRules()
        self.rule_runs = 0  # runs of the rules over the events so far
        self._doctor_lock = threading.Lock()
        self.output_dir = Path(output_dir)
        self.snapshot: Optional[Snapshot] = None
        self.snapshots_built = 0
        self.error = ""
        self.recorder = None
        self.record_path: Optional[Path] = None
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.status_line = Static(id="status")
        self.panels: list[Panel] = [cls(id=cls.__name__.lower()) for cls in PANELS]

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield self.status_line
        with Container(id="grid"):
            yield from self.panels
        yield Footer()

    def on_mount(self) -> None:
        self._fit(self.size.width, self.size.height)
        self.panels[0].focus()
        self.build_snapshots()

    def on_resize(self, event) -> None:
        self._fit(event.size.width, event.size.height)

    def _fit(self, width: int, height: int) -> None:
        self.screen.set_class(width < COMPACT_WIDTH or height < COMPACT_HEIGHT, "compact")

    # ------------------------------------------------------------------ worker

    @work(thread=True, exclusive=True, group="snapshots")
    def build_snapshots(self) -> None:
        worker = get_current_worker()
        while not worker.is_cancelled:
            start = time.monotonic()
            self.tick()
            self._wake.wait(max(0.0, self.interval_s - (time.monotonic() - start)))
            self._wake.clear()

    def tick(self, force: bool = False) -> None:
        """Poll the source, fold its events, post a snapshot (unless paused). Events are taken
        in chunks so that a long seek never holds the lock (and the keys) for long."""
        try:
            while True:
                with self._lock:
                    events = self.source.poll(CHUNK_EVENTS)
                    if self.source.header is not None and self.state.header is None:
                        self.state.set_header(self.source.header)
                    self.state.source = self.source.description  # an outside source names what it found
                    if self.recorder is not None:
                        for ev in events:
                            self.recorder.record(ev)
                    self.doctor.fold(self.state, events)
                if len(events) < CHUNK_EVENTS:
                    break
            with self._lock:
                if self.source.paused and self.snapshot is not None and not force:
                    return
                snap = self._snapshot()
        except Exception as exc:  # shown in the status line; the next tick tries again
            self.post_message(SnapshotFailed(f"{type(exc).__name__}: {exc}"))
            return
        self.post_message(SnapshotReady(snap))
        if self.doctor.due(self.source.finished) and self._doctor_lock.acquire(blocking=False):
            try:
                self._run_doctor()
            finally:
                self._doctor_lock.release()
            with self._lock:  # the new verdicts now, not a refresh interval later
                snap = self._snapshot()
            self.post_message(SnapshotReady(snap))

    def _snapshot(self) -> Snapshot:
        """The state as of the source's position (call under the lock)."""
        return self.state.snapshot(self.source.now_ns(), paused=self.source.paused,
                                   finished_source=self.source.finished)

    def _run_doctor(self) -> None:
        """The rules over the events so far, outside the lock (their findings show from the
        next snapshot on; at the end of a log, the doctor's verdict on that log)."""
        with self._lock:
            inputs, header = self.doctor.take(self.state), self.state.header
        findings = self.doctor.run(header, inputs)
        with self._lock:
            self.state.rule_findings = findings
            self.rule_runs += 1

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        self.snapshot = message.snapshot
        self.snapshots_built += 1
        self.error = ""
        for panel in self.panels:
            panel.show(message.snapshot)
        self._status()

    def on_snapshot_failed(self, message: SnapshotFailed) -> None:
        self.error = message.error
        self._status()

    def _status(self) -> None:
        snap = self.snapshot
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("kvdiag top ", style="bold")
        if snap is not None and snap.paused:
            text.append("PAUSED ", style="bold black on yellow")
        if snap is not None and snap.finished_source:
            text.append("END OF LOG ", style="bold")
        if self.recorder is not None:
            text.append(f"● REC {self.record_path.name} ", style="bold red")
        if self.error:
            text.append(f"snapshot error: {self.error} ", style="bold red")
        if snap is not None:
            at = datetime.fromtimestamp(snap.now_ns / 1e9, tz=timezone.utc).strftime("%H:%M:%S")
            text.append(f"{snap.source} │ {at} UTC +{(snap.now_ns - snap.start_ns) / 1e9:.0f}s │ "
                        f"{snap.events} ev {snap.events_per_s:.0f}/s │ {snap.engine or 'engine ?'} {snap.model}")
        self.status_line.update(text)

    # ------------------------------------------------------------------ actions

    def action_toggle_pause(self) -> None:
        with self._lock:
            if self.source.paused:
                self.source.resume()
            else:
                self.source.pause()
        self._force_tick()

    def action_seek(self, seconds: float) -> None:
        with self._lock:
            self.source.seek(seconds)
        self._force_tick()

    def _force_tick(self) -> None:
        self.run_worker(lambda: self.tick(force=True), thread=True, group="force")

    def action_help(self) -> None:
        self.push_screen(TextScreen("help", Text.from_markup(HELP)))

    def action_detail(self) -> None:
        panel = self.focused
        if not isinstance(panel, Panel) or self.snapshot is None:
            return
        title = panel.border_title or ""
        if isinstance(panel, RequestsPanel) and panel.selected() is not None:
            title = f"request {panel.selected().request_id}"
        self.push_screen(TextScreen(title, panel.detail(self.snapshot)))

    def action_screenshot(self) -> None:
        path = self._fresh_name("svg")
        with open_private(path, "w", encoding="utf-8") as f:  # 0600, folders 0700
            f.write(self.export_screenshot())
        self.notify(f"screenshot saved: {path}")

    def action_toggle_record(self) -> None:
        from kvdiag.events.eventlog import make_header
        from kvdiag.events.log_writer import LogWriter

        with self._lock:
            if self.recorder is not None:
                self.recorder.close()
                self.notify(f"recording stopped: {self.record_path}")
                self.recorder = None
            else:
                self.record_path = self._fresh_name("jsonl")
                header = self.source.header or make_header(engine="top-recording")
                self.recorder = LogWriter(self.record_path, header)
                self.notify(f"recording to {self.record_path}")
        self._status()

    def _fresh_name(self, suffix: str) -> Path:
        """kvdiag-top-<UTC time>[-n].<suffix> in the output folder, never an existing file."""
        stamp = datetime.fromtimestamp(self._wall_clock(), tz=timezone.utc).strftime("%Y%m%d-%H%M%S")
        path, n = self.output_dir / f"kvdiag-top-{stamp}.{suffix}", 1
        while path.exists():
            n += 1
            path = self.output_dir / f"kvdiag-top-{stamp}-{n}.{suffix}"
        return path

    def on_unmount(self) -> None:
        self._wake.set()
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
