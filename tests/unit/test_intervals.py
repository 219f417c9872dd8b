"""Confidence intervals against independent computations: the normal-theory interval of cluster
means, the coverage of paired ratios on simulated experiments with a known truth, and the
compression table's per-step counts and intervals on constructed events."""

import math

import numpy as np
import pandas as pd
import pytest

from kvdiag.diagnosis.compression import compression_table, recommend, sampling_summary
from kvdiag.diagnosis.intervals import (Estimate, cluster_bootstrap_mean, goal_verdict, paired_rate_ratio,
                                      paired_ratio)


def test_cluster_bootstrap_resamples_clusters_not_values():
    """40 steps of 30 identical values each: 40 independent samples, not 1,200. The interval
    must match the normal-theory interval of the 40 step means, not the far narrower one of
    1,200 values taken as independent."""
    rng = np.random.default_rng(1)
    step_means = rng.normal(0.02, 0.005, size=40)
    values = np.repeat(step_means, 30)
    clusters = np.repeat(np.arange(40), 30)
    est = cluster_bootstrap_mean(values, clusters)
    assert est.n == 40
    assert est.value == pytest.approx(step_means.mean())
    half = 1.96 * step_means.std(ddof=1) / math.sqrt(40)
    assert (est.hi - est.lo) / 2 == pytest.approx(half, rel=0.15)
    iid_half = 1.96 * values.std(ddof=1) / math.sqrt(len(values))
    assert (est.hi - est.lo) / 2 > 4 * iid_half


def test_cluster_bootstrap_edge_cases():
    one = cluster_bootstrap_mean([1.0, 3.0], [7, 7])
    assert (one.value, one.lo, one.hi, one.n) == (2.0, 2.0, 2.0, 1)
    empty = cluster_bootstrap_mean([float("nan")], [0])
    assert empty.n == 0 and math.isnan(empty.value)
    # unequal cluster sizes: the point is the mean of all values (as the table's mean)
    est = cluster_bootstrap_mean([1.0, 1.0, 1.0, 4.0], [0, 0, 0, 1])
    assert est.value == pytest.approx(7 / 4)


def test_paired_ratio_covers_the_true_ratio():
    """200 simulated experiments of 12 paired rounds with a true ratio of 0.97 and round-to-round
    swings of +-10% shared by both arms (machine noise) plus 2% of each arm's own: the 95%
    interval covers 0.97 in about 95% of them (at least 88%, a 4-sigma margin for 200 draws)."""
    rng = np.random.default_rng(7)
    covered = 0
    for i in range(200):
        shared = rng.normal(1.0, 0.1, size=12)
        b = 100 * shared * rng.normal(1.0, 0.02, size=12)
        a = 97 * shared * rng.normal(1.0, 0.02, size=12)
        est = paired_ratio(a, b, resamples=1000, seed=i)
        covered += est.lo <= 0.97 <= est.hi
    assert covered >= 176, covered


def test_paired_ratio_rejects_unpaired_samples():
    with pytest.raises(ValueError, match="equal"):
        paired_ratio([1.0, 2.0], [1.0])


@pytest.mark.parametrize("lo,hi,goal,higher,verdict", [
    (0.985, 0.999, 0.98, True, "met"),
    (0.95, 0.979, 0.98, True, "missed"),
    (0.97, 1.01, 0.98, True, "undecided"),
    (1.00, 1.019, 1.02, False, "met"),       # a P99 ratio: lower is better
    (1.021, 1.05, 1.02, False, "missed"),
    (1.01, 1.03, 1.02, False, "undecided"),
])
def test_goal_verdict(lo, hi, goal, higher, verdict):
    assert goal_verdict(Estimate((lo + hi) / 2, lo, hi, 10), goal, higher) == verdict


def _events(steps: int, heads_layers: int, error_of_step) -> pd.DataFrame:
    rows = []
    for s in range(steps):
        for i in range(heads_layers):
            rows.append({"ts_ns": 1_000 + s, "layer": i % 3, "head": i // 3, "method": "int4",
                         "seq_len_tokens": 100, "ratio": 6.4, "k_rel_error": 0.1, "v_rel_error": 0.1,
                         "attn_score_error": 0.01, "attn_out_rel_error": error_of_step(s),
                         "encode_ns": 10, "decode_ns": 10})
    return pd.DataFrame(rows)


