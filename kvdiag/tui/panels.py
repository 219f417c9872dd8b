"""The panels of ``kvdiag top``. Each renders only from the latest :class:`Snapshot`, fitted
to its size: ``body(snap, width, height)`` returns at most ``height`` lines, most important
first; ``detail(snap)`` is the full view behind ``enter``."""

from __future__ import annotations

import textwrap
import time
from typing import Optional

from rich.text import Text
from textual.binding import Binding
from textual.widget import Widget

from kvdiag.diagnosis.rules import FRAGMENTATION_LIMIT, within_fragmentation_limit
from kvdiag.live.snapshot import LOCALITY_METRICS, Snapshot
from kvdiag.tui.render import (
    NA,
    bar,
    fmt_bytes,
    fmt_ms,
    fmt_num,
    fmt_pct,
    heat_char,
    heat_style,
    line,
    sparkline,
)

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
        return _join(self.body(self.snapshot, max(1, width), max(1, height))[:max(1, height)])

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        raise NotImplementedError

    def detail(self, snap: Snapshot) -> Text:
        return _join(self.body(snap, 110, 200))


def _join(lines: list[Text]) -> Text:
    """Lines into one Text that never wraps (a panel cuts lines at its edge with …)."""
    out = Text(no_wrap=True, overflow="ellipsis", end="")
    for i, text in enumerate(lines):
        if i:
            out.append("\n")
        out.append_text(text)
    return out


def _spark(prefix: str, history, width: int, style: str, lo=None, hi=None) -> Text:
    """``prefix`` then a sparkline filling the rest of the line."""
    return line(prefix, (sparkline(history, max(0, width - len(prefix)), lo=lo, hi=hi), style))


def _reason(text: str, width: int) -> list[Text]:
    """Why a panel is empty, wrapped to the panel's width."""
    return [line((chunk, DIM)) for chunk in textwrap.wrap(text, max(10, width))]


class MemoryPanel(Panel):
    TITLE = "Memory"
    VIEW = "memory"

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        m = snap.memory
        rows = []
        no_gpu = m.nvml_used_bytes is None and m.allocator_reserved_bytes is None
        explain = no_gpu and height > 5  # room to say why below; otherwise inline, cut at the edge
        if no_gpu:
            rows.append(line(f"{'GPU':<9}{NA:>6} ", ("" if explain else m.gpu_hint, DIM)))
        if m.nvml_used_bytes is not None:
            rows.append(_spark(f"{'GPU used':<9}{fmt_bytes(m.nvml_used_bytes):>6}/{fmt_bytes(m.nvml_total_bytes):<6} ",
                               m.nvml_history, width, "cyan", lo=0, hi=m.nvml_total_bytes))
        if m.allocator_reserved_bytes is not None:
            rows.append(_spark(f"{'alloc':<9}{fmt_bytes(m.allocator_allocated_bytes):>6}/"
                               f"{fmt_bytes(m.allocator_reserved_bytes):<6} ", m.allocator_history, width, "cyan", lo=0))
        elif m.nvml_used_bytes is not None:
            rows.append(line(f"{'alloc':<9}{NA:>6} ", (m.allocator_hint, DIM)))
        if m.kv_pool_total_bytes is not None:
            rows.append(_spark(f"{'KV pool':<9}{fmt_bytes(m.kv_pool_used_bytes):>6}/{fmt_bytes(m.kv_pool_total_bytes):<6} ",
                               m.kv_pool_history, width, "magenta", lo=0, hi=m.kv_pool_total_bytes))
        else:
            rows.append(line(f"{'KV pool':<9}{NA:>6} ", ("no KV pool info", DIM)))
        if m.host_rss_bytes is not None:
            rows.append(_spark(f"{'host RSS':<9}{fmt_bytes(m.host_rss_bytes):>6}{'':8}", m.rss_history, width, "green",
                               lo=0))
            if m.kv_pool_rss_share is not None:  # CPU: the KV pool is part of the host RSS
                rows.append(line(f"{'KV/RSS':<9}{fmt_pct(m.kv_pool_rss_share):>6} ",
                                 (f"held, pool {fmt_pct(m.kv_pool_total_rss_share, 0)}", DIM)))
            if m.host_pss_bytes is not None or m.host_swap_bytes is not None:
                rows.append(line(f"{'PSS':<9}{fmt_bytes(m.host_pss_bytes):>6} ",
                                 (f"swap {fmt_bytes(m.host_swap_bytes)}", DIM)))
        else:
            rows.append(line(f"{'host RSS':<9}{NA:>6} ", ("no process samples", DIM)))
        if m.nvml_process_bytes is not None:
            rows.append(line(f"{'GPU proc':<9}{fmt_bytes(m.nvml_process_bytes):>6}"))
        if explain:
            rows += _reason(f"GPU: {m.gpu_hint}; allocator: {m.allocator_hint}", width)
        return rows


