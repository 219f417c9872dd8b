"""Engine-number traps: an engine's headline KV numbers recomputed from kvdiag's own events.

Each check compares what the engine's ``/metrics`` say (``EngineMetrics``) with the same
quantity kvdiag counts itself (pool samples of the plugin, finished requests), per node:

- ``usage_counts_blocks``: the engine's KV usage gauge (vLLM ``kv_cache_usage_perc``) counts
  blocks; a block holding one token counts as full. Trap when its peak exceeds the peak share of
  the pool's token slots actually written (``KVPoolSample.tokens_held`` / (blocks x block
  size)) by :data:`kvdiag.diagnosis.rules.USAGE_TRAP_GAP` or more. ``tokens_held`` counts a
  shared prefix block's tokens once per request holding it, so with sharing the recount is an
  upper bound and the check errs towards no trap.
- ``gauge_is_a_point_in_time``: the gauge is the value at the engine's last step before each
  scrape, so scrapes miss what happens between them (and read 0 once idle). Trap when the peak
  block share of kvdiag's pool samples exceeds the gauge's peak over the scrapes by
  :data:`~kvdiag.diagnosis.rules.GAUGE_PEAK_TRAP_GAP` or more.
- ``lifetime_hit_rate``: the engine's prefix counters are cumulative since it started, so
  hits / queries read off them include warm-up and all earlier traffic. Trap when that lifetime
  rate (at the last scrape) and the rate over the log's window (counter deltas between the first
  and last scrape) differ by :data:`~kvdiag.diagnosis.rules.SHARING_GAP_LIMIT` or more.
- ``hits_beyond_requests``: the engine's hit counter over the whole run (a log that starts with
  the engine: first scrape at 0 queries; and ends with it idle: no request in flight at the last
  scrape) exceeds the cached prompt tokens of its requests' first admissions: hits counted again
  at re-admission after a preemption (recompute counted as hits). n/a otherwise.
- ``counter_stuck_at_zero``: the engine's hit counter did not move over the window while the
  requests that finished in it had cached prompt tokens (from the plugin's per-request count).

Verdict: :func:`kvdiag.diagnosis.rules.number_traps_status` (warn on any trap, n/a when no
check had its inputs).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from kvdiag.diagnosis import rules
from kvdiag.diagnosis.findings import Finding
from kvdiag.events.schema import EngineMetrics, KVPoolInfo, KVPoolSample, RequestFinished, RequestPreempted

RULE_ID = "engine.number_traps"
TITLE = "the engine's own KV numbers match kvdiag's recount"


def _check(name: str, trap: Optional[bool], engine, recount, note: str) -> dict:
    status = "n/a" if trap is None else ("trap" if trap else "ok")
    return {"check": name, "status": status, "engine": engine, "recount": recount, "note": note}


def _mine(df: pd.DataFrame, node: str) -> pd.DataFrame:
    return df[df["node"] == node].sort_values("ts_ns", kind="stable") if len(df) else df


def node_checks(logs, node: str) -> list[dict]:
    """The five checks of the module docstring on ``node``."""
    em = _mine(logs.frame(EngineMetrics), node)
    ps = _mine(logs.frame(KVPoolSample), node)
    fin = _mine(logs.frame(RequestFinished), node)
    info = _mine(logs.frame(KVPoolInfo), node)
    bs = int(info["block_size_tokens"].iloc[-1]) if len(info) else logs.headers[node].block_size_tokens
    out = []
    gauge = em["kv_cache_usage"].dropna() if len(em) else pd.Series(dtype=float)
    have_pool = len(ps) and (ps["num_blocks"] > 0).any()
    if len(gauge) and have_pool and bs:
        p = ps[ps["num_blocks"] > 0]
        token_peak = float((p["tokens_held"] / (p["num_blocks"] * bs)).max())
        gpeak = float(gauge.max())
        out.append(_check("usage_counts_blocks", gpeak - token_peak >= rules.USAGE_TRAP_GAP, gpeak, token_peak,
                          f"engine usage gauge peak {gpeak:.1%} vs token slots written {token_peak:.1%} "
                          "(the gauge counts blocks)"))
        block_peak = float((p["blocks_used"] / p["num_blocks"]).max())
        out.append(_check("gauge_is_a_point_in_time", block_peak - gpeak >= rules.GAUGE_PEAK_TRAP_GAP, gpeak,
                          block_peak, f"gauge peak over {len(gauge)} scrapes {gpeak:.1%} vs pool samples' "
                          f"block peak {block_peak:.1%}"))
    else:
        why = "needs the engine's usage gauge and kvdiag's pool samples"
        out += [_check("usage_counts_blocks", None, None, None, why),
                _check("gauge_is_a_point_in_time", None, None, None, why)]
    cnt = em.dropna(subset=["prefix_cache_queries_tokens", "prefix_cache_hits_tokens"]) if len(em) else em
    if len(cnt) >= 2:
        q0, h0 = float(cnt["prefix_cache_queries_tokens"].iloc[0]), float(cnt["prefix_cache_hits_tokens"].iloc[0])
        q1, h1 = float(cnt["prefix_cache_queries_tokens"].iloc[-1]), float(cnt["prefix_cache_hits_tokens"].iloc[-1])
        t0, t1 = int(cnt["ts_ns"].iloc[0]), int(cnt["ts_ns"].iloc[-1])
        if q1 > q0 and q1 > 0:
            life, window = h1 / q1, (h1 - h0) / (q1 - q0)
            out.append(_check("lifetime_hit_rate", abs(life - window) >= rules.SHARING_GAP_LIMIT, life, window,
                              f"lifetime hits/queries {life:.1%} vs over the window {window:.1%}"))
        else:
            out.append(_check("lifetime_hit_rate", None, None, None, "no queries counted in the window"))
        done = fin[(fin["ts_ns"] > t0) & (fin["ts_ns"] <= t1)] if len(fin) else fin
        cached = float(done["cached_prompt_tokens"].sum()) if len(done) else 0.0
        whole = q0 == 0 and len(fin) and int(fin["ts_ns"].max()) <= t1
        if whole:
            pre = _mine(logs.frame(RequestPreempted), node)
            out.append(_check("hits_beyond_requests", h1 - h0 > cached, h1 - h0, cached,
                              f"hit counter {h1 - h0:,.0f} tokens vs first-admission cached tokens "
                              f"{cached:,.0f} of {len(done)} requests ({len(pre)} preemptions)"))
        else:
            out.append(_check("hits_beyond_requests", None, None, None,
                              "needs a log from the engine's start to idle (first scrape at 0 queries)"))
        if len(done):
            out.append(_check("counter_stuck_at_zero", h1 == h0 and cached > 0, h1 - h0, cached,
                              f"hit counter moved {h1 - h0:,.0f} tokens; requests finished in the window "
                              f"had {cached:,.0f} cached prompt tokens"))
        else:
            out.append(_check("counter_stuck_at_zero", None, None, None, "no request finished in the window"))
    else:
        why = "needs two scrapes of the engine's prefix-cache counters"
        out += [_check(n, None, None, None, why) for n in ("lifetime_hit_rate", "hits_beyond_requests",
                                                           "counter_stuck_at_zero")]
    return out


def number_traps(logs) -> Finding:
    """``engine.number_traps``: every node's checks; the findings' message names each trap."""
    checks = [{"node": node, **c} for node in logs.nodes for c in node_checks(logs, node)]
    traps = [c for c in checks if c["status"] == "trap"]
    checked = [c for c in checks if c["status"] != "n/a"]
    status = rules.number_traps_status(len(traps), len(checked))
    evidence = {"checks": [{k: (float(v) if isinstance(v, (np.floating, np.integer)) else v)
                            for k, v in c.items()} for c in checks]}
    multi = len(logs.nodes) > 1
    if status == "n/a":
        msg = "no engine metrics to check against kvdiag's counts (scrape the engine's /metrics)"
    elif traps:
        msg = "; ".join((f"{c['node']}: " if multi else "") + f"{c['check']}: {c['note']}" for c in traps)
    else:
        msg = f"{len(checked)} checks, no trap: " + ", ".join(sorted({c['check'] for c in checked}))
    return Finding(RULE_ID, status, TITLE, msg, evidence)
