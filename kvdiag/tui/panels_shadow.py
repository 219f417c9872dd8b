"""The shadow panels of ``kvdiag top``: KV compression per method and attention locality per
layer and head."""

from __future__ import annotations


from rich.text import Text
from textual.binding import Binding

from kvdiag.live.snapshot import LOCALITY_METRICS, Snapshot
from kvdiag.tui.render import NA, fmt_pct, heat_char, heat_style, line
from kvdiag.tui.panel_base import BAD, DIM, GOOD, WARN, Panel, join_lines, reason


class CompressionPanel(Panel):
    TITLE = "Compression"
    VIEW = "compression"

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        c = snap.compression
        if c.reason:
            return reason(c.reason, width)
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
        return join_lines(rows)


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
            return reason(loc.reason, width)
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
        return join_lines(out)


def _groups(n: int, rows: int) -> list[list[int]]:
    """Split heads 0..n-1 into at most ``rows`` contiguous groups."""
    if n <= rows:
        return [[i] for i in range(n)]
    size = -(-n // rows)
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]