def test_compression_table_counts_steps_and_bounds_the_mean():
    errors = [0.01, 0.03, 0.02, 0.05, 0.04, 0.02]
    tbl = compression_table(_events(6, 9, lambda s: errors[s]), groups="1-3")
    row = tbl.iloc[0]
    assert (row["samples"], row["steps"]) == (54, 6)
    assert row["attn_out_rel_error"] == pytest.approx(np.mean(errors))
    # independent: the percentile bootstrap of the 6 step means (equal weights) with its own draws
    draws = np.random.default_rng(123).choice(errors, size=(20_000, 6)).mean(axis=1)
    assert row["attn_out_rel_error_lo"] == pytest.approx(np.percentile(draws, 2.5), abs=0.002)
    assert row["attn_out_rel_error_hi"] == pytest.approx(np.percentile(draws, 97.5), abs=0.002)


def test_recommendation_says_when_the_interval_reaches_over_the_budget():
    errors = [0.001, 0.001, 0.08]  # mean 0.027 within a 0.05 budget, interval up to 0.08
    tbl = compression_table(_events(3, 3, lambda s: errors[s]), groups="1-3")
    rec = recommend(tbl, error_budget=0.05)
    assert rec.iloc[0]["method"] == "int4"
    assert "95% interval reaches" in rec.iloc[0]["reason"] and "3 sampled steps" in rec.iloc[0]["reason"]
    steady = compression_table(_events(3, 3, lambda s: 0.01), groups="1-3")
    assert "interval" not in recommend(steady, error_budget=0.05).iloc[0]["reason"]


def test_sampling_summary_reads_the_last_budget_event():
    budgets = pd.DataFrame([
        {"ts_ns": 2, "steps_offered": 4000, "steps_sampled": 8, "steps_skipped_budget": 1, "steps_dropped": 0,
         "spent_ns": 9_000_000, "elapsed_ns": 1_000_000_000, "budget_frac": 0.01, "clock": "cpu",
         "sample_rate": 0.0021, "sample_rate_max": 0.05},
        {"ts_ns": 1, "steps_offered": 10, "steps_sampled": 1, "steps_skipped_budget": 0, "steps_dropped": 0,
         "spent_ns": 1, "elapsed_ns": 1, "budget_frac": 0.01, "clock": "cpu",
         "sample_rate": 0.05, "sample_rate_max": 0.05},
    ])
    line = sampling_summary(budgets)
    assert line.startswith("8 of 4000 decode steps sampled (achieved rate 0.0020)")
    assert "rate in force 0.0021 of at most 0.05" in line
    assert "shadow CPU 0.90% of the engine's (budget 1.00%)" in line
    assert "1 skipped for the budget" in line
    assert sampling_summary(pd.DataFrame()) is None


def test_paired_rate_ratio_point_is_the_ratio_of_totals():
    tokens_a, cpu_a, tokens_b, cpu_b = [3, 5, 0], [1.0, 2.0, 0.5], [4, 4, 1], [2.0, 1.0, 0.25]
    est = paired_rate_ratio(tokens_a, cpu_a, tokens_b, cpu_b)
    assert est.value == pytest.approx((8 / 3.5) / (9 / 3.25))
    assert est.n == 3 and est.lo <= est.value <= est.hi


def test_paired_rate_ratio_covers_the_true_ratio():
    """Blocks of engine steps: unequal token counts per block (prefill or decode, batch sizes),
    a per-block speed shared by both arms of a pair (the machine's phase) and 3% of each arm's
    own; arm a costs 1/0.985 as much CPU per token. The 95% interval covers 0.985 in at least
    88% of 200 simulated runs of 60 pairs."""
    rng = np.random.default_rng(11)
    covered = 0
    for i in range(200):
        shared = rng.normal(1.0, 0.15, size=60)
        tok_a, tok_b = rng.integers(1, 9, size=60), rng.integers(1, 9, size=60)
        cpu_b = tok_b * shared * rng.normal(1.0, 0.03, size=60)
        cpu_a = tok_a * shared * rng.normal(1.0, 0.03, size=60) / 0.985
        est = paired_rate_ratio(tok_a, cpu_a, tok_b, cpu_b, resamples=1000, seed=i)
        covered += est.lo <= 0.985 <= est.hi
    assert covered >= 176, covered


def test_paired_rate_ratio_rejects_unpaired_samples():
    with pytest.raises(ValueError, match="equal"):
        paired_rate_ratio([1, 2], [1.0, 1.0], [1], [1.0])
