"""`kvdiag top --pid` on an SGLang or TensorRT-LLM server without the kvdiag agent: attach's
outside collectors as top's live source (kvdiag.live.outside_sources.OutsideSource).

The server is a stand-in: a process whose command line is the engine's (a script named
``sglang`` / ``trtllm-serve``) serving, over real HTTP on a port of its own, a CONSTRUCTED
exposition in that engine's metric names (tests/data/engine_metrics, README there), re-read
from a file at every GET so that the test moves the counters between the join and a later
scrape. Expected figures are read here with prometheus_client's parser (the counters and
gauges) or computed by hand (the histogram quantiles, README).
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdiag.live.outside_sources import OutsideSource
from kvdiag.live.state import LiveState
from kvdiag.events.schema import EngineMetrics

DATA = Path(__file__).parent.parent / "data" / "engine_metrics"

# engine -> (script name, prompt-token counter, cached-token counter, usage gauge, pool blocks)
ENGINES = {
    "sglang": ("sglang", "sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:token_usage",
               32768 // 16),
    "trtllm": ("trtllm-serve", "trtllm_prompt_tokens_total", "trtllm_prompt_cached_tokens_total",
               "trtllm_kv_cache_utilization", 1024),
}
P50_S, P99_S = 0.3, 0.496  # ten observations in (0.1, 0.5]: 0.1 + 0.4 q (README)

SERVER = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    path = sys.argv[2]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = open(path, "rb").read() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    print(httpd.server_port, flush=True)
    httpd.serve_forever()
""")


def _value(text: str, name: str) -> float:
    """A sample summed over label sets, read with prometheus_client's parser."""
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


class FakeServer:
    """The stand-in server: ``python <tmp>/<script> serve <metrics file>``."""

    def __init__(self, tmp_path: Path, script: str, engine: str) -> None:
        self.engine = engine
        self.metrics = tmp_path / "metrics.prom"
        self.show("before")
        (tmp_path / script).write_text(SERVER)
        self.proc = subprocess.Popen([sys.executable, str(tmp_path / script), "serve", str(self.metrics)],
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def show(self, which: str) -> str:
        """Serve ``<engine>_<which>.prom`` from now on (replaced atomically); its text."""
        text = (DATA / f"{self.engine}_{which}.prom").read_text()
        tmp = self.metrics.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.metrics)
        return text

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _drain_until(source, state: LiveState, until, timeout_s: float = 30.0) -> list:
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = source.poll()
        state.feed_all(events)
        got += events
        if until(got):
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out; events so far: {[type(e).__name__ for e in got][-20:]}")


def _open(engine: str, server: FakeServer):
    """SGLang: found by its command line, its /metrics on its own port; TensorRT-LLM: given
    --metrics-url through top's own argument parser."""
    from kvdiag import cli
    from kvdiag.commands import top

    if engine == "sglang":
        from kvdiag.live.pid_source import attach
        return attach(server.proc.pid)
    args = cli.build_parser()[0].parse_args(["top", "--pid", str(server.proc.pid), "--metrics-url", server.url])
    return top.open_source(args)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_top_reads_an_engine_without_the_agent_from_its_metrics(engine, tmp_path):
    script, prompt, cached, usage, blocks = ENGINES[engine]
    server = FakeServer(tmp_path, script, engine)
    source = None
    try:
        source = _open(engine, server)
        assert isinstance(source, OutsideSource)
        state = LiveState(source=source.description)
        state.set_header(source.header)
        # the join: the first scrape is the baseline (its totals are the engine's whole life)
        _drain_until(source, state, lambda g: any(isinstance(e, EngineMetrics) for e in g))
        before = (DATA / f"{engine}_before.prom").read_text()
        after = server.show("after")
        _drain_until(source, state, lambda g: any(
            isinstance(e, EngineMetrics) and e.prefix_cache_queries_tokens == _value(after, prompt) for e in g))
        snap = state.snapshot(time.time_ns())
    finally:
        if source is not None:
            source.close()
        server.stop()

    assert source.header.engine == engine
    assert source.description.startswith(f"pid {server.proc.pid} outside: /metrics (since join ")
    # prefix hits: the counters' increases since the join, not their totals
    hits = _value(after, cached) - _value(before, cached)
    queries = _value(after, prompt) - _value(before, prompt)
    assert snap.sharing.engine_hit_rate == hits / queries
    assert snap.sharing.engine_hit_rate != _value(after, cached) / _value(after, prompt)
    assert snap.sharing.engine_counters_since_ns is not None
    # the pool: the usage gauge as read, over the pool the engine's gauges size
    assert snap.pool.reason == "" and snap.pool.source
    assert snap.pool.block_occupancy == _value(after, usage)
    assert snap.pool.num_blocks == blocks
    assert snap.pool.blocks_used == round(_value(after, usage) * blocks)
    # latency: the histograms' increases since the join
    assert snap.latency.reason == "" and "histograms since" in snap.latency.source
    assert snap.latency.ttft_p50_ms == pytest.approx(P50_S * 1e3)
    assert snap.latency.ttft_p99_ms == pytest.approx(P99_S * 1e3)
    assert snap.latency.queue_p50_ms == pytest.approx(P50_S * 1e3)
    if engine == "sglang":  # its inter-token histogram: 400 observations in (0.01, 0.05]
        assert snap.latency.tpot_p50_ms == pytest.approx((0.01 + 0.04 * 0.5) * 1e3)
        assert snap.pool.running_requests == 2 and snap.pool.waiting_requests == 1
        assert snap.pool.preemptions == 1  # retracted requests since the join
    else:
        assert snap.latency.tpot_p50_ms is None  # TensorRT-LLM serves no inter-token histogram
        assert snap.pool.running_requests == 3


