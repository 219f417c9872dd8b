"""``sharing.consistency`` as a rule over a log: the engine's prefix hit rate against the
content's, measured by the shadow cache at the engine's settings, over the same finished
requests, less what the engine's own events explain (content it let go under pressure,
recomputed after a preemption, or had not stored yet: in flight in another request). Verdict:
:func:`kvdiag.diagnosis.rules.sharing_gap_status` of :func:`kvdiag.diagnosis.rules.unexplained_gap`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis import block_facts, rules
from kvdiag.diagnosis.findings import Finding
from kvdiag.diagnosis.miss_tally import explained_between
from kvdiag.diagnosis.frames import Logs
from kvdiag.events.schema import KVPoolInfo, RequestFinished, ShadowSharing
from kvdiag.pool.blockfacts import FACTS_TAG
from kvdiag.simulation.live_sharing import headline_config, sharing_window


def _config_key(r) -> tuple:
    return (r.policy, int(r.block_size_tokens), None if pd.isna(r.capacity_blocks) else int(r.capacity_blocks))


def _as_event(r) -> ShadowSharing:
    def opt(v):
        return None if v is None or (isinstance(v, float) and np.isnan(v)) else v
    return ShadowSharing(ts_ns=int(r.ts_ns), policy=r.policy, block_size_tokens=int(r.block_size_tokens),
                         capacity_blocks=_config_key(r)[2], requests=int(r.requests),
                         block_hit_rate=float(r.block_hit_rate), token_hit_rate=float(r.token_hit_rate),
                         engine_hit_rate=opt(r.engine_hit_rate),
                         **{f: None if opt(getattr(r, f, None)) is None else int(getattr(r, f))
                            for f in ("finished_requests", "finished_prompt_tokens", "finished_hit_tokens",
                                      "finished_engine_cached_tokens")})


def _same_requests(mine: pd.DataFrame, key: tuple, fin: pd.DataFrame) -> Optional[dict]:
    """Engine and shadow over the same requests, for one configuration's events of one node:
    the window between its first and last event (:func:`kvdiag.simulation.live_sharing.sharing_window`);
    for a log without the ``finished_*`` counters (schema < 1.6), the latest event taken when
    every request the shadow had counted had finished (its ``requests`` equal to the requests
    finished by then), whose shadow and engine rates cover the same requests."""
    rows = [r for r in mine.sort_values("ts_ns", kind="stable").itertuples() if _config_key(r) == key]
    first, last = _as_event(rows[0]), _as_event(rows[-1])
    window = sharing_window(first, last)
    if window is not None:
        return {"shadow_hit_rate": window.shadow_hit_rate, "engine_hit_rate": window.engine_hit_rate,
                "requests": window.requests, "window_start_ns": window.start_ns, "window_end_ns": window.end_ns,
                "prompt_tokens": window.prompt_tokens, "shadow_hit_tokens": window.shadow_hit_tokens,
                "engine_cached_tokens": window.engine_cached_tokens}
    done = np.sort(fin["ts_ns"].to_numpy(dtype="int64"))
    for r in reversed(rows):
        if r.requests and np.searchsorted(done, r.ts_ns, side="right") == r.requests and pd.notna(r.engine_hit_rate):
            counted = fin[(fin["ts_ns"] <= r.ts_ns) & (fin["status"] == "finished")]
            return {"shadow_hit_rate": float(r.token_hit_rate), "engine_hit_rate": float(r.engine_hit_rate),
                    "requests": int(r.requests), "window_start_ns": None, "window_end_ns": int(r.ts_ns),
                    "prompt_tokens": int(counted["prompt_tokens"].sum())}
    return None


def engine_evictions(logs: Logs, node: str, start_ns: Optional[int], end_ns: Optional[int]) -> int:
    """The engine's ``BlockEvicted`` events of ``node`` in ``(start_ns, end_ns]`` (None: open),
    from the block facts (each row counts those since the row before it)."""
    facts = block_facts.frame(logs, FACTS_TAG)
    facts = facts[facts["node"] == node]
    if facts.empty:
        return 0
    ts = facts["ts_ns"].astype("int64")
    keep = pd.Series(True, index=facts.index)
    if start_ns is not None:
        keep &= ts > start_ns
    if end_ns is not None:
        keep &= ts <= end_ns
    return int(pd.to_numeric(facts.loc[keep, "evictions"]).sum())


def sharing_consistency(logs: Logs) -> Finding:
    """``sharing.consistency``: the content's hit rate (the shadow cache configured closest
    to the engine: :func:`kvdiag.simulation.live_sharing.headline_config`) minus the engine's
    own, over the same requests (:func:`_same_requests`: those that finished between the
    node's first and last shadow results; a log cut mid-run or joined mid-stream judges only
    them); n/a with fewer than :data:`kvdiag.diagnosis.rules.MIN_SHARING_REQUESTS` of them.
    Judged on the gap the engine's own events leave unexplained
    (:func:`kvdiag.diagnosis.rules.unexplained_gap`, with the miss causes' explained tokens of
    those requests: :func:`explained_tokens`); the node with the largest such gap decides."""
    title = "engine prefix hit rate matches the content's"
    sh = logs.frame(ShadowSharing)
    if sh.empty:
        return Finding("sharing.consistency", "n/a", title, "no shadow sharing events (the agent records them)")
    info = logs.frame(KVPoolInfo)
    fin_all = logs.frame(RequestFinished)
    worst: Optional[dict] = None
    fewest: Optional[dict] = None  # the largest window with too few requests
    for node in logs.nodes:
        mine = sh[sh["node"] == node]
        if mine.empty:
            continue
        keys = {_config_key(r) for r in mine.itertuples()}
        pool = info[info["node"] == node]
        last_info = pool.iloc[-1] if len(pool) else None
        key = headline_config(keys, None if last_info is None else int(last_info["block_size_tokens"]),
                              None if last_info is None else int(last_info["num_blocks"]))
        same = _same_requests(mine, key, fin_all[fin_all["node"] == node])
        if same is None or same["engine_hit_rate"] is None:
            continue
        if same["requests"] < rules.MIN_SHARING_REQUESTS:
            if fewest is None or same["requests"] > fewest["requests"]:
                fewest = {"node": node, **same}
            continue
        gap = float(same["shadow_hit_rate"]) - float(same["engine_hit_rate"])
        explained = explained_tokens(logs, node, same) if gap > 0 else 0
        unexplained = rules.unexplained_gap(gap, explained, same.get("prompt_tokens"))
        if worst is None or abs(unexplained) > abs(worst["unexplained_gap"]):
            worst = {"node": node, "gap": gap, **same, "policy": key[0],
                     "block_size_tokens": int(key[1]), "capacity_blocks": key[2],
                     "limit": rules.SHARING_GAP_LIMIT, "explained_tokens": explained,
                     "unexplained_gap": unexplained}
    if worst is None:
        if fewest is not None:
            return Finding("sharing.consistency", "n/a", title,
                           rules.too_few(fewest["requests"], rules.MIN_SHARING_REQUESTS,
                                         "finished requests counted by both the shadow and the engine"),
                           {**fewest, "needed": rules.MIN_SHARING_REQUESTS})
        return Finding("sharing.consistency", "n/a", title,
                       "no engine hit rate over the same requests as the shadow's (shadow results "
                       "older than schema 1.6 compare only when no request was in flight)")
    worst["engine_evictions"] = engine_evictions(logs, worst["node"], worst["window_start_ns"],
                                                 worst["window_end_ns"])
    return Finding("sharing.consistency", rules.sharing_gap_status(worst["unexplained_gap"]), title,
                   _message(worst), worst)


def _message(worst: dict) -> str:
    """The finding's message: both hit rates, the gap and what the engine's events explain."""
    explained, unexplained = worst["explained_tokens"], worst["unexplained_gap"]
    message = (f"shadow {worst['shadow_hit_rate']:.1%} vs engine {worst['engine_hit_rate']:.1%} "
               f"over the same {worst['requests']} finished requests (gap {worst['gap']:+.1%}")
    if unexplained != worst["gap"]:
        prompt = worst.get("prompt_tokens")
        points = explained / prompt if prompt else worst["gap"] - unexplained
        evictions = (f" ({worst['engine_evictions']:,} evictions meanwhile: requests in flight take blocks "
                     f"that the shadow, holding content alone, counts as cache)" if worst["engine_evictions"] else "")
        message += (f"; the engine's own events explain {points * 100:.1f} points: {explained:,} prompt "
                    f"tokens the shadow held that the engine had let go{evictions}, recomputed after a "
                    f"preemption or not stored yet (in flight in another request); "
                    f"unexplained {unexplained:+.1%}")
    message += f", limit ±{rules.SHARING_GAP_LIMIT:.0%})"
    if not explained and worst["gap"] > 0 and worst["engine_evictions"]:
        message += (f"; the engine evicted {worst['engine_evictions']:,} cached blocks meanwhile (the miss "
                    "causes, with the prompts' content in the log, tell whether the shadow held them)")
    return message


def explained_tokens(logs: Logs, node: str, same: dict) -> int:
    """The explained missed tokens (:func:`kvdiag.diagnosis.miss_tally.explained_tokens`) of
    the requests ``same`` compares: those of ``node`` that finished in its window."""
    from kvdiag.diagnosis.miss_replay import explained_frame
    df = explained_frame(logs)
    mine = df[df["node"] == node]
    return explained_between(mine["ts_ns"].to_numpy("int64"), mine["tokens"].to_numpy("int64"),
                             same["window_start_ns"], same["window_end_ns"])
