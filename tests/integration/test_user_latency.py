"""Latency as users see it (kvdiag.diagnosis.user_latency), the ``latency.queueing`` rule, the
P99 rule's fallback for TTFT/TPOT and the ``queueing`` cause: on two recorded demo logs (one
queued, one at a sustainable rate) and on constructed events, each against a brute-force
reading of the raw events."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvdiag.events import schema as s
from kvdiag.diagnosis import latency_regression, p99_rules, rules, user_latency
from kvdiag.diagnosis.frames import load
from kvdiag.cli import main
from kvdiag.events.eventlog import make_header
from kvdiag.events.log_writer import LogWriter

DATA = Path(__file__).parent.parent / "data" / "demo_queueing"
OVERLOAD = DATA / "overload_24req_rate30.kvlog.gz"
CALM = DATA / "calm_22req_rate0.8.kvlog.gz"


def _q(values, q):
    """Nearest rank: the ceil(q n)-th smallest (written out, not kvdiag's function)."""
    v = sorted(values)
    return v[max(1, math.ceil(q * len(v))) - 1]


def _raw(path: Path) -> dict:
    """Brute force over the raw lines: per finished request its arrival, first scheduling,
    TTFT, e2e and output tokens."""
    arrived, scheduled, first_tok, fin = {}, {}, {}, {}
    with gzip.open(path, "rt") as f:
        next(f)  # header
        for line in f:
            ev = json.loads(line)
            t, rid = ev["type"], ev.get("request_id")
            if t == "request_arrived":
                arrived.setdefault(rid, ev["ts_ns"])
            elif t == "request_scheduled":
                scheduled[rid] = min(scheduled.get(rid, ev["ts_ns"]), ev["ts_ns"])
            elif t == "request_first_token":
                first_tok[rid] = ev["ts_ns"]
            elif t == "request_finished" and ev["status"] == "finished":
                fin[rid] = ev
    out = {}
    for rid, ev in fin.items():
        ttft = ev["ttft_ns"] if ev.get("ttft_ns") is not None else first_tok[rid] - arrived[rid]
        e2e = ev["e2e_ns"] if ev.get("e2e_ns") is not None else ev["ts_ns"] - arrived[rid]
        out[rid] = {"queue": scheduled[rid] - arrived[rid], "ttft": ttft, "e2e": e2e,
                    "tpot": (e2e - ttft) / (ev["output_tokens"] - 1) if ev["output_tokens"] > 1 else None,
                    "finished": ev["ts_ns"], "arrived": arrived[rid]}
    return out


@pytest.mark.parametrize("path", [OVERLOAD, CALM], ids=["overload", "calm"])
def test_summary_of_a_recorded_log_matches_brute_force(path):
    raw = _raw(path)
    summ = user_latency.summarize(load([path])[0]).nodes[0]
    assert summ.requests_finished == len(raw) >= rules.QUEUE_MIN_REQUESTS
    for m in user_latency.METRICS:
        v = [r[m] for r in raw.values() if r[m] is not None]
        st = summ.stats[m]
        assert st.count == len(v)
        assert st.p50_s == pytest.approx(_q(v, 0.5) / 1e9, abs=1e-9)
        assert st.p99_s == pytest.approx(_q(v, 0.99) / 1e9, abs=1e-9)
    arr = sorted(r["arrived"] for r in raw.values())
    done = sorted(r["finished"] for r in raw.values())
    assert summ.arrival_rate_per_s == pytest.approx((len(arr) - 1) / ((arr[-1] - arr[0]) / 1e9))
    assert summ.completion_rate_per_s == pytest.approx((len(done) - 1) / ((done[-1] - done[0]) / 1e9))


def test_queueing_fires_on_the_queued_demo_and_names_the_queue_wait():
    raw = _raw(OVERLOAD)
    f = user_latency.queueing(load([OVERLOAD])[0])
    share = float(np.median([r["queue"] / r["ttft"] for r in raw.values()]))
    q50, q99 = _q([r["queue"] for r in raw.values()], 0.5), _q([r["queue"] for r in raw.values()], 0.99)
    assert share >= rules.QUEUE_SHARE_LIMIT and q50 >= rules.QUEUE_WAIT_FLOOR_NS  # the log is queued
    assert f.status in ("warn", "fail")
    assert f.evidence["queue_share_of_ttft_p50"] == pytest.approx(share)
    assert f"queue wait P50 {q50 / 1e9:.2f} s, P99 {q99 / 1e9:.2f} s" in f.message
    assert "arrivals" in f.message and "completions" in f.message


def test_queueing_passes_at_a_sustainable_rate():
    raw = _raw(CALM)
    share = float(np.median([r["queue"] / r["ttft"] for r in raw.values()]))
    assert share < rules.QUEUE_SHARE_LIMIT
    f = user_latency.queueing(load([CALM])[0])
    assert f.status == "pass", f.message


def test_doctor_prints_latency_first_text_and_json(capsys):
    assert main(["doctor", str(OVERLOAD), "--json"]) == 0  # a warning, not a failure
    out = json.loads(capsys.readouterr().out)
    assert list(out)[0] == "latency"
    assert out["latency"]["overall"]["stats"]["queue"]["count"] == len(_raw(OVERLOAD))
    assert next(f for f in out["findings"] if f["rule"] == "latency.queueing")["status"] in ("warn", "fail")
    main(["doctor", str(OVERLOAD)])
    text = capsys.readouterr().out
    head = text.index("Latency of finished requests")
    assert head < text.index("queue wait") < text.index("latency.queueing") < text.index("leak.memory_growth")
    assert text[:head].strip() == ""  # nothing before it


# ---------------------------------------------------------------- constructed events

T0 = 1_700_000_000_000_000_000


def _requests(n, queue_s, ttft_extra_s=0.2, gap_s=0.5, out_tokens=5, tpot_s=0.05, scheduled=True):
    """Events of ``n`` requests arriving every ``gap_s``; request i waits ``queue_s(i)`` s,
    then its first token comes ``ttft_extra_s`` later. Returns (events, truth rows)."""
    evs, truth = [], []
    for i in range(n):
        rid, a = f"r{i}", T0 + int(i * gap_s * 1e9)
        q = int(queue_s(i) * 1e9)
        ttft = q + int(ttft_extra_s * 1e9)
        e2e = ttft + int(tpot_s * 1e9) * (out_tokens - 1)
        evs.append(s.RequestArrived(ts_ns=a, request_id=rid, prompt_tokens=10))
        if scheduled:
            evs.append(s.RequestScheduled(ts_ns=a + q, request_id=rid))
        evs.append(s.RequestFirstToken(ts_ns=a + ttft, request_id=rid, ttft_ns=ttft))
        evs.append(s.RequestFinished(ts_ns=a + e2e, request_id=rid, prompt_tokens=10, output_tokens=out_tokens,
                                     e2e_ns=e2e))
        truth.append({"queue": q, "ttft": ttft, "e2e": e2e, "arrived": a, "finished": a + e2e})
    return sorted(evs, key=lambda e: e.ts_ns), truth


def _logs(tmp_path, evs, name="c.jsonl"):
    header = make_header(engine="constructed", model="none", node="node-a")
    with LogWriter(tmp_path / name, header) as w:
        for e in evs:
            w.record(e)
    return load([tmp_path / name])[0]


def test_backlog_fails_queueing_with_rates(tmp_path):
    """Arrivals every 0.5 s, each request served 1 s after the previous one leaves the queue:
    queue wait grows by 0.5 s a request and completions come at 1/s against 2/s arrivals."""
    evs, truth = _requests(40, lambda i: 0.5 * i, gap_s=0.5)
    f = user_latency.queueing(_logs(tmp_path, evs))
    arr = [t["arrived"] for t in truth]
    fin = sorted(t["finished"] for t in truth)
    ratio = ((len(arr) - 1) / ((arr[-1] - arr[0]) / 1e9)) / ((len(fin) - 1) / ((fin[-1] - fin[0]) / 1e9))
    assert ratio == pytest.approx(2.0, rel=1e-9) and f.evidence["rate_ratio"] == pytest.approx(ratio)
    assert f.status == "fail"
    q = [t["queue"] for t in truth]
    assert f"queue wait P50 {_q(q, 0.5) / 1e9:.2f} s, P99 {_q(q, 0.99) / 1e9:.2f} s" in f.message


def test_no_scheduling_events_is_na_not_a_guess(tmp_path):
    evs, _ = _requests(30, lambda i: 0.0, scheduled=False)
    logs = _logs(tmp_path, evs)
    summ = user_latency.summarize(logs)
    assert summ.overall.stats["queue"].p50_s is None and "no scheduling events" in summ.overall.stats["queue"].reason
    f = user_latency.queueing(logs)
    assert "queue wait n/a" in f.message and f.status == "pass"  # judged on the rates alone


def test_too_few_requests_is_na_with_counts(tmp_path):
    evs, _ = _requests(rules.QUEUE_MIN_REQUESTS - 3, lambda i: 5.0)
    f = user_latency.queueing(_logs(tmp_path, evs))
    assert f.status == "n/a" and f"({rules.QUEUE_MIN_REQUESTS - 3} of {rules.QUEUE_MIN_REQUESTS} needed" in f.message


def test_p99_rule_judges_ttft_on_a_small_log_by_its_halves(tmp_path):
    """112 requests (too few for a P99 comparison: 100 per side after a change point), TTFT
    4x higher in the second half through queueing: the rule compares P90 between the halves,
    fails, says so, and names queueing as a supported cause."""
    evs, truth = _requests(112, lambda i: 0.1 if i < 56 else 2.0)
    logs = _logs(tmp_path, evs)
    findings, comps = p99_rules.p99(logs)
    reg = findings[0]
    assert reg.rule == "p99.regression" and reg.status == "fail"
    ttft = next(c for c in comps if c.metric == "ttft")
    assert ttft.quantile == 0.9 and ttft.method == "second half vs first half" and ttft.flagged
    by_time = [t["ttft"] for t in sorted(truth, key=lambda t: t["arrived"] + t["ttft"])]
    assert ttft.q_baseline_ns == _q(by_time[:56], 0.9) and ttft.q_current_ns == _q(by_time[56:], 0.9)
    assert "ttft P90" in reg.message and "second half vs first half" in reg.message
    causes = {c.cause: c for c in ttft.causes}
    assert causes["queueing"].supported
    assert next(f for f in findings if f.rule == "p99.queueing").status == "warn"


def test_p99_rule_says_na_with_counts_instead_of_passing(tmp_path):
    evs, _ = _requests(30, lambda i: 0.1)
    reg = p99_rules.p99(_logs(tmp_path, evs))[0][0]
    assert reg.status == "n/a"
    assert "ttft n/a (30 of 40 needed)" in reg.message and "per_token n/a (30 of 40 needed)" in reg.message


def test_p99_fallback_does_not_flag_a_steady_log(tmp_path):
    rng = np.random.default_rng(3)
    waits = rng.lognormal(np.log(0.3), 0.4, 112)
    evs, _ = _requests(112, lambda i: float(waits[i]))
    comps, skipped = latency_regression.detect_all(_logs(tmp_path, evs))
    ttft = next(c for c in comps if c.metric == "ttft")
    assert ttft.quantile == 0.9 and not ttft.flagged and not skipped


def test_live_queue_wait_is_the_doctors(tmp_path):
    """top's latency panel and doctor read the same definition: queue wait of the same
    finished requests, same P50/P99."""
    from kvdiag.live.state import LiveState
    evs, truth = _requests(30, lambda i: 0.05 * i, gap_s=0.2)
    logs = _logs(tmp_path, evs)
    state = LiveState(bin_s=1.0, history_bins=600, rate_window_s=600)
    for e in evs:
        state.feed(e)
    view = state.snapshot(max(e.ts_ns for e in evs)).latency
    q = user_latency.summarize(logs).overall.stats["queue"]
    assert view.queue_p50_ms == pytest.approx(q.p50_s * 1e3) and view.queue_p99_ms == pytest.approx(q.p99_s * 1e3)
    assert view.queue_p99_ms == pytest.approx(_q([t["queue"] for t in truth], 0.99) / 1e6)


def test_vllm_latencies_come_from_its_own_histograms_marked_as_such():
    """The vLLM plugin records no first token or scheduling: TTFT, TPOT and queue wait come
    from vLLM's /metrics histograms (first to last scrape), marked; each count is the +Inf
    bucket's increase and each P50 lies inside the bucket where the cumulative count first
    reaches half of it (read from the raw lines)."""
    path = Path(__file__).parent.parent / "data" / "vllm_demo" / "demo_16req_seed1.kvlog.gz"
    hists = []
    with gzip.open(path, "rt") as f:
        next(f)
        for line in f:
            ev = json.loads(line)
            if ev["type"] == "engine_metrics" and ev.get("histograms"):
                hists.append((ev["ts_ns"], ev["histograms"]))
    hists.sort(key=lambda p: p[0])
    summ = user_latency.summarize(load([path])[0]).nodes[0]
    assert summ.scheduling_events is False
    for m, key in user_latency.ENGINE_HISTOGRAMS.items():
        st = summ.stats[m]
        if m == "e2e":  # RequestFinished carries it: measured per request
            assert st.source == "requests"
            continue
        first, last = hists[0][1][key], hists[-1][1][key]
        inc = [(le, c1 - c0) for (le, c0), (_, c1) in zip(first, last)]
        assert st.source == "engine histogram" and "histogram" in st.reason
        assert st.count == inc[-1][1] > 0
        k = next(i for i, (_, c) in enumerate(inc) if c >= st.count / 2)
        lo = inc[k - 1][0] if k else 0.0
        assert lo <= st.p50_s <= inc[k][0]


def test_p99_rule_on_the_recorded_queued_demo_names_what_it_could_not_compare():
    """24 requests: too few to compare TTFT or TPOT even at P50 between halves (20 a side),
    so the rule says so with the counts instead of passing on engine steps alone."""
    n = len(_raw(OVERLOAD))
    reg = p99_rules.p99(load([OVERLOAD])[0])[0][0]
    assert f"ttft n/a ({n} of 40 needed)" in reg.message and f"per_token n/a ({n} of 40 needed)" in reg.message


def test_p99_rule_flags_the_ttft_rise_of_a_recorded_48_request_queued_demo():
    """48 queued requests (the issue's case in small: TTFT grows as the queue does): too few
    for P99, the rule compares TTFT P50 between the halves (by first-token time, split at the
    latency series' bucket boundary nearest the middle request), fails, and the compared values
    are within the sketches' ALPHA of the nearest-rank P50s of the raw events on either side."""
    from kvdiag.diagnosis.sketch import ALPHA

    path = DATA / "overload_48req_rate30.kvlog.gz"
    raw = sorted(_raw(path).values(), key=lambda r: r["arrived"] + r["ttft"])
    reg, *_ = p99_rules.p99(load([path])[0])[0]
    comps = {c["metric"]: c for c in reg.evidence["comparisons"]}
    ttft = comps["ttft"]
    assert reg.status == "fail" and ttft["flagged"] and ttft["quantile"] == 0.5
    split = ttft["current_window_ns"][0]
    before = [r["ttft"] for r in raw if r["arrived"] + r["ttft"] < split]
    after = [r["ttft"] for r in raw if r["arrived"] + r["ttft"] >= split]
    assert ttft["method"] == "second half vs first half" and (ttft["n_baseline"], ttft["n_current"]) == (
        len(before), len(after))
    assert min(len(before), len(after)) >= rules.REGRESSION_MIN_SAMPLES[0.5]
    assert abs(ttft["q_baseline_ns"] - _q(before, 0.5)) <= ALPHA * _q(before, 0.5)
    assert abs(ttft["q_current_ns"] - _q(after, 0.5)) <= ALPHA * _q(after, 0.5)
    assert ttft["q_current_ns"] > (1 + rules.GROSS_SHIFT_THRESHOLD) * ttft["q_baseline_ns"]
    assert "ttft P50" in reg.message
