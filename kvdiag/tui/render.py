"""Text formatting for the panels: numbers with units, sparklines, bars, heatmap cells."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from rich.style import Style
from rich.text import Text

from kvdiag.events.units import format_bytes

NA = "N/A"
SPARKS = "▁▂▃▄▅▆▇█"
SHADES = " ░▒▓█"


def fmt_bytes(n: Optional[float]) -> str:
    """Binary units, 3 significant digits: 1.23G, 456M, 12.0K (:func:`kvdiag.events.units.format_bytes`)."""
    return format_bytes(n, compact=True)


def fmt_pct(x: Optional[float], digits: int = 1) -> str:
    return NA if x is None else f"{x * 100:.{digits}f}%"


def fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return NA
    if x >= 10_000:
        return f"{x / 1000:.1f}s"
    return f"{x:.0f}ms" if x >= 10 else f"{x:.1f}ms"


def fmt_num(x: Optional[float], fmt: str = "{:.1f}") -> str:
    return NA if x is None else fmt.format(x)


def sparkline(history: Sequence[Optional[float]], width: int, lo: Optional[float] = None,
              hi: Optional[float] = None) -> str:
    """The last ``width`` values as ▁..█ scaled between lo (default min) and hi (default max);
    an empty bin is a space."""
    if width <= 0:
        return ""
    values = list(history)[-width:]
    seen = [v for v in values if v is not None and not math.isnan(v)]
    if not seen:
        return " " * len(values)
    lo = min(seen) if lo is None else lo
    hi = max(seen) if hi is None else hi
    span = hi - lo
    out = []
    for v in values:
        if v is None or math.isnan(v):
            out.append(" ")
        elif span <= 0:
            out.append(SPARKS[len(SPARKS) // 2] if v else SPARKS[0])
        else:
            frac = min(1.0, max(0.0, (v - lo) / span))
            out.append(SPARKS[min(len(SPARKS) - 1, int(frac * len(SPARKS)))])
    return "".join(out)


def markers(history_len: int, flagged: Sequence[int], width: int) -> str:
    """A line aligned under a sparkline of ``width`` with ▲ at the flagged bins."""
    shown = min(width, history_len)
    offset = history_len - shown
    cells = [" "] * shown
    for i in flagged:
        if offset <= i < history_len:
            cells[i - offset] = "▲"
    return "".join(cells)


def bar(frac: Optional[float], width: int) -> str:
    if frac is None or width <= 0:
        return ""
    full = min(width, max(0, round(frac * width)))
    return "█" * full + "·" * (width - full)


def heat_char(frac: Optional[float]) -> str:
    """░▒▓█ by value (readable without colour); · when missing."""
    if frac is None:
        return "·"
    return SHADES[1 + min(3, max(0, int(frac * 4)))]


def heat_style(frac: Optional[float]) -> Style:
    """Colour from dark blue (0) through green/yellow to red (1); grey when missing."""
    if frac is None:
        return Style(color="grey35")
    frac = min(1.0, max(0.0, frac))
    stops = [(0.0, (20, 30, 90)), (0.4, (30, 140, 90)), (0.7, (220, 200, 40)), (1.0, (210, 40, 30))]
    for (a, ca), (b, cb) in zip(stops, stops[1:]):
        if frac <= b:
            t = (frac - a) / (b - a) if b > a else 0.0
            rgb = tuple(round(x + (y - x) * t) for x, y in zip(ca, cb))
            return Style(color=f"rgb({rgb[0]},{rgb[1]},{rgb[2]})")
    return Style(color="rgb(210,40,30)")


def line(*parts: tuple[str, str] | str) -> Text:
    """A Text from plain strings and (text, style) pairs."""
    text = Text(no_wrap=True, overflow="ellipsis")
    for part in parts:
        if isinstance(part, tuple):
            text.append(part[0], style=part[1])
        else:
            text.append(part)
    return text
