"""Prefill seconds per prompt token, the price of a token a cache hit saves (the TTFT effect of
:mod:`kvdiag.simulation.tiers`), fitted on a log's engine steps."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd


def prefill_s_per_token_from_steps(steps: pd.DataFrame) -> Optional[float]:
    """Marginal prefill seconds per prompt token from a log's ``engine_step`` rows: the
    least-squares fit ``duration = c + a x prefill_tokens + b x decode_tokens`` over all steps,
    ``a`` (what one more prompt token recomputed costs; ``c`` is the per-step overhead a saved
    token does not remove). None with fewer than 3 steps with prefill tokens, or a fit with
    ``a <= 0``."""
    if steps is None or not len(steps):
        return None
    p = steps["prefill_tokens"].to_numpy(np.float64)
    d = steps["decode_tokens"].to_numpy(np.float64)
    y = steps["duration_ns"].to_numpy(np.float64) / 1e9
    if int((p > 0).sum()) < 3:
        return None
    x = np.column_stack([np.ones_like(p), p, d])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    a = float(coef[1])
    return a if a > 0 else None


def prefill_s_per_token_of_log(path) -> Optional[float]:
    """:func:`prefill_s_per_token_from_steps` of a kvdiag log's engine steps."""
    from kvdiag.events.eventlog import read_log
    from kvdiag.events.schema import EngineStep

    log = read_log(path, types=[EngineStep])
    return prefill_s_per_token_from_steps(log.frame(EngineStep))
