"""docs/grafana-dashboard.json: generated from the metric table, its variables, and every panel
query accepted by a real Prometheus scraping exporters fed by recorded logs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.prometheus.dashboard import dashboard, exprs, metric_names, render
from kvdiag.prometheus.metrics import BY_NAME
from tests.prometheus_server import replaying, running
from waiting import wait_for

NODES = ("node-a", "node-b")
ROOT = Path(__file__).resolve().parents[2]
LOGS = (ROOT / "tests/data/demo_small/demo_24req_seed1.kvlog.gz",
        ROOT / "tests/data/vllm_demo/demo_16req_seed1.kvlog.gz")


def _panels():
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def _rows() -> dict[str, list[dict]]:
    rows, current = {}, None
    for p in dashboard()["panels"]:
        if p["type"] == "row":
            current = rows.setdefault(p["title"], [])
        else:
            current.append(p)
    return rows


def _for_prometheus(expr: str) -> str:
    """A panel query as Grafana sends it with node = All."""
    return expr.replace("$node", ".*").replace("$__rate_interval", "5m")


def test_committed_dashboard_is_the_generators_output():
    generated = subprocess.run([sys.executable, "-m", "kvdiag.prometheus.dashboard"], capture_output=True,
                               text=True, check=True, timeout=120).stdout
    assert generated == render()
    assert (ROOT / "docs/grafana-dashboard.json").read_text() == generated


def test_panels_read_only_documented_metrics_and_cover_the_table():
    read = set()
    for expr in exprs():
        names = metric_names(expr)
        assert names and names <= set(BY_NAME), (expr, names - set(BY_NAME))
        assert 'node=~"$node"' in expr, expr
        read |= names
    assert read == set(BY_NAME)


def test_dashboard_model_variables_and_layout():
    d = json.loads(render())
    assert d["schemaVersion"] == 39
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    node = variables["node"]
    assert node["query"]["query"] == "label_values(kvdiag_events_total, node)"
    assert node["multi"] and node["includeAll"]
    assert node["datasource"]["uid"] == "${datasource}"
    assert list(_rows()) == ["KV pool", "Prefix sharing", "Latency", "Compression and locality",
                             "Memory", "Collector health"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in _panels():
        assert p["type"] == "timeseries" and p["targets"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):  # no two panels overlap
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))
        for t in p["targets"]:
            assert t["legendFormat"].startswith("{{node}}")
    latency = [t["expr"] for p in _rows()["Latency"] for t in p["targets"]]
    assert all(e.startswith("histogram_quantile(") and "_bucket{" in e and "by (node, le)" in e
               for e in latency)


@pytest.fixture
def exporters():
    with replaying(LOGS, NODES) as started:  # recorded on the same host: told apart by node
        yield started


def test_real_prometheus_accepts_every_panel_query(exporters, tmp_path):
    targets = [f"127.0.0.1:{e.port}" for e in exporters]
    with running(tmp_path, targets) as prom:
        # two scrapes of each target, so that rate() over them has two samples
        wait_for(lambda: len(prom.query("count_over_time(kvdiag_events_total[5m]) >= 2"))
                 == len(targets), 60, "two scrapes of every exporter", poll_s=0.2, ignore=(OSError,))
        results = {}
        for expr in exprs():
            body = prom.response(_for_prometheus(expr))
            assert body["status"] == "success", (expr, body)
            results[expr] = body["data"]["result"]
        served = set().union(*(metric_names(r["metric"]["__name__"])
                               for r in prom.query('{__name__=~"kvdiag_.*"}')))
        for panel in _panels():  # a panel shows data exactly when a metric it reads is served
            reads = set().union(*(metric_names(t["expr"]) for t in panel["targets"]))
            got = [r for t in panel["targets"] for r in results[t["expr"]]]
            assert bool(got) == bool(reads & served), (panel["title"], reads & served)
        shown = {p["title"] for p in _panels() if any(results[t["expr"]] for t in p["targets"])}
        assert {"KV bytes by state", "KV blocks by state", "Block and token occupancy",
                "Engine vs content hit ratio", "Hit ratio gap (content - engine)",
                "What-if hit ratios (shadow caches)", "TTFT P50 / P99"} <= shown
        # the pool's bytes come from both nodes, each with its three states
        (kv_bytes,) = [t["expr"] for p in _panels() for t in p["targets"] if "kvdiag_kv_bytes" in t["expr"]]
        assert {(r["metric"]["node"], r["metric"]["state"]) for r in results[kv_bytes]} == {
            (n, s) for n in NODES for s in ("requests", "prefix_cache", "free")}
        # a query Prometheus rejects is told apart (the check above is not vacuous)
        assert prom.response("histogram_quantile(0.5, kvdiag_kv_bytes[5m])")["status"] == "error"
