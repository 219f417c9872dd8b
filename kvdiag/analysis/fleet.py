"""Fleet-wide aggregations with DuckDB, straight over the Parquet files of datasets.

One row per node, worst first: events, KV pressure (peak of blocks_used / num_blocks over
its KVPoolSample rows), the engine's prefix hit rate (cached / prompt tokens of finished
requests) and TTFT P50/P99 of finished requests (linear interpolation, as numpy's default).
A node without the events behind a column has null there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import pandas as pd

COLUMNS = ["node", "events", "kv_pressure_pct", "engine_hit_rate_pct", "ttft_p50_ms",
           "ttft_p99_ms"]


def _scan(files: str) -> str:
    return (f"read_parquet('{files}', hive_partitioning=true, union_by_name=true, "
            f"hive_types={{'type': VARCHAR, 'node': VARCHAR}})")


def _query(root: Path) -> str:
    """The per-node SQL of one dataset (only the event types it has)."""
    from kvdiag.dataset import event_files
    glob = lambda tag: event_files(root, tag).replace("'", "''")  # noqa: E731
    parts = [f"SELECT node, 'events' AS k, count(*)::DOUBLE AS v FROM "
             f"{_scan(str(root / 'type=*' / 'node=*' / '*.parquet').replace(chr(39), chr(39) * 2))} GROUP BY node"]
    if event_files(root, "kv_pool_sample"):
        parts.append(f"SELECT node, 'kv_pressure_pct', 100 * max(blocks_used::DOUBLE / num_blocks) "
                     f"FROM {_scan(glob('kv_pool_sample'))} WHERE num_blocks > 0 GROUP BY node")
    if event_files(root, "request_finished"):
        fin = f"FROM {_scan(glob('request_finished'))} WHERE status = 'finished'"
        parts.append(f"SELECT node, 'engine_hit_rate_pct', 100 * sum(cached_prompt_tokens)::DOUBLE "
                     f"/ nullif(sum(prompt_tokens), 0) {fin} GROUP BY node")
        for q in (50, 99):
            parts.append(f"SELECT node, 'ttft_p{q}_ms', quantile_cont(ttft_ns, {q / 100}) / 1e6 "
                         f"{fin} AND ttft_ns IS NOT NULL GROUP BY node")
    return "\nUNION ALL\n".join(parts)


def fleet_table(datasets: Iterable[str | os.PathLike], names: dict | None = None) -> pd.DataFrame:
    """The per-node table of one or more datasets, worst nodes first (highest KV pressure,
    then highest TTFT P99). ``names`` maps ``(dataset, node)`` to the node's name in a merged
    view (``analysis.logs.merge`` renames repeated nodes); by default the dataset's names."""
    import duckdb

    frames = []
    for root in datasets:
        long = duckdb.sql(_query(Path(root))).df()
        wide = long.pivot(index="node", columns="k", values="v").reset_index()
        if names:
            wide["node"] = [names.get((str(root), n), n) for n in wide["node"]]
        frames.append(wide)
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    out = out.reindex(columns=COLUMNS)
    out["events"] = out["events"].astype("int64")
    out = out.sort_values(["kv_pressure_pct", "ttft_p99_ms", "node"], ascending=[False, False, True],
                          na_position="last", ignore_index=True)
    out.columns.name = None
    return out


def fleet_for(paths: Iterable[str | os.PathLike], node_order: list[str]) -> pd.DataFrame | None:
    """The per-node table of the datasets among ``paths`` (the inputs of ``logs.load``, in
    order), named as in the merged logs whose nodes are ``node_order``; None without one."""
    from kvdiag.dataset import read_headers

    names, datasets, i = {}, [], 0
    for p in paths:
        if not Path(p).is_dir():
            i += 1  # a log: one node
            continue
        datasets.append(p)
        for node in read_headers(p)["node"]:
            names[(str(p), node)] = node_order[i]
            i += 1
    return fleet_table(datasets, names) if datasets else None