def test_a_process_serving_no_engine_is_still_refused(tmp_path):
    """A plain process (no engine command line, no endpoint given) is not read from outside
    without --any-process."""
    from kvdiag.live.pid_source import attach
    from kvdiag.live.sources import NoEngineError

    target = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with pytest.raises(NoEngineError):
            attach(target.pid)
    finally:
        target.stdin.close()
        target.wait(10)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_ui_names_the_outside_source(tmp_path, anyio_backend):
    from kvdiag.live.pid_source import attach
    from kvdiag.tui.app import KvTopApp

    server = FakeServer(tmp_path, "sglang", "sglang")
    source = attach(server.proc.pid)
    app = KvTopApp(source, interval_s=0.2)
    try:
        async with app.run_test(size=(140, 40)) as pilot:
            def shown(what: str) -> bool:
                return app.snapshot is not None and what in str(app.status_line.render())
            for _ in range(300):
                if shown("outside: /metrics"):
                    break
                await pilot.pause(0.05)
            server.show("after")
            for _ in range(300):
                if app.snapshot is not None and app.snapshot.sharing.engine_hit_rate is not None:
                    break
                await pilot.pause(0.05)
            status = str(app.status_line.render())
            assert f"pid {server.proc.pid} outside: /metrics (since join" in status
            assert "sglang" in status
            assert "from engine /metrics: KV cache usage gauge" in str(app.query_one("#poolpanel").render())
            assert "768/2048" in str(app.query_one("#poolpanel").render())
            assert "engine /metrics counters since join" in str(app.query_one("#sharingpanel").render())
            assert "from engine /metrics histograms since" in str(app.query_one("#latencypanel").render())
    finally:
        source.close()
        server.stop()


def test_the_exporter_serves_the_engine_gauges_without_the_agent():
    """attach --prometheus on a server without the agent: the exporter reads the same fold,
    the usage gauge as occupancy and the requests' blocks, the free blocks unknown."""
    from kvdiag.collectors.metrics import engine_metrics, parse_prometheus
    from kvdiag.events.eventlog import make_header
    from kvdiag.prometheus.exporter import PrometheusSink

    sink = PrometheusSink(make_header(engine="sglang", model="m", node="n"))
    for i, which in enumerate(("before", "after")):
        sink.record(engine_metrics(parse_prometheus((DATA / f"sglang_{which}.prom").read_text()),
                                   ts_ns=(i + 1) * 10**9))
    families = {f.name: f.samples for f in sink.collect()}
    sink.close()
    assert families["kvdiag_kv_block_occupancy_ratio"][0].value == 0.375
    blocks = {smp.labels.get("kind", smp.labels.get("state")): smp.value for smp in families["kvdiag_kv_blocks"]}
    assert blocks == {"requests": 768}
