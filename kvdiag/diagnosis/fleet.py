"""Fleet-wide tables with DuckDB: one SQL definition, over Parquet datasets or loaded logs.

A :class:`FleetSource` is a DuckDB connection with one view per event type (``kv_pool_sample``,
``request_finished``, ...; every view has a ``node`` column) and ``headers`` (node,
block_size_tokens). :func:`from_datasets` makes the views straight over the Parquet files of
``kvdiag export`` datasets (nothing is loaded into Python); :func:`from_logs` registers the
frames of logs read by kvdiag's reader (the JSONL path). The tables are the same queries over
either, so both paths give the same figures.

Measures, per node and for the whole fleet:
- ``events``: events recorded;
- ``kv_pressure_pct``: peak of blocks_used / num_blocks over the KV pool samples;
- ``kv_fragmentation_pct``: empty token slots / token slots of the blocks held by live
  requests, summed over the pool samples (the doctor's ``fragmentation.kv_pool``; samples
  holding more tokens than slots are left out, as there);
- ``engine_hit_rate_pct``: cached / prompt tokens of finished requests;
- ``ttft_p50_ms``, ``ttft_p99_ms``: TTFT quantiles of finished requests (linear
  interpolation, as numpy's default).
A node without the events behind a column has null there. Nodes are sorted worst first
(highest KV pressure, then highest TTFT P99).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

from kvdiag.pool.hit_rate import COUNTED_STATUS

COLUMNS = ["node", "events", "kv_pressure_pct", "kv_fragmentation_pct", "engine_hit_rate_pct",
           "ttft_p50_ms", "ttft_p99_ms"]
FLEET = "(fleet)"
"""The node name of the totals row."""
TABLES = ("kv_pool_sample", "kv_pool_info", "request_finished")
"""The event types the tables read (besides the events count)."""
OCCUPANCY_POINTS = 200
"""Time buckets of the occupancy-over-time chart, whatever the span."""


@dataclass
class FleetSource:
    """A DuckDB connection with the views the queries read; ``tables``: the event types
    present. The view ``all_events`` holds every event's (node, ts_ns)."""

    con: object
    tables: set[str]


def _scan(files: list[str]) -> str:
    globs = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    return (f"read_parquet([{globs}], hive_partitioning=true, union_by_name=true, "
            f"hive_types={{'type': VARCHAR, 'node': VARCHAR}})")


def from_datasets(roots: Iterable[str | os.PathLike], names: Optional[dict] = None) -> FleetSource:
    """Views over the Parquet files of ``roots``. ``names`` maps ``(dataset, node)`` to the
    node's name in a merged view (repeated names renamed as ``diagnosis.frames.merge`` does);
    by default the datasets' own names."""
    import duckdb

    from kvdiag.events.dataset import event_files, read_headers

    con = duckdb.connect()
    roots = [Path(r) for r in roots]
    mapping, headers = [], []
    for i, root in enumerate(roots):
        h = read_headers(root)
        for node, bs in zip(h["node"], h["block_size_tokens"]):
            merged = (names or {}).get((str(root), node), node)
            mapping.append({"ds": i, "node": node, "merged": merged})
            headers.append({"node": merged, "block_size_tokens": bs})
    con.register("node_names", pd.DataFrame(mapping, columns=["ds", "node", "merged"]))
    con.register("headers", pd.DataFrame(headers, columns=["node", "block_size_tokens"]))

    renamed = {m["ds"] for m in mapping if m["node"] != m["merged"]}

    def view(name: str, globs: list[tuple[int, str]]) -> None:
        parts = [f"SELECT e.* EXCLUDE (ds) REPLACE (n.merged AS node) FROM (SELECT *, {i} AS ds FROM {_scan([g])}) e "
                 f"JOIN node_names n ON n.ds = e.ds AND n.node = e.node" if i in renamed
                 else f"SELECT * FROM {_scan([g])}" for i, g in globs]
        con.execute(f"CREATE VIEW {name} AS " + " UNION ALL BY NAME ".join(parts))

    tables = set()
    for tag in TABLES:
        globs = [(i, g) for i, root in enumerate(roots) if (g := event_files(root, tag))]
        if globs:
            view(tag, globs)
            tables.add(tag)
    view("all_events", [(i, str(root / "type=*" / "node=*" / "*.parquet")) for i, root in enumerate(roots)])
    return FleetSource(con, tables)


def from_logs(logs) -> FleetSource:
    """Views over the frames of logs already read (``diagnosis.frames.Logs``)."""
    import duckdb

    con = duckdb.connect()
    con.register("headers", pd.DataFrame(
        [{"node": n, "block_size_tokens": h.block_size_tokens} for n, h in logs.headers.items()],
        columns=["node", "block_size_tokens"]))
    tables = set()
    for tag in TABLES:
        df = logs.frame(tag)
        if len(df):
            con.register(tag, df)
            tables.add(tag)
    times = [logs.frame(tag)[["node", "ts_ns"]] for tag in logs.frames if len(logs.frame(tag))]
    con.register("all_events", pd.concat(times, ignore_index=True) if times
                 else pd.DataFrame({"node": pd.Series(dtype=str), "ts_ns": pd.Series(dtype="int64")}))
    return FleetSource(con, tables)


