"""`kvdiag plan`'s rich table: the plan's numbers, then every assumption they rest on."""

from __future__ import annotations

from kvdiag.simulation.capacity_plan import Plan, formula
from kvdiag.events.units import format_bytes


def human_bytes(n: float) -> str:
    """Binary units (KiB, MiB, GiB, TiB) and, above a GB, the decimal figure too."""
    return format_bytes(n, 2, decimal_too=True)


def print_plan(plan: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    s, w = plan.settings, plan.workload
    console.print(f"[bold]KV bytes per token[/]: {formula(plan.model, s.dtype, plan.kv_bytes_per_token)}"
                  f"; a block of {s.block_size_tokens} tokens = {human_bytes(plan.block_bytes)}")
    console.print(f"[bold]workload[/]: {w.requests:,} requests; prompt tokens mean "
                  f"{w.prompt_tokens.mean():,.0f} (max {w.prompt_tokens.max():,}), output tokens "
                  f"mean {w.output_tokens.mean():,.0f} (max {w.output_tokens.max():,})")
    console.print(f"[bold]concurrent sequences[/] (event simulation): peak {plan.sequences.peak:,}, "
                  f"P99 {plan.sequences.quantile(0.99):,}, mean {plan.sequences.mean():,.1f} "
                  f"(Little's law: arrival rate x mean hold time = {plan.littles_law_sequences:,.1f})")
    table = Table(show_edge=False, title="KV memory held by live requests (block-rounded)")
    for col in ("variant", "peak blocks", "peak KV", "P99 KV", "GPUs (peak)", "GPUs (P99)",
                f"servers of {s.gpus_per_server}"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in plan.rows:
        table.add_row(r.variant, f"{r.peak_blocks:,}", human_bytes(r.peak_kv_bytes),
                      human_bytes(r.p99_kv_bytes), f"{r.gpus_needed:,}", f"{r.gpus_needed_p99:,}",
                      f"{r.servers_needed:,.1f}")
    console.print(table)
    for r in plan.rows[1:]:
        console.print(f"{r.variant}: {r.assumption}", markup=False, highlight=False)
    o = plan.overflow
    if o is not None:
        first = "never" if o.first_overflow_s is None else f"first at {o.first_overflow_s:,.1f} s"
        console.print(f"[bold]pool of {o.pool_blocks:,} blocks[/] ({human_bytes(o.pool_blocks * plan.block_bytes)}): "
                      f"demand above it {o.over_s:,.1f} s ({o.over_fraction:.1%} of the time, {first}); "
                      f"{o.requests_affected:,} request(s) live then (preempted, or OOM); headroom "
                      f"needed {max(o.headroom_blocks, 0):,} blocks (demand {plan.pool_demand}); admitting "
                      f"by predicted growth (no sharing) reserves {plan.reserved_peak_blocks:,} blocks "
                      f"at peak (actual peak without sharing {plan.blocks.peak:,})")
    console.print("[bold]assumptions[/]")
    for a in plan.assumptions:
        console.print(f"- {a}", markup=False, highlight=False)
