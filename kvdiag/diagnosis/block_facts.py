"""The block facts of a log (:mod:`kvdiag.pool.blockfacts`: blocks held at each engine step and
pool sample, the active requests' allocations and hits, evictions between them, KV-event
batches), folded once per log from its events, or handed over already folded by ``kvdiag
top`` (which keeps no raw block event). Bandwidth, the forecast, the eviction count of the
memory-pressure cause and the KV-event gap rule read them here.
"""

from __future__ import annotations

import pandas as pd

from kvdiag.pool import blockfacts
from kvdiag.events import schema as s
from kvdiag.diagnosis.frames import Logs

_INPUTS = (s.RequestArrived, s.RequestFinished, s.KVPoolInfo, *blockfacts.BLOCK_EVENTS,
           *blockfacts.KV_EVENTS, s.EngineStep, s.KVPoolSample)


def ensure(logs: Logs) -> None:
    """Fold the facts of every node of ``logs`` into ``logs.derived`` unless already there."""
    if blockfacts.FACTS_TAG in logs.derived:
        return
    if logs.whole is not None:  # a window cut before its whole was folded: cut it now
        whole = logs.window(*logs.span_ns)
        logs.derived.update(whole.derived)
        return
    per_tag: dict[str, list] = {}
    for node in logs.nodes:
        facts = blockfacts.fold(_events(logs, node), engine_pool=_engine_pool(logs, node))
        for tag, df in facts.frames(node).items():
            per_tag.setdefault(tag, []).append(df)
    logs.derived.update({tag: pd.concat(dfs, ignore_index=True) for tag, dfs in per_tag.items()}
                        if per_tag else _empty())


def frame(logs: Logs, tag: str) -> pd.DataFrame:
    """The derived frame ``tag`` (:data:`kvdiag.pool.blockfacts.FACTS_TAG` or ``KV_BATCHES_TAG``)."""
    ensure(logs)
    return logs.derived.get(tag, _empty()[tag])


def _empty() -> dict[str, pd.DataFrame]:
    return {blockfacts.FACTS_TAG: pd.DataFrame(columns=[*blockfacts.FACTS_COLUMNS, "node"]),
            blockfacts.KV_BATCHES_TAG: pd.DataFrame(columns=[*blockfacts.KV_BATCHES_COLUMNS, "node"]),
            blockfacts.KV_HEALTH_TAG: pd.DataFrame(columns=[*blockfacts.KV_HEALTH_COLUMNS, "ts_ns", "node"])}


def _engine_pool(logs: Logs, node: str) -> list[tuple[int, int]]:
    """``(ts_ns, num_blocks)`` of the node's ``EngineMetrics`` that carry the engine's pool size
    (its cache config), for the KV-event stream's balance check where no ``KVPoolInfo`` gives it."""
    df = logs.frame(s.EngineMetrics)
    if df.empty or "num_blocks" not in df:
        return []
    df = df[(df["node"] == node) & df["num_blocks"].notna()]
    return list(zip(df["ts_ns"].astype("int64").tolist(), df["num_blocks"].astype("int64").tolist()))


def _events(logs: Logs, node: str) -> list:
    """``node``'s input events rebuilt from its frames (unordered: the fold orders them)."""
    out = []
    for cls in _INPUTS:
        df = logs.frame(cls)
        if df.empty:
            continue
        df = df[df["node"] == node].drop(columns="node")
        fields = list(df.columns)
        out += [cls(**dict(zip(fields, row))) for row in zip(*(df[c].tolist() for c in fields))]
    return out