def _query(src: FleetSource) -> str:
    """Every measure as (node, k, v) rows, per node and for the fleet (node NULL) in one pass
    (grouping sets)."""
    per = "GROUP BY GROUPING SETS ((node), ())"
    parts = [f"SELECT node, 'events' AS k, count(*)::DOUBLE AS v FROM all_events {per}"]
    if "kv_pool_sample" in src.tables:
        parts.append(f"SELECT node, 'kv_pressure_pct', 100 * max(blocks_used::DOUBLE / num_blocks) "
                     f"FROM kv_pool_sample WHERE num_blocks > 0 {per}")
        info = ("(SELECT node, arg_max(block_size_tokens, ts_ns) AS bs FROM kv_pool_info GROUP BY node)"
                if "kv_pool_info" in src.tables else "(SELECT NULL::VARCHAR AS node, NULL::BIGINT AS bs)")
        slots = "(s.blocks_used * b.bs)"
        parts.append(
            f"SELECT node, 'kv_fragmentation_pct', 100 * sum({slots} - s.tokens_held)::DOUBLE / sum({slots}) "
            f"FROM kv_pool_sample s JOIN (SELECT h.node, coalesce(i.bs, h.block_size_tokens) AS bs "
            f"FROM headers h LEFT JOIN {info} i USING (node)) b USING (node) "
            f"WHERE b.bs > 0 AND s.blocks_used > 0 AND s.tokens_held <= {slots} {per}")
    if "request_finished" in src.tables:
        fin = f"FROM request_finished WHERE status = '{COUNTED_STATUS}'"  # kvdiag.pool.hit_rate's filter
        parts.append(f"SELECT node, 'engine_hit_rate_pct', 100 * sum(cached_prompt_tokens)::DOUBLE "
                     f"/ nullif(sum(prompt_tokens), 0) {fin} {per}")
        for q in (50, 99):
            parts.append(f"SELECT node, 'ttft_p{q}_ms', quantile_cont(ttft_ns, {q / 100}) / 1e6 "
                         f"{fin} AND ttft_ns IS NOT NULL {per}")
    return "\nUNION ALL\n".join(parts)


def tables(src: FleetSource) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per node, worst first; one row ``(fleet)``: the measures over all nodes
    together: the peak pressure of any node, fragmentation, hit rate and TTFT over all their
    samples and requests)."""
    long = src.con.sql(_query(src)).df()
    long["node"] = long["node"].fillna(FLEET)  # the empty grouping set: the whole fleet
    wide = long.pivot(index="node", columns="k", values="v").reset_index().reindex(columns=COLUMNS)
    wide["events"] = wide["events"].fillna(0).astype("int64")
    wide.columns.name = None
    fleet = wide["node"] == FLEET
    nodes = wide[~fleet].sort_values(["kv_pressure_pct", "ttft_p99_ms", "node"], ascending=[False, False, True],
                                     na_position="last", ignore_index=True)
    total = wide[fleet].reset_index(drop=True)
    return nodes, total if len(total) else pd.DataFrame([{"node": FLEET, "events": 0}], columns=COLUMNS)


def nodes_table(src: FleetSource) -> pd.DataFrame:
    """One row per node, worst first."""
    return tables(src)[0]


def totals(src: FleetSource) -> pd.DataFrame:
    """One row, node ``(fleet)``: the measures over all nodes together."""
    return tables(src)[1]


def occupancy_over_time(src: FleetSource, points: int = OCCUPANCY_POINTS) -> pd.DataFrame:
    """Mean block occupancy (blocks_used / num_blocks) per node in ``points`` time buckets:
    columns ``t_s`` (bucket start, seconds from the first sample), ``node``, ``occupancy``."""
    if "kv_pool_sample" not in src.tables:
        return pd.DataFrame(columns=["t_s", "node", "occupancy"])
    return src.con.sql(
        f"WITH s AS (SELECT node, ts_ns, blocks_used::DOUBLE / num_blocks AS occ FROM kv_pool_sample "
        f"WHERE num_blocks > 0), r AS (SELECT min(ts_ns) AS t0, greatest(max(ts_ns) - min(ts_ns), 1) AS span FROM s) "
        f"SELECT ((s.ts_ns - r.t0) // ceil(r.span / {points})::BIGINT) * ceil(r.span / {points}) / 1e9 AS t_s, "
        f"node, avg(occ) AS occupancy FROM s, r GROUP BY ALL ORDER BY node, t_s").df()


def fleet_table(datasets: Iterable[str | os.PathLike], names: Optional[dict] = None) -> pd.DataFrame:
    """The per-node table of one or more datasets, worst first (see :func:`from_datasets`)."""
    return nodes_table(from_datasets(datasets, names))


def dataset_names(paths: Iterable[str | os.PathLike], node_order: list[str]) -> tuple[list[str], dict]:
    """The datasets among ``paths`` (the inputs of ``logs.load``, in order) and the map from
    ``(dataset, node)`` to the node's name in the merged logs whose nodes are ``node_order``."""
    from kvdiag.events.dataset import read_headers

    names, datasets, i = {}, [], 0
    for p in paths:
        if not Path(p).is_dir():
            i += 1  # a log: one node
            continue
        datasets.append(p)
        for node in read_headers(p)["node"]:
            names[(str(p), node)] = node_order[i]
            i += 1
    return datasets, names


def fleet_for(paths: Iterable[str | os.PathLike], node_order: list[str]) -> pd.DataFrame | None:
    """The per-node table of the datasets among ``paths``, named as in the merged logs whose
    nodes are ``node_order``; None without one."""
    datasets, names = dataset_names(paths, node_order)
    return fleet_table(datasets, names) if datasets else None