class PoolPanel(Panel):
    TITLE = "KV pool"
    VIEW = "pool"

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        p = snap.pool
        if p.reason:
            return _reason(p.reason, width)
        frag_style = GOOD if within_fragmentation_limit(p.pool_fragmentation or 0) else BAD
        afrag_style = GOOD if within_fragmentation_limit(p.allocator_fragmentation or 0) else BAD
        used = f"{p.blocks_used}/{p.num_blocks if p.num_blocks else '?'}"
        rule = lambda f: "✓" if within_fragmentation_limit(f) else "✗"  # noqa: E731
        rows = [
            _spark(f"blocks  {used:>8} {fmt_pct(p.block_occupancy, 0):>4} ", p.occupancy_history, width,
                   "magenta", lo=0, hi=1),
            line(f"tokens  {fmt_pct(p.token_occupancy, 0):>8} ",
                 ("bad sample: see alerts", WARN) if p.inconsistency else "of held slots"),
            line("frag    ", (f"{fmt_pct(p.pool_fragmentation):>8}", frag_style),
                 f" {rule(p.pool_fragmentation)} <{FRAGMENTATION_LIMIT:.0%}" if p.pool_fragmentation is not None else ""),
            line(f"cached  {fmt_num(p.blocks_cached, '{:.0f}'):>8} prefix blocks"),
            line(f"evict   {fmt_num(p.evictions_per_s, '{:.2f}'):>8}/s preempt {p.preemptions}"),
            line(f"reqs    {fmt_num(p.running_requests, '{:.0f}'):>8} run {fmt_num(p.waiting_requests, '{:.0f}')} wait"),
            line("alloc   ", (f"{fmt_pct(p.allocator_fragmentation):>8}",
                             afrag_style if p.allocator_fragmentation is not None else DIM), " frag",
                 f" {rule(p.allocator_fragmentation)}" if p.allocator_fragmentation is not None else ""),
        ]
        return rows


