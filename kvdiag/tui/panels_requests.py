"""The panels of ``kvdiag top`` on how requests are served: latency percentiles and the
requests in flight or just finished."""

from __future__ import annotations


from rich.text import Text
from textual.binding import Binding

from kvdiag.live.snapshot import Snapshot
from kvdiag.tui.render import NA, fmt_bytes, fmt_ms, fmt_num, fmt_pct, line
from kvdiag.tui.panel_base import BAD, DIM, GOOD, WARN, Panel, join_lines, reason, spark


class LatencyPanel(Panel):
    TITLE = "Latency"
    VIEW = "latency"

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        lat = snap.latency
        if lat.reason:
            return reason(lat.reason, width)
        rows = [
            spark(f"TTFT p50 {fmt_ms(lat.ttft_p50_ms):>6} p99 {fmt_ms(lat.ttft_p99_ms):>6} ", lat.ttft_p99_history,
                   width, "yellow", lo=0),
            spark(f"TPOT p50 {fmt_ms(lat.tpot_p50_ms):>6} p99 {fmt_ms(lat.tpot_p99_ms):>6} ", lat.tpot_p99_history,
                   width, "yellow", lo=0),
            spark(f"queue p50 {fmt_ms(lat.queue_p50_ms):>5} p99 {fmt_ms(lat.queue_p99_ms):>6} ", lat.queue_p99_history,
                   width, "yellow", lo=0) if not lat.queue_reason else line((f"queue wait n/a: {lat.queue_reason}", DIM)),
            spark(f"tokens/s {fmt_num(lat.tokens_per_s):>6}{'':12}", lat.tokens_history, width, "green", lo=0),
        ]
        if lat.source:
            rows.append(line((f"from {lat.source}", DIM)))
        verdict = lat.p99_verdict
        if verdict is None:
            rows.append(line(("P99 check: waiting for the rules' first run", DIM)))
        else:
            style = {"fail": BAD, "warn": WARN, "pass": GOOD}.get(verdict.status, DIM)
            rows.append(line((f"P99 {verdict.status}: {verdict.message}", style)))
        if lat.kv_read_bytes_per_s is not None:  # the P99 checklist's bandwidth item, below the verdict
            used = "N/A" if lat.kv_bandwidth_utilisation is None else fmt_pct(lat.kv_bandwidth_utilisation, 0)
            nvml = "" if lat.nvml_memory_util_pct is None else f" mem {lat.nvml_memory_util_pct:.0f}%"
            rows.append(spark(f"KV read {lat.kv_read_bytes_per_s / 1e9:6.2f} GB/s {used:>4}{nvml} ",
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
            return reason(req.reason, width)
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
        return join_lines(line((f"{k:<18}", "bold"), str(v)) for k, v in fields)
