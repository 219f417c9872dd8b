"""A kvdiag Parquet dataset: the events of several logs, partitioned by event type and node.

Layout (hive partitioning, readable by DuckDB, pyarrow, Spark)::

    DIR/type=engine_step/node=NAME/part-0.parquet   one file per event type and node
    DIR/_headers.parquet                            one row per log, in export order

A node's directory name is its name percent-encoded (DuckDB decodes it back). Event files
hold the event's fields only (``kvdiag.events.columnar``): type and node come from the path. The
headers table holds each log's node, source path, header (``header_json``, plus its scalar
fields as columns for SQL) and the lines the reader skipped, so that reading the dataset
back gives what reading the logs gives.

Every file is created 0600 and every folder the writer creates 0700 (``kvdiag.paths``),
whatever the mode of the logs it was made from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping, Optional
from urllib.parse import quote

import msgspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvdiag.events.columnar import from_table, to_table
from kvdiag.events.eventlog import LogFormatError
from kvdiag.paths import make_private_dirs, open_private
from kvdiag.events.schema import TAGS, LogHeader

HEADERS_FILE = "_headers.parquet"
_HEADER_SCALARS = ("schema_version", "kvdiag_version", "host", "pid", "engine", "model",
                   "block_size_tokens", "bytes_per_token", "start_ns")


def node_dir(root: Path, tag: str, node: str) -> Path:
    """The partition folder of one event type on one node."""
    return Path(root) / f"type={tag}" / f"node={quote(node, safe='')}"


class DatasetWriter:
    """Writes logs into a new dataset folder, one log at a time; ``close`` writes the headers
    table (a folder without it is not a dataset)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        if self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir())):
            raise FileExistsError(f"{self.root}: exists and is not an empty folder; "
                                  f"expected a new folder for the dataset")
        make_private_dirs(self.root)
        self._rows: list[dict] = []

    def add(self, node: str, header: LogHeader, frames: Mapping[str, pd.DataFrame],
            source: str, problems: Iterable[str] = ()) -> int:
        """Write one log's frames (``read_log``'s, keyed by event tag) under ``node``;
        returns the rows written."""
        rows = 0
        for tag, df in frames.items():
            if not len(df):
                continue
            folder = node_dir(self.root, tag, node)
            with open_private(folder / "part-0.parquet", "wb") as f:  # 0600, folders 0700
                pq.write_table(to_table(TAGS[tag], df), f, compression="zstd")
            rows += len(df)
        row = {"node": node, "source": source, "events": rows,
               "header_json": msgspec.json.encode(header).decode(),
               "skipped_lines": list(problems)}
        row.update({k: getattr(header, k) for k in _HEADER_SCALARS})
        self._rows.append(row)
        return rows

    def close(self) -> None:
        table = pa.Table.from_pylist(self._rows, schema=_headers_schema())
        with open_private(self.root / HEADERS_FILE, "wb") as f:
            pq.write_table(table, f)


def _headers_schema() -> pa.Schema:
    fields = [("node", pa.string()), ("source", pa.string()), ("events", pa.int64()),
              ("header_json", pa.string()), ("skipped_lines", pa.list_(pa.string()))]
    types = {"pid": pa.int64(), "block_size_tokens": pa.int64(), "bytes_per_token": pa.int64(),
             "start_ns": pa.int64()}
    fields += [(k, types.get(k, pa.string())) for k in _HEADER_SCALARS]
    return pa.schema(fields)


def is_dataset(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder with a dataset's headers table."""
    return (Path(path) / HEADERS_FILE).is_file()


def read_headers(root: str | os.PathLike) -> pd.DataFrame:
    """The headers table of a dataset; raises LogFormatError for a folder that is not one."""
    root = Path(root)
    if not root.is_dir():
        raise LogFormatError(f"{root}: no such folder")
    if not (root / HEADERS_FILE).is_file():
        raise LogFormatError(f"{root}: a folder without {HEADERS_FILE}; expected a log file or a "
                             f"kvdiag Parquet dataset (made by `kvdiag export LOG... --parquet DIR`)")
    try:
        table = pq.read_table(root / HEADERS_FILE, schema=_headers_schema())
    except (OSError, pa.ArrowException) as exc:
        raise LogFormatError(f"{root / HEADERS_FILE}: expected the headers table of a kvdiag "
                             f"Parquet dataset ({str(exc).splitlines()[0]})") from None
    return table.to_pandas()


def read_dataset(root: str | os.PathLike, skip: frozenset[str] = frozenset()
                 ) -> tuple[list[tuple[LogHeader, dict[str, pd.DataFrame], str]], list[str]]:
    """The ``(header, frames, source)`` of each log in a dataset, in export order (what
    ``diagnosis.frames.merge`` takes), leaving out the event types in ``skip``; and the lines
    the reader skipped at export."""
    root = Path(root)
    headers = read_headers(root)
    tags = [t for t in TAGS if t not in skip and (root / f"type={t}").is_dir()]
    items, problems = [], []
    for row in headers.itertuples(index=False):
        try:
            header = msgspec.json.decode(row.header_json, type=LogHeader)
        except msgspec.DecodeError as exc:
            raise LogFormatError(f"{root / HEADERS_FILE}: node {row.node}: expected a kvdiag log "
                                 f"header ({exc})") from None
        frames = {}
        for tag in tags:
            f = node_dir(root, tag, row.node) / "part-0.parquet"
            if f.is_file():
                frames[tag] = _read(f, TAGS[tag])
        items.append((header, frames, row.source))
        problems += list(row.skipped_lines)
    return items, problems


def _read(path: Path, cls: type) -> pd.DataFrame:
    try:
        return from_table(cls, pq.read_table(path))
    except (OSError, pa.ArrowException, KeyError, msgspec.DecodeError) as exc:
        raise LogFormatError(f"{path}: expected a Parquet file of kvdiag events "
                             f"({str(exc).splitlines()[0]})") from None


def event_files(root: str | os.PathLike, tag: str) -> Optional[str]:
    """The glob of one event type's files in a dataset (None when it has none)."""
    folder = Path(root) / f"type={tag}"
    return str(folder / "node=*" / "*.parquet") if folder.is_dir() else None