class SharingPanel(Panel):
    TITLE = "Prefix sharing"
    VIEW = "sharing"

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        sh = snap.sharing
        rows = [_spark(f"engine hit {fmt_pct(sh.engine_hit_rate):>6} ", sh.engine_history, width, "cyan", lo=0, hi=1)]
        if sh.reason:
            rows += _reason(sh.reason, width)
            rows.append(line((f"finished requests {sh.finished_requests}", DIM)))
            return rows
        gap_style = WARN if sh.gap_status == "warn" else DIM if sh.gap_status.startswith("n/a") else GOOD
        cfg = sh.shadow_config
        rows.append(_spark(f"shadow hit {fmt_pct(sh.shadow_hit_rate):>6} ", sh.shadow_history, width, "magenta",
                           lo=0, hi=1))
        rows.append(line("gap        ", (f"{(sh.gap or 0) * 100:+5.1f} pts" if sh.gap is not None else NA, gap_style),
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
        return rows

    def detail(self, snap: Snapshot) -> Text:
        sh = snap.sharing
        rows = self.body(snap, 110, 4)
        if sh.what_if:
            rows.append(line(("policy  block  capacity  token hit  block hit  requests", "bold")))
            for p in sh.what_if:
                rows.append(line(f"{p.policy:<7} {p.block_size_tokens:>5}  {_cap(p.capacity_blocks):>8}  "
                                 f"{fmt_pct(p.token_hit_rate):>9}  {fmt_pct(p.block_hit_rate):>9}  {p.requests:>8}"))
        return _join(rows)


def _cap(capacity: Optional[int]) -> str:
    return "∞" if capacity is None else str(capacity)


class CompressionPanel(Panel):
    TITLE = "Compression"
    VIEW = "compression"

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        c = snap.compression
        if c.reason:
            return _reason(c.reason, width)
        rows = [line((f"{'layer':<6}{'method':<7}{'ratio':>6}{'err':>6}{'dec':>5} rec", "bold"))]
        styles = {"use": GOOD, "check": WARN, "avoid": BAD}
        for r in c.rows:
            dec = f"{r.decode_us:.0f}µs" if r.decode_us is not None else NA
            err = r.attn_out_error if r.attn_out_error is not None else r.error
            rows.append(line(f"{r.layers:<6}{r.method[:6]:<7}{r.ratio:>5.1f}x{fmt_pct(err):>6}{dec:>5} ",
                             (r.recommendation, styles.get(r.recommendation, ""))))
        return rows

    def detail(self, snap: Snapshot) -> Text:
        c = snap.compression
        if c.reason:
            return Text(c.reason)
        rows = [line(("layers  method      ratio  K/V err  attn-out err  decode   samples  rec", "bold"))]
        for r in c.rows:
            dec = f"{r.decode_us:.1f}µs" if r.decode_us is not None else NA
            rows.append(line(f"{r.layers:<7} {r.method:<10} {r.ratio:>5.2f}x  {fmt_pct(r.error, 2):>7}  "
                             f"{fmt_pct(r.attn_out_error, 2):>12}  {dec:>7}  {r.samples:>7}  {r.recommendation}"))
        rows.append(line(("error = attention-output error when measured, else max K/V error; "
                          "use ≤ 1%, check ≤ 5%, avoid above", DIM)))
        if c.sampling:
            rows.append(line((f"sampling: {c.sampling}", DIM)))
        return _join(rows)


class LocalityPanel(Panel):
    TITLE = "Locality"
    VIEW = "locality"
    BINDINGS = [Binding("m", "next_metric", "metric")]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.metric = LOCALITY_METRICS[0]
        self._retitle()

    def _retitle(self) -> None:
        self.border_title = f"Locality: {self.metric} (m)"

    def action_next_metric(self) -> None:
        i = LOCALITY_METRICS.index(self.metric)
        self.metric = LOCALITY_METRICS[(i + 1) % len(LOCALITY_METRICS)]
        self._retitle()
        self.refresh()

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        loc = snap.locality
        if loc.reason:
            return _reason(loc.reason, width)
        grid = loc.cells[self.metric]  # [layer][head]
        scale = max((v for row in grid for v in row if v is not None), default=1.0) \
            if self.metric == "entropy" else 1.0
        label_w = 6
        layers = min(loc.num_layers, max(1, width - label_w))
        heads = loc.num_heads
        groups = _groups(heads, max(1, height - 1))
        rows = []
        for g in groups:
            label = f"h{g[0]}" if len(g) == 1 else f"h{g[0]}-{g[-1]}"
            text = line(f"{label:<{label_w}}")
            for layer in range(layers):
                vals = [grid[layer][h] for h in g if grid[layer][h] is not None]
                v = sum(vals) / len(vals) if vals else None
                frac = v / scale if v is not None and scale else None
                text.append(heat_char(frac), style=heat_style(frac))
            rows.append(text)
        unit = f"0-{scale:.2f} nats" if self.metric == "entropy" else "0→1"
        rows.append(line((f"layers 0-{layers - 1} → ; {unit}; {loc.samples} samples", DIM)))
        return rows

    def detail(self, snap: Snapshot) -> Text:
        loc = snap.locality
        if loc.reason:
            return Text(loc.reason)
        out = []
        for metric in LOCALITY_METRICS:
            out.append(line((f"{metric} (rows = layers, columns = heads)", "bold")))
            for layer, row in enumerate(loc.cells[metric]):
                out.append(line(f"L{layer:<3}" + " ".join(f"{v:5.2f}" if v is not None else "  N/A" for v in row)))
        return _join(out)


def _groups(n: int, rows: int) -> list[list[int]]:
    """Split heads 0..n-1 into at most ``rows`` contiguous groups."""
    if n <= rows:
        return [[i] for i in range(n)]
    size = -(-n // rows)
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


class LatencyPanel(Panel):
    TITLE = "Latency"
    VIEW = "latency"

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        lat = snap.latency
        if lat.reason:
            return _reason(lat.reason, width)
        rows = [
            _spark(f"TTFT p50 {fmt_ms(lat.ttft_p50_ms):>6} p99 {fmt_ms(lat.ttft_p99_ms):>6} ", lat.ttft_p99_history,
                   width, "yellow", lo=0),
            _spark(f"TPOT p50 {fmt_ms(lat.tpot_p50_ms):>6} p99 {fmt_ms(lat.tpot_p99_ms):>6} ", lat.tpot_p99_history,
                   width, "yellow", lo=0),
            _spark(f"queue p50 {fmt_ms(lat.queue_p50_ms):>5} p99 {fmt_ms(lat.queue_p99_ms):>6} ", lat.queue_p99_history,
                   width, "yellow", lo=0) if not lat.queue_reason else line((f"queue wait n/a: {lat.queue_reason}", DIM)),
            _spark(f"tokens/s {fmt_num(lat.tokens_per_s):>6}{'':12}", lat.tokens_history, width, "green", lo=0),
        ]
        verdict = lat.p99_verdict
        if verdict is None:
            rows.append(line(("P99 check: waiting for the rules' first run", DIM)))
        else:
            style = {"fail": BAD, "warn": WARN, "pass": GOOD}.get(verdict.status, DIM)
            rows.append(line((f"P99 {verdict.status}: {verdict.message}", style)))
        if lat.kv_read_bytes_per_s is not None:  # the P99 checklist's bandwidth item, below the verdict
            used = "N/A" if lat.kv_bandwidth_utilisation is None else fmt_pct(lat.kv_bandwidth_utilisation, 0)
            nvml = "" if lat.nvml_memory_util_pct is None else f" mem {lat.nvml_memory_util_pct:.0f}%"
            rows.append(_spark(f"KV read {lat.kv_read_bytes_per_s / 1e9:6.2f} GB/s {used:>4}{nvml} ",
                               lat.kv_bandwidth_history, width, "cyan", lo=0))
        return rows


class RequestsPanel(Panel):
    TITLE = "Requests (by KV bytes)"
    VIEW = "requests"
    BINDINGS = [Binding("up", "cursor(-1)", "up", show=False), Binding("down", "cursor(1)", "down", show=False)]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cursor = 0

    def action_cursor(self, delta: int) -> None:
        n = len(self.snapshot.requests.rows) if self.snapshot else 0
        self.cursor = max(0, min(n - 1, self.cursor + delta)) if n else 0
        self.refresh()

    def selected(self):
        rows = self.snapshot.requests.rows if self.snapshot else ()
        return rows[min(self.cursor, len(rows) - 1)] if rows else None

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        req = snap.requests
        if req.reason:
            return _reason(req.reason, width)
        wide = width >= 60
        id_w, hit_w = (13, 8) if wide else (11, 6)
        if wide:  # long ids (vLLM's "chatcmpl-<id>-<suffix>") get the room the panel has
            longest = max((len(r.request_id) for r in req.rows), default=0)
            id_w = max(id_w, min(longest + 1, 40, width - 60))
        cols = (f"{'request':<{id_w}}{'KV':>7}{'blk':>4}{'hit tok' if wide else 'hit':>{hit_w}}{'age':>7}"
                + (f"  {'state':<9}{'prompt':>6}{'TTFT':>8}" if wide else ""))
        rows = [line((cols, "bold"), (f"  {req.live} live, {req.finished} done" if wide else "", DIM))]
        visible = max(1, height - 1)
        cursor = min(self.cursor, len(req.rows) - 1)
        start = max(0, cursor - visible + 1)
        for i, r in enumerate(req.rows[start:start + visible], start):
            live = r.state in ("running", "waiting")
            style = "reverse" if i == cursor and self.has_focus else ("" if live else DIM)
            text = (f"{r.request_id[:id_w - 1]:<{id_w}}{fmt_bytes(r.kv_bytes):>7}{r.blocks:>4}{r.hit_tokens:>{hit_w}}"
                    f"{r.age_s:>6.1f}s")
            if wide:
                text += f"  {r.state[:9]:<9}{r.prompt_tokens:>6}{fmt_ms(r.ttft_ms):>8}"
            rows.append(line((text, style)))
        return rows

    def detail(self, snap: Snapshot) -> Text:
        r = self.selected()
        if r is None:
            return Text(snap.requests.reason or "no request selected")
        fields = [("request", r.request_id), ("state", r.state), ("prompt tokens", r.prompt_tokens),
                  ("output tokens", NA if r.output_tokens is None else r.output_tokens),
                  ("KV held", fmt_bytes(r.kv_bytes)), ("blocks held", r.blocks),
                  ("prefix hit tokens", r.hit_tokens), ("prefix hit blocks", r.hit_blocks),
                  ("age", f"{r.age_s:.1f}s"), ("TTFT", fmt_ms(r.ttft_ms)),
                  ("block ids", " ".join(map(str, r.block_ids)) or "none")]
        return _join(line((f"{k:<18}", "bold"), str(v)) for k, v in fields)


class AlertsPanel(Panel):
    TITLE = "Alerts"
    VIEW = "alerts"
    MARKS = {"fail": ("✗", BAD), "warn": ("!", WARN), "n/a": ("·", DIM), "pass": ("✓", GOOD)}

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        """Failures and warnings with their messages, then collector health (why data is
        missing), then the rules that had no data folded into one line, then the passes."""
        if not snap.alerts:
            return _reason("no findings yet", width)
        no_data = [f for f in snap.alerts if f.status == "n/a" and not f.rule.startswith("collector.")]
        shown = [f for f in snap.alerts if f not in no_data]
        two_lines = sum(1 for f in shown if f.status != "pass") * 2 + bool(no_data) <= height
        rows = []
        for f in shown:
            if f.status == "pass" and no_data:
                rows.append(line(("· ", DIM), (f"{len(no_data)} checks without data: "
                                               + ", ".join(g.rule for g in no_data), DIM)))
                no_data = []
            mark, style = self.MARKS[f.status]
            loud = f.status in ("fail", "warn")
            rows.append(line((mark + " ", style), (f.title, "bold" if loud else "")))
            if two_lines or loud:
                rows.append(line("  ", (f.message, "" if loud else DIM)))
        if no_data:
            rows.append(line(("· ", DIM), (f"{len(no_data)} checks without data: "
                                           + ", ".join(g.rule for g in no_data), DIM)))
        return rows

    def detail(self, snap: Snapshot) -> Text:
        rows = []
        for f in snap.alerts:
            mark, style = self.MARKS[f.status]
            rows.append(line((f"{mark} {f.rule}", style), f"  {f.title}"))
            rows.append(line(f"    {f.message}"))
            if f.evidence:
                rows.append(line((f"    evidence: {f.evidence}", DIM)))
        return _join(rows) if rows else Text("no findings yet")


PANELS: tuple[type[Panel], ...] = (MemoryPanel, PoolPanel, LatencyPanel, SharingPanel, CompressionPanel,
                                   LocalityPanel, RequestsPanel, AlertsPanel)
