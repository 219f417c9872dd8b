"""The one engine hit rate (kvdiag.pool.hit_rate): which requests count, and its fallbacks."""

from __future__ import annotations

import pandas as pd
import pytest

from kvdiag.pool.hit_rate import counts_toward_hit_rate, engine_token_hit_rate, frame_hit_rate


def test_only_requests_that_finished_normally_count():
    finished = pd.DataFrame({"prompt_tokens": [100, 50, 30], "cached_prompt_tokens": [40, 50, 0],
                             "status": ["finished", "aborted", "failed"]})
    assert frame_hit_rate(finished) == pytest.approx(0.4)
    assert [counts_toward_hit_rate(s) for s in finished["status"]] == [True, False, False]


def test_no_counted_request_is_unknown_not_zero():
    aborted = pd.DataFrame({"prompt_tokens": [10], "cached_prompt_tokens": [5], "status": ["aborted"]})
    assert frame_hit_rate(aborted) is None
    assert frame_hit_rate(aborted.iloc[:0]) is None


def test_metric_counters_stand_in_without_requests():
    assert engine_token_hit_rate(0, 0, metrics_queries_tokens=200, metrics_hits_tokens=50) == 0.25
    assert engine_token_hit_rate(0, 0) is None
    assert engine_token_hit_rate(80, 40, metrics_queries_tokens=200, metrics_hits_tokens=50) == 0.5
