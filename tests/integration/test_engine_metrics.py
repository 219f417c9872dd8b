"""Engine /metrics end to end: expositions written by prometheus_client with vLLM's metric
names, scraped into EngineMetrics, logged, and read back as latency percentiles. Every check is
against the values put into the registry or a direct computation on the raw observations."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from kvdiag.diagnosis.engine_latency import engine_latency_frame, histogram_quantile
from kvdiag.diagnosis.frames import load
from kvdiag.collectors import metrics
from kvdiag.events.eventlog import iter_events, make_header, read_log
from kvdiag.events.log_writer import LogWriter
from kvdiag.events.schema import EngineMetrics

INF = EngineMetrics.INF_LE
TTFT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
E2E_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LABELS = ["model_name", "engine"]


class FakeVllm:
    """A registry with vLLM 0.32's metric names (vllm/v1/metrics/loggers.py) and labels, for
    ``engines`` engine cores."""

    def __init__(self, engines=("0",), block_size="128", blocks=("512",), prefix_caching="True"):
        self.reg = r = CollectorRegistry()
        self.engines = engines
        self.queries = Counter("vllm:prefix_cache_queries", "q", LABELS, registry=r)
        self.hits = Counter("vllm:prefix_cache_hits", "h", LABELS, registry=r)
        self.preempt = Counter("vllm:num_preemptions", "p", LABELS, registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "p", LABELS, registry=r)
        self.gen = Counter("vllm:generation_tokens", "g", LABELS, registry=r)
        self.success = Counter("vllm:request_success", "s", LABELS + ["finished_reason"], registry=r)
        self.usage = Gauge("vllm:kv_cache_usage_perc", "u", LABELS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "r", LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "w", LABELS, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "t", LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "i", LABELS, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "e", LABELS, buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "q", LABELS, buckets=E2E_BUCKETS, registry=r)
        for m in (self.queries, self.hits, self.preempt, self.prompt, self.gen, self.usage, self.running,
                  self.waiting, self.ttft, self.itl, self.e2e, self.queue):
            for e in engines:
                m.labels("m", e)  # vLLM creates its series at startup: zero until observed
        info = Info("vllm:cache_config", "cache config", ["engine"], registry=r)
        for e, n in zip(engines, blocks):
            info.labels(e).info({"block_size": block_size, "num_gpu_blocks": n, "cache_dtype": "auto",
                                 "enable_prefix_caching": prefix_caching, "gpu_memory_utilization": "0.9"})

    def text(self) -> str:
        return generate_latest(self.reg).decode()

    def scrape(self, ts_ns: int) -> EngineMetrics:
        return metrics.engine_metrics(metrics.parse_prometheus(self.text()), ts_ns=ts_ns)


def cumulative(obs, bounds) -> list[tuple[float, float]]:
    """Observations <= each bound, and all of them at +Inf: the buckets, counted directly."""
    obs = np.asarray(obs, dtype="float64")
    return [(float(b), float((obs <= b).sum())) for b in bounds] + [(INF, float(len(obs)))]


def test_vllm_exposition_maps_onto_engine_metrics():
    rng = np.random.default_rng(3)
    v = FakeVllm(engines=("0", "1"), blocks=("512", "256"))
    put = {"ttft": {}, "itl": {}}
    for engine, (q, h, n_pre, p, g, use, run, wait) in {"0": (1000, 400, 2, 5000, 700, 0.25, 3, 1),
                                                        "1": (600, 100, 1, 3000, 300, 0.5, 2, 4)}.items():
        lab = ("m", engine)
        v.queries.labels(*lab).inc(q); v.hits.labels(*lab).inc(h); v.preempt.labels(*lab).inc(n_pre)
        v.prompt.labels(*lab).inc(p); v.gen.labels(*lab).inc(g)
        v.usage.labels(*lab).set(use); v.running.labels(*lab).set(run); v.waiting.labels(*lab).set(wait)
        v.success.labels(*lab, "stop").inc(5); v.success.labels(*lab, "length").inc(2)
        put["ttft"][engine] = rng.lognormal(-2, 1, 40)
        put["itl"][engine] = rng.lognormal(-4, 0.7, 300)
        for x in put["ttft"][engine]:
            v.ttft.labels(*lab).observe(x)
        for x in put["itl"][engine]:
            v.itl.labels(*lab).observe(x)
    em = v.scrape(ts_ns=123)
    assert em.ts_ns == 123
    assert (em.prefix_cache_queries_tokens, em.prefix_cache_hits_tokens, em.num_preemptions) == (1600, 500, 3)
    assert (em.prompt_tokens, em.generation_tokens) == (8000, 1000)
    assert (em.num_requests_running, em.num_requests_waiting) == (5, 5)
    # kv_cache_usage is summed over engines too, which is no fraction with two: not pinned here
    assert (em.block_size_tokens, em.num_blocks, em.prefix_caching) == (128, 768, True)
    both = lambda k: np.r_[put[k]["0"], put[k]["1"]]  # noqa: E731
    assert em.histograms["ttft_s"] == cumulative(both("ttft"), TTFT_BUCKETS)
    assert em.histograms["inter_token_s"] == cumulative(both("itl"), ITL_BUCKETS)
    # declared but never observed: every bucket zero
    assert em.histograms["e2e_s"] == cumulative([], E2E_BUCKETS)
    assert em.histograms["queue_s"] == cumulative([], E2E_BUCKETS)
    success = {k: x for k, x in em.raw.items() if k.startswith("vllm:request_success_total{")}
    assert sum(success.values()) == 14
    assert [x for k, x in success.items() if 'engine="1"' in k and 'finished_reason="length"' in k] == [2]
    assert not any(k.endswith(("_bucket", "_created")) or "_bucket{" in k or "_created{" in k for k in em.raw)


def test_cache_config_absent_or_unsized_stays_unknown():
    v = FakeVllm(blocks=("None",), prefix_caching="False")
    em = v.scrape(1)
    assert (em.block_size_tokens, em.num_blocks, em.prefix_caching) == (128, None, False)
    reg = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "u", registry=reg).set(0.5)
    em = metrics.engine_metrics(metrics.parse_prometheus(generate_latest(reg).decode()), ts_ns=1)
    assert (em.block_size_tokens, em.num_blocks, em.prefix_caching, em.histograms) == (None, None, None, {})


def test_malformed_exposition_raises_parse_error():
    good = FakeVllm().text()
    lines = good.splitlines()
    at = next(i for i, l in enumerate(lines) if l.startswith("vllm:time_to_first_token_seconds_bucket"))
    lines[at] = lines[at].replace('le="0.01"', "le=0.01")  # an unquoted label value
    with pytest.raises(metrics.PrometheusParseError, match=f"line {at + 1}: expected"):
        metrics.parse_prometheus("\n".join(lines) + "\n")
    with pytest.raises(metrics.PrometheusParseError, match="line 1: expected"):
        metrics.parse_prometheus("<html>not metrics</html>\n")
    assert metrics.parse_prometheus("") == []


# ---------------------------------------------------------------- histogram_quantile


def prometheus_formula(q: float, buckets: list[tuple[float, float]]) -> float:
    """The documented definition, evaluated step by step on sorted, distinct, cumulative buckets
    ending with +Inf: the first bucket whose count reaches q * total, linear inside it (from 0
    for the first bucket); the highest finite bound when that bucket is +Inf."""
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for i, (le, c) in enumerate(buckets):
        if c >= rank or i == len(buckets) - 1:
            if i == len(buckets) - 1:
                return buckets[-2][0]
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    raise AssertionError("unreachable")


@pytest.mark.parametrize("buckets", [
    [(0.1, 2.0), (0.5, 6.0), (1.0, 9.0), (math.inf, 10.0)],
    [(1.0, 0.0), (2.0, 0.0), (4.0, 7.0), (8.0, 7.0), (16.0, 30.0), (INF, 31.0)],
])
def test_histogram_quantile_is_the_documented_interpolation(buckets):
    for q in np.linspace(0.01, 1.0, 100):
        assert histogram_quantile(q, buckets) == pytest.approx(prometheus_formula(q, buckets), rel=1e-12)
    # worked by hand for the first vector: rank 5 of 10 lies 3 of 4 into (0.1, 0.5]
    if buckets[0] == (0.1, 2.0):
        assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 3 / 4)
        assert histogram_quantile(0.95, buckets) == 1.0  # in the +Inf bucket: highest finite bound
    # order and +Inf spelling do not matter
    shuffled = [(math.inf if le == INF else le, c) for le, c in reversed(buckets)]
    assert histogram_quantile(0.7, shuffled) == histogram_quantile(0.7, buckets)


def test_histogram_quantile_special_cases_as_promql():
    b = [(0.1, 2.0), (0.5, 6.0), (math.inf, 10.0)]
    assert histogram_quantile(-0.1, b) == -math.inf and histogram_quantile(1.5, b) == math.inf
    assert math.isnan(histogram_quantile(math.nan, b))
    assert math.isnan(histogram_quantile(0.5, [(0.1, 2.0), (0.5, 6.0)]))  # no +Inf bucket
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))  # no observations
    assert math.isnan(histogram_quantile(0.5, [(math.inf, 4.0)]))  # fewer than two buckets
    assert math.isnan(histogram_quantile(0.5, []))
    assert histogram_quantile(0.5, [(-1.0, 3.0), (0.0, 4.0), (math.inf, 5.0)]) == -1.0
    # equal bounds are merged (counts add) before the search
    assert histogram_quantile(0.5, [(1.0, 1.0), (1.0, 3.0), (2.0, 5.0), (math.inf, 5.0)]) == \
        pytest.approx(prometheus_formula(0.5, [(1.0, 4.0), (2.0, 5.0), (math.inf, 5.0)]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantile_lies_in_the_bucket_of_the_exact_quantile(seed):
    rng = np.random.default_rng(seed)
    obs = rng.lognormal(-1.5, 1.0, 2000)
    v = FakeVllm()
    for x in obs:
        v.ttft.labels("m", "0").observe(x)
    buckets = v.scrape(1).histograms["ttft_s"]
    edges = (0.0,) + TTFT_BUCKETS + (math.inf,)
    for q in (0.1, 0.5, 0.9, 0.99):
        exact = np.quantile(obs, q, method="inverted_cdf")
        i = np.searchsorted(edges, exact, side="left")  # bucket (edges[i-1], edges[i]]
        lo, hi = edges[i - 1], edges[i]
        got = histogram_quantile(q, buckets)
        if math.isinf(hi):
            assert got == TTFT_BUCKETS[-1]
        else:
            assert lo <= got <= hi, (q, exact, got)


# ---------------------------------------------------------------- the log and the analysis


def test_histograms_round_trip_through_the_log(tmp_path):
    ev = EngineMetrics(ts_ns=5, block_size_tokens=16, num_blocks=1000, prefix_caching=False,
                       prompt_tokens=10.0, generation_tokens=4.0,
                       histograms={"ttft_s": [(0.1, 1.0), (1.0, 3.0), (math.inf, 4.0)]})
    assert ev.histograms["ttft_s"][-1] == (INF, 4.0)  # +Inf kept as the documented sentinel
    path = tmp_path / "m.jsonl"
    with LogWriter(path, make_header()) as w:
        w.record(ev)
    back = list(iter_events(path, strict=True))
    assert back == [ev]
    row = read_log(path, strict=True).frame(EngineMetrics).iloc[0]
    assert row["histograms"] == ev.histograms and row["num_blocks"] == 1000
    assert histogram_quantile(0.5, row["histograms"]["ttft_s"]) == pytest.approx(0.1 + 0.9 * 1 / 2)
    # a 1.1 line (before these fields) still decodes, with the defaults
    old = b'{"type":"engine_metrics","ts_ns":1,"kv_cache_usage":0.5,"raw":{}}'
    em = msgspec.json.decode(old, type=EngineMetrics)
    assert (em.histograms, em.block_size_tokens, em.prompt_tokens) == ({}, None, None)


def write_scrapes(path, scrapes, node):
    with LogWriter(path, make_header(node=node, engine="vllm")) as w:
        for em in scrapes:
            w.record(em)
    return path


def test_engine_latency_frame_per_interval(tmp_path):
    rng = np.random.default_rng(7)
    v = FakeVllm()
    lab = ("m", "0")
    batches, scrapes = [], [v.scrape(1_000_000_000)]
    sizes = [300, 0, 500, 200]
    for k, n in enumerate(sizes):
        ttft, itl, e2e = rng.lognormal(-1.5, 1, n), rng.lognormal(-4, 0.5, 5 * n), rng.lognormal(0.5, 0.6, n)
        for x in ttft:
            v.ttft.labels(*lab).observe(x)
        for x in itl:
            v.itl.labels(*lab).observe(x)
        for x in e2e:
            v.e2e.labels(*lab).observe(x)
        batches.append((ttft, itl, e2e))
        if k == 2:  # the server restarts: a fresh registry holding only what came after
            v = FakeVllm()
            ttft, itl, e2e = rng.lognormal(-1.5, 1, 50), rng.lognormal(-4, 0.5, 250), rng.lognormal(0.5, 0.6, 50)
            for x in ttft:
                v.ttft.labels(*lab).observe(x)
            for x in itl:
                v.itl.labels(*lab).observe(x)
            for x in e2e:
                v.e2e.labels(*lab).observe(x)
            batches[-1] = (ttft, itl, e2e)
        scrapes.append(v.scrape(1_000_000_000 * (k + 2)))
    logs, _ = load([write_scrapes(tmp_path / "a.jsonl", scrapes, "a")])
    df = engine_latency_frame(logs)
    assert list(df["ts_ns"]) == [s.ts_ns for s in scrapes[1:]]
    assert list(df["start_ns"]) == [s.ts_ns for s in scrapes[:-1]]
    assert set(df["node"]) == {"a"}
    for k, (ttft, itl, e2e) in enumerate(batches):
        row = df.iloc[k]
        assert row["requests"] == len(e2e)  # never negative, also after the restart
        for col, obs, bounds in (("ttft", ttft, TTFT_BUCKETS), ("inter_token", itl, ITL_BUCKETS),
                                 ("e2e", e2e, E2E_BUCKETS)):
            for q in (0.5, 0.99):
                got = row[f"{col}_p{q * 100:g}_s"]
                if len(obs) == 0:
                    assert math.isnan(got)
                else:
                    assert got == pytest.approx(histogram_quantile(q, cumulative(obs, bounds)))
    assert df["queue_p50_s"].isna().all()  # declared, never observed


def test_engine_latency_frame_several_nodes_and_none_without_histograms(tmp_path):
    a, b = FakeVllm(), FakeVllm()
    scr_a, scr_b = [a.scrape(10)], [b.scrape(11)]
    for x in (0.02, 0.03, 0.2):
        a.ttft.labels("m", "0").observe(x)
    b.ttft.labels("m", "0").observe(4.0)
    scr_a.append(a.scrape(20))
    scr_b.append(b.scrape(21))
    logs, _ = load([write_scrapes(tmp_path / "a.jsonl", scr_a, "a"),
                    write_scrapes(tmp_path / "b.jsonl", scr_b, "b")])
    df = engine_latency_frame(logs).set_index("node")
    assert df.loc["a", "ttft_p50_s"] == pytest.approx(histogram_quantile(0.5, cumulative([0.02, 0.03, 0.2], TTFT_BUCKETS)))
    assert df.loc["b", "ttft_p50_s"] == pytest.approx(2.5 + 2.5 * 0.5)  # alone in (2.5, 5]
    plain = EngineMetrics(ts_ns=1, kv_cache_usage=0.1)
    logs, _ = load([write_scrapes(tmp_path / "c.jsonl", [plain, plain], "c")])
    assert engine_latency_frame(logs) is None


# ---------------------------------------------------------------- the report


def test_report_plots_the_engine_latency(tmp_path):
    """A log of vLLM scrapes only (as `kvdiag attach` records): the latency section charts the
    engine's P50/P99, each point the quantile of what was observed between two scrapes."""
    from kvdiag.cli import main
    from kvdiag.reports.document import Absent, Chart
    from kvdiag.reports.sections import build
    rng = np.random.default_rng(11)
    v = FakeVllm()
    scrapes, batches = [v.scrape(10**9)], []
    for k in range(3):
        ttft, itl = rng.lognormal(-1.5, 1, 100), rng.lognormal(-4, 0.5, 400)
        for x in ttft:
            v.ttft.labels("m", "0").observe(x)
        for x in itl:
            v.itl.labels("m", "0").observe(x)
        batches.append((ttft, itl))
        scrapes.append(v.scrape(10**9 * (k + 2)))
    log = write_scrapes(tmp_path / "vllm.jsonl", scrapes, "vllm-node")
    logs, _ = load([log])
    report, _ = build(logs)
    sec = next(s for s in report.sections if s.key == "latency")
    chart = next(b for b in sec.blocks if isinstance(b, Chart) and b.title.startswith("Engine-reported"))
    # every latency figure is there; only the KV bandwidth item (the P99 checklist's) lacks
    # its data: scrapes carry no KV blocks
    assert [b.what for b in sec.blocks if isinstance(b, Absent)] == [
        "KV bandwidth (engine steps with KV block events or pool samples)"]
    for k, (ttft, itl) in enumerate(batches):
        at = chart.data[np.isclose(chart.data["time_s"], k + 1)].set_index("series")["ms"]
        for series, obs, bounds, q in (("TTFT P50", ttft, TTFT_BUCKETS, 0.5), ("TTFT P99", ttft, TTFT_BUCKETS, 0.99),
                                       ("inter-token P50", itl, ITL_BUCKETS, 0.5),
                                       ("inter-token P99", itl, ITL_BUCKETS, 0.99)):
            assert at[series] == pytest.approx(1e3 * histogram_quantile(q, cumulative(obs, bounds)))
    for out in ("r.md", "r.html"):
        assert main(["report", str(log), "-o", str(tmp_path / out)]) == 0
    md = (tmp_path / "r.md").read_text()
    body = md.split("## Latency and P99 regressions\n", 1)[1].split("\n## ", 1)[0]
    assert "Engine-reported TTFT and inter-token latency" in body
    assert [line for line in body.splitlines() if "Not in these logs" in line] == [
        "> Not in these logs: KV bandwidth (engine steps with KV block events or pool samples)."]
    assert "Engine-reported TTFT" in (tmp_path / "r.html").read_text()
