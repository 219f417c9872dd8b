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


def test_doctor_describes_the_same_rate_as_every_view():
    """The P99 checklist's 'over the log' line counts the requests the one definition counts
    (an aborted request's tokens left out): 40 of 100 prompt tokens, not 90 of 150."""
    from kvdiag.diagnosis.p99_rules import _over_log
    from kvdiag.diagnosis.frames import Logs

    fin = pd.DataFrame({"ts_ns": [1, 2], "node": ["", ""], "prompt_tokens": [100, 50],
                        "cached_prompt_tokens": [40, 50], "status": ["finished", "aborted"]})
    line = _over_log(Logs(headers={}, frames={"request_finished": fin}), "prefix_hit_rate")
    assert line == "token hit rate 40.0% over 1 requests that finished normally"
    fin["status"] = "aborted"
    line = _over_log(Logs(headers={}, frames={"request_finished": fin}), "prefix_hit_rate")
    assert line == "token hit rate N/A (no request finished normally)"
