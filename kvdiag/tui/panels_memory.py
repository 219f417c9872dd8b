"""The memory panels of ``kvdiag top``: memory by source (GPU, allocator, KV pool, host), and the
KV pool's occupancy, fragmentation and evictions."""

from __future__ import annotations


from rich.text import Text

from kvdiag.diagnosis.rules import FRAGMENTATION_LIMIT, within_fragmentation_limit
from kvdiag.live.snapshot import Snapshot
from kvdiag.tui.render import NA, fmt_bytes, fmt_num, fmt_pct, line
from kvdiag.tui.panel_base import BAD, DIM, GOOD, WARN, Panel, reason, spark


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
            rows.append(spark(f"{'GPU used':<9}{fmt_bytes(m.nvml_used_bytes):>6}/{fmt_bytes(m.nvml_total_bytes):<6} ",
                               m.nvml_history, width, "cyan", lo=0, hi=m.nvml_total_bytes))
        if m.allocator_reserved_bytes is not None:
            rows.append(spark(f"{'alloc':<9}{fmt_bytes(m.allocator_allocated_bytes):>6}/"
                               f"{fmt_bytes(m.allocator_reserved_bytes):<6} ", m.allocator_history, width, "cyan", lo=0))
        elif m.nvml_used_bytes is not None:
            rows.append(line(f"{'alloc':<9}{NA:>6} ", (m.allocator_hint, DIM)))
        if m.kv_pool_total_bytes is not None:
            rows.append(spark(f"{'KV pool':<9}{fmt_bytes(m.kv_pool_used_bytes):>6}/{fmt_bytes(m.kv_pool_total_bytes):<6} ",
                               m.kv_pool_history, width, "magenta", lo=0, hi=m.kv_pool_total_bytes))
        else:
            rows.append(line(f"{'KV pool':<9}{NA:>6} ", ("no KV pool info", DIM)))
        if m.host_rss_bytes is not None:
            rows.append(spark(f"{'host RSS':<9}{fmt_bytes(m.host_rss_bytes):>6}{'':8}", m.rss_history, width, "green",
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
            rows += reason(f"GPU: {m.gpu_hint}; allocator: {m.allocator_hint}", width)
        return rows


class PoolPanel(Panel):
    TITLE = "KV pool"
    VIEW = "pool"

    def body(self, snap: Snapshot, width: int, height: int) -> list[Text]:
        p = snap.pool
        if p.reason:
            return reason(p.reason, width)
        frag_style = GOOD if within_fragmentation_limit(p.pool_fragmentation or 0) else BAD
        afrag_style = GOOD if within_fragmentation_limit(p.allocator_fragmentation or 0) else BAD
        used = f"{p.blocks_used}/{p.num_blocks if p.num_blocks else '?'}"
        rule = lambda f: "✓" if within_fragmentation_limit(f) else "✗"  # noqa: E731
        rows = [
            spark(f"blocks  {used:>8} {fmt_pct(p.block_occupancy, 0):>4} ", p.occupancy_history, width,
                   "magenta", lo=0, hi=1),
            line((f"from {p.source}", DIM)) if p.source else
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
