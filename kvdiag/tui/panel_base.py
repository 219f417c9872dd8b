"""What every panel of ``kvdiag top`` shares: the bordered, focusable box that renders only
from the latest :class:`Snapshot`, fitted to its size (``body(snap, width, height)`` returns at
most ``height`` lines, most important first; ``detail(snap)`` is the full view behind
``enter``), its styles, and the helpers that shape its lines."""

from __future__ import annotations

import textwrap
from typing import Optional

from rich.text import Text
from textual.widget import Widget

from kvdiag.live.snapshot import Snapshot
from kvdiag.tui.render import line, sparkline


DIM = "dim"
WARN = "bold yellow"
BAD = "bold red"
GOOD = "green"


class Panel(Widget, can_focus=True):
    """A bordered, focusable box that renders ``body`` of the current snapshot."""

    TITLE = ""
    DEFAULT_CSS = """
    Panel { border: round $primary-darken-2; padding: 0 1; height: 1fr; width: 1fr;
            text-wrap: nowrap; text-overflow: ellipsis; }
    Panel:focus { border: round $accent; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.snapshot: Optional[Snapshot] = None
        self.border_title = self.TITLE

    VIEW = ""  # the Snapshot field this panel renders; unchanged => no repaint

    def show(self, snap: Snapshot) -> None:
        previous, self.snapshot = self.snapshot, snap
        if previous is None or getattr(previous, self.VIEW) != getattr(snap, self.VIEW):
            self.refresh()

    def render(self) -> Text:
        width, height = self.content_size.width, self.content_size.height
        if self.snapshot is None:
            return Text("waiting for the first snapshot…", style=DIM)
        return join_lines(self.body(self.snapshot, max(1, width), max(1, height))[:max(1, height)])

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        raise NotImplementedError

    def detail(self, snap: Snapshot) -> Text:
        return join_lines(self.body(snap, 110, 200))


def join_lines(lines: list[Text]) -> Text:
    """Lines into one Text that never wraps (a panel cuts lines at its edge with …)."""
    out = Text(no_wrap=True, overflow="ellipsis", end="")
    for i, text in enumerate(lines):
        if i:
            out.append("\n")
        out.append_text(text)
    return out


def spark(prefix: str, history, width: int, style: str, lo=None, hi=None) -> Text:
    """``prefix`` then a sparkline filling the rest of the line."""
    return line(prefix, (sparkline(history, max(0, width - len(prefix)), lo=lo, hi=hi), style))


def reason(text: str, width: int) -> list[Text]:
    """Why a panel is empty, wrapped to the panel's width."""
    return [line((chunk, DIM)) for chunk in textwrap.wrap(text, max(10, width))]
