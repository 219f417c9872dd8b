"""`kvdiag report --fleet`: the fleet at a glance, every figure computed by DuckDB.

No event is loaded into Python for Parquet datasets: the tables and the chart are the queries
of :mod:`kvdiag.diagnosis.fleet` over the files, so a fleet-day of logs reports in seconds
and in bounded memory. The per-node sections of the full report (findings, memory, sharing,
latency ...) need every event of a node: run ``kvdiag report`` on that node's log for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from kvdiag.diagnosis import fleet
from kvdiag.reports.document import Absent, Chart, Report, Section, Table, Text

NOTE = ("KV pressure: peak blocks used / pool blocks; fragmentation: empty token slots / token "
        "slots of held blocks over the pool samples (the doctor's fragmentation.kv_pool); hit "
        "rate: cached / prompt tokens of finished requests; TTFT of finished requests")


@dataclass(frozen=True)
class FleetReport:
    """The rendered-to-be report and the node table it shows (for the command's summary)."""

    report: Report
    nodes: pd.DataFrame


def build(src: fleet.FleetSource, title: str, inputs: str) -> FleetReport:
    """The fleet report of ``src``; ``inputs`` says what was read."""
    nodes, total = fleet.tables(src)
    occupancy = fleet.occupancy_over_time(src)
    worst = nodes.iloc[0] if len(nodes) else None
    blocks = [
        Text(f"{len(nodes)} node(s), {int(total['events'].iloc[0]):,} events"
             + (f"; the most pressed node is {worst['node']} (peak KV pressure "
                f"{worst['kv_pressure_pct']:.1f}%)." if worst is not None and worst["kv_pressure_pct"] == worst["kv_pressure_pct"] else ".")),
        Table("Fleet totals (all nodes together)", total.round(2), note=NOTE),
        Table("Nodes, worst first (highest KV pressure, then TTFT P99)", nodes.round(2), note=NOTE),
    ]
    if len(occupancy):
        blocks.append(Chart("KV block occupancy by node (mean per time bucket)", "line", occupancy,
                            x="t_s", y="occupancy", color="node", x_title="seconds from the first sample",
                            y_title="blocks used / pool blocks",
                            table=occupancy.groupby("node")["occupancy"].describe().round(3).reset_index()))
    else:
        blocks.append(Absent("KV pool samples", "the agent records them (kvdiag.run, kvdiag demo)"))
    section = Section("fleet", "Fleet", "Which nodes need attention?", blocks)
    return FleetReport(Report(title, f"fleet report over {inputs} (DuckDB)", [section]), nodes)
