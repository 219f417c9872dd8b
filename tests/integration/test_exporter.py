"""The Prometheus exporter without Prometheus: the documented table, absent metrics, the
listening address (127.0.0.1 by default) and the agent's and kvdiag.run's wiring."""

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdiag.events import schema as s
from kvdiag.agent import Agent
from kvdiag.events.eventlog import iter_events, make_header, read_header
from kvdiag.prometheus.exporter import PrometheusSink, parse_address, serve
from kvdiag.prometheus.metrics import BY_NAME, markdown
from kvdiag.run import parse_args

ROOT = Path(__file__).resolve().parents[2]
DEMO_LOG = ROOT / "tests/data/demo_small/demo_24req_seed1.kvlog.gz"


def _scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _listen_addresses(port: int) -> list[str]:
    """Local addresses of the LISTEN sockets on ``port`` (from /proc/net/tcp and tcp6)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                out.append(addr)
    return out


def test_docs_metrics_md_is_generated_from_the_table():
    generated = subprocess.run([sys.executable, "-m", "kvdiag.prometheus.exporter", "--markdown"],
                               capture_output=True, text=True, check=True, timeout=120).stdout
    assert generated == markdown()
    assert (ROOT / "docs/metrics.md").read_text() == generated


def test_names_follow_prometheus_conventions():
    for m in BY_NAME.values():
        assert m.name.startswith("kvdiag_")
        assert (m.type == "counter") == m.name.endswith("_total"), m.name
        if m.unit in ("bytes", "ratio", "seconds"):
            assert f"_{m.unit}" in m.name, m.name


def test_absent_not_zero_without_a_source():
    sink = PrometheusSink(make_header(engine="e", model="m", node="n"))
    assert list(sink.collect()) == []  # nothing seen: nothing served
    sink.record(s.RequestArrived(ts_ns=1, request_id="r", prompt_tokens=4))
    names = {f.name for f in sink.collect()}
    assert "kvdiag_events" in names  # counters are named without _total by the client
    for absent in ("kvdiag_kv_bytes", "kvdiag_prefix_engine_hit_ratio", "kvdiag_prefix_content_hit_ratio",
                   "kvdiag_kv_pool_fragmentation_ratio", "kvdiag_request_ttft_seconds",
                   "kvdiag_gpu_memory_used_bytes", "kvdiag_compression_ratio"):
        assert absent not in names


def test_default_listens_on_loopback_only():
    exporter = serve(0, read_header(DEMO_LOG))
    try:
        assert exporter.host == "127.0.0.1"
        assert _listen_addresses(exporter.port) == ["0100007F"]  # 127.0.0.1, nothing else
        for ev in iter_events(DEMO_LOG):
            exporter.sink.record(ev)
        samples = _scrape(exporter.port)
        labels = samples["kvdiag_kv_blocks"][0].labels
        assert labels["node"] == "vm" and labels["engine"] == "transformers-cb"
        assert "process_cpu_seconds" not in samples and "python_info" not in samples  # own registry
    finally:
        exporter.close()


def test_parse_address():
    assert parse_address("9400") == ("127.0.0.1", 9400)
    assert parse_address(0) == ("127.0.0.1", 0)
    assert parse_address("0.0.0.0:9400") == ("0.0.0.0", 9400)
    assert parse_address("[::1]:9400") == ("::1", 9400)
    for bad in ("x", "host:", "70000"):
        with pytest.raises(ValueError):
            parse_address(bad)


class _NoAdapter:
    def sample_now(self) -> None:
        pass

    def uninstall(self) -> None:
        pass


def test_agent_serves_what_it_records():
    agent = Agent(live=False, host_memory=False, shadow_sharing=False, prometheus="0",
                  adapter=lambda sink, **_: _NoAdapter()).start()
    try:
        assert agent.exporter.host == "127.0.0.1"
        assert _listen_addresses(agent.exporter.port) == ["0100007F"]
        agent.exporter.sink.record(s.KVPoolInfo(ts_ns=1, num_blocks=8, block_size_tokens=4, block_bytes=100,
                                                num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32",
                                                prefix_sharing=True))
        agent.exporter.sink.record(s.KVPoolSample(ts_ns=2, num_blocks=8, blocks_used=2, blocks_cached=1,
                                                  tokens_held=6, running_requests=1, waiting_requests=0))
        by_state = {x.labels["state"]: x.value for x in _scrape(agent.exporter.port)["kvdiag_kv_bytes"]}
        assert by_state == {"requests": 200, "prefix_cache": 100, "free": 500}
        port = agent.exporter.port
    finally:
        agent.stop()
    assert _listen_addresses(port) == []


def test_run_accepts_prometheus_and_rejects_a_bad_address():
    args, _ = parse_args(["--prometheus", "9400", "--", "python", "x.py"])
    assert args.prometheus == "9400"
    with pytest.raises(SystemExit):
        parse_args(["--prometheus", "nope", "--", "python", "x.py"])


def test_attach_serves_what_it_records_on_loopback(tmp_path):
    """`kvdiag attach PID --any-process --prometheus 0` on a real Python process that serves
    no engine: while attached, the endpoint (127.0.0.1 only) serves the target's RSS as the
    host view of the log records it."""
    import re
    import time

    target = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.1)"])
    log = tmp_path / "a.kvlog"
    attach = subprocess.Popen([sys.executable, "-m", "kvdiag.cli", "attach", str(target.pid), "--any-process",
                               "--no-pyspy", "--duration", "20", "--interval", "0.2", "--prometheus", "0", "--out", str(log)],
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        line = attach.stderr.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line).group(1))
        assert _listen_addresses(port) == ["0100007F"]
        deadline = time.monotonic() + 20
        while "kvdiag_host_rss_bytes" not in (metrics := _scrape(port)):
            assert time.monotonic() < deadline, "no kvdiag_host_rss_bytes while attached"
            time.sleep(0.2)
        (sample,) = metrics["kvdiag_host_rss_bytes"]
        assert sample.labels["engine"] == "attach"
        rss = sample.value
        attach.terminate()  # attach ends on SIGTERM as on Ctrl-C: the log is kept
        assert attach.wait(timeout=30) == 0
    finally:
        attach.kill()
        target.kill()
        target.wait()
    recorded = {ev.rss_bytes for ev in iter_events(log) if isinstance(ev, s.ProcessSample)}
    assert rss in recorded  # the served value is one the log recorded (one process: its RSS)
