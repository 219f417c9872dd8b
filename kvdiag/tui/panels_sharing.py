"""The prefix-sharing panel of ``kvdiag top``: the engine's hit rate beside the shadow caches',
why prompt tokens missed, and hit rate vs capacity."""

from __future__ import annotations

import time
from typing import Optional

from rich.text import Text

from kvdiag.live.snapshot import Snapshot
from kvdiag.tui.render import NA, bar, fmt_pct, line
from kvdiag.tui.panel_base import DIM, GOOD, WARN, Panel, join_lines, reason, spark


class SharingPanel(Panel):
    TITLE = "Prefix sharing"
    VIEW = "sharing"

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        sh = snap.sharing
        rows = [spark(f"engine hit {fmt_pct(sh.engine_hit_rate):>6} ", sh.engine_history, width, "cyan", lo=0, hi=1)]
        if sh.engine_counters_since_ns is not None:  # the engine's counters, since the join
            since = time.strftime("%H:%M:%S", time.localtime(sh.engine_counters_since_ns / 1e9))
            rows.append(line((f"engine /metrics counters since join {since}", DIM)))
        if sh.reason:
            rows += reason(sh.reason, width)
            rows.append(line((f"finished requests {sh.finished_requests}", DIM)))
            return rows
        gap_style = WARN if sh.gap_status == "warn" else DIM if sh.gap_status.startswith("n/a") else GOOD
        cfg = sh.shadow_config
        rows.append(spark(f"shadow hit {fmt_pct(sh.shadow_hit_rate):>6} ", sh.shadow_history, width, "magenta",
                           lo=0, hi=1))
        gap = f"{sh.gap * 100:+5.1f} pts" if sh.gap is not None else NA
        if sh.gap is not None and sh.unexplained_gap is not None and sh.unexplained_gap != sh.gap:
            gap += f", {sh.unexplained_gap * 100:+.1f} unexplained"  # the rest: the engine's evictions
        rows.append(line("gap        ", (gap, gap_style),
                         (f"  {cfg.policy} bs{cfg.block_size_tokens} cap {_cap(cfg.capacity_blocks)}", DIM)))
        if sh.window_start_ns is not None and height >= 4:  # both rates over the same requests
            since = time.strftime("%H:%M:%S", time.localtime(sh.window_start_ns / 1e9))
            rows.append(line((f"since {since}: {sh.window_requests} finished requests"
                              + (f", {sh.gap_status.split(':')[0]}" if sh.gap_status.startswith("n/a") else ""), DIM)))
        elif sh.gap_status.startswith("n/a") and height >= 4:
            rows.append(line((sh.gap_status, DIM)))
        if height < 5:
            return rows
        same = [p for p in sh.what_if if p.policy == cfg.policy]
        by_cap = [p for p in same if p.block_size_tokens == cfg.block_size_tokens]
        by_size = [p for p in same if p.capacity_blocks == cfg.capacity_blocks and p is not cfg
                   and p.block_size_tokens != cfg.block_size_tokens]
        rows.append(line((f"what-if {cfg.policy}: token hit", "bold")))
        bar_w = max(4, width - 20)
        for p in (by_cap + by_size)[: max(0, height - 4)]:
            rows.append(line(f"{'bs' + str(p.block_size_tokens):>5} {_cap(p.capacity_blocks):>5} ",
                             (bar(p.token_hit_rate, bar_w), "magenta" if p in by_cap else "cyan"),
                             f" {fmt_pct(p.token_hit_rate, 0):>4}"))
        if len(rows) < height and sh.missed_tokens:  # a spare row: why the misses missed
            rows.append(_misses_line(sh))
        return rows

    def detail(self, snap: Snapshot) -> Text:
        sh = snap.sharing
        rows = self.body(snap, 110, 4)
        if sh.missed_tokens:
            rows.append(_misses_line(sh))
        if sh.what_if:
            rows.append(line(("policy  block  capacity  token hit  block hit  requests", "bold")))
            for p in sh.what_if:
                rows.append(line(f"{p.policy:<7} {p.block_size_tokens:>5}  {_cap(p.capacity_blocks):>8}  "
                                 f"{fmt_pct(p.token_hit_rate):>9}  {fmt_pct(p.block_hit_rate):>9}  {p.requests:>8}"))
        rows += curve_lines(snap)
        return join_lines(rows)


def _misses_line(sh) -> Text:
    """``missed N tok: cause share ...``: the causes of the missed prompt tokens, largest first
    (kvdiag.diagnosis.miss_causes)."""
    parts = sorted(((n, c) for c, n in sh.miss_causes if n), reverse=True)
    causes = "  ".join(f"{c} {n / sh.missed_tokens:.0%}" for n, c in parts)
    return line((f"missed {sh.missed_tokens:,} tok: ", "bold"), (causes, DIM))


def curve_lines(snap: Snapshot) -> list[Text]:
    """The capacity curves (LRU token hit rate at 0.5x..4x the tier's capacity; the fold of
    kvdiag/live/views/curves.py, equal to ``kvdiag replay --curve``), one line per tier."""
    cv = snap.curves
    if cv is None:
        return []
    if not cv.rows:
        return [line((f"capacity curve: {cv.reason}", DIM))]
    rows = [line(("capacity curve (LRU token hit at x capacity)", "bold"))]
    for r in cv.rows:
        if not r.points:
            rows.append(line(f"{r.tier:<10} ", ("no capacity to scale yet", DIM)))
            continue
        pts = "  ".join(f"{p.multiple:g}x {fmt_pct(p.token_hit_rate) if p.token_hit_rate is not None else NA:>6}"
                        for p in r.points)
        rows.append(line(f"{r.tier:<10} {pts}  ",
                         (f"x {r.basis_blocks} blocks ({r.basis}) of {r.block_size_tokens} tokens, "
                          f"{r.requests} {'requests' if r.tier == 'pool' else 'stores'}", DIM)))
    return rows


def _cap(capacity: Optional[int]) -> str:
    return "∞" if capacity is None else str(capacity)
