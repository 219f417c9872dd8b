"""A real Prometheus scrapes kvdiag exporters fed by recorded logs; its query API returns the
documented metrics with the values computed here, independently, from the same logs."""

import os
from pathlib import Path

import pytest

from kvdiag.events import schema as s
from kvdiag.events.eventlog import iter_events, read_header
from kvdiag.prometheus.metrics import BY_NAME
from tests.prometheus_server import replaying, running
from waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
DEMO_LOG = ROOT / "tests/data/demo_small/demo_24req_seed1.kvlog.gz"
VLLM_LOG = ROOT / "tests/data/vllm_demo/demo_16req_seed1.kvlog.gz"


def _expected(path: Path) -> dict:
    """What the log says, computed without kvdiag's live state."""
    events = list(iter_events(path))
    info = [e for e in events if isinstance(e, s.KVPoolInfo)][-1]
    last = [e for e in events if isinstance(e, s.KVPoolSample)][-1]
    done = [e for e in events if isinstance(e, s.RequestFinished) and e.status == "finished"]
    blocks = {"requests": last.blocks_used, "prefix_cache": last.blocks_cached,
              "free": last.num_blocks - last.blocks_used - last.blocks_cached}
    out = {
        "blocks": blocks,
        "bytes": {k: v * info.block_bytes for k, v in blocks.items()},
        "engine_hit": sum(e.cached_prompt_tokens for e in done) / sum(e.prompt_tokens for e in done),
        "finished": len([e for e in events if isinstance(e, s.RequestFinished)]),
        "ttft_count": len([e for e in done if e.ttft_ns is not None]),
        "events": len(events),
    }
    shadow = {}
    for e in events:
        if isinstance(e, s.ShadowSharing):
            shadow[(e.policy, str(e.block_size_tokens),
                    str(e.capacity_blocks) if e.capacity_blocks is not None else "unbounded")] = e.token_hit_rate
    if shadow:
        out["shadow"] = shadow
        # the engine's configuration: its block size and pool size, LRU
        out["content_hit"] = shadow[("lru", str(info.block_size_tokens), str(info.num_blocks))]
    return out


def _values(prom, expr: str, label: str = "") -> dict:
    return {(r["metric"].get(label) if label else None): float(r["value"][1]) for r in prom.query(expr)}


@pytest.fixture
def exporters():
    with replaying([DEMO_LOG, VLLM_LOG]) as started:
        yield started


def test_real_prometheus_scrapes_the_documented_metrics(exporters, tmp_path):
    targets = [f"127.0.0.1:{e.port}" for e in exporters]
    with running(tmp_path, targets) as prom:
        for target in targets:  # both scraped at least once
            wait_for(lambda: prom.query(f'kvdiag_events_total{{instance="{target}"}}'), 60,
                     f"a scrape of {target}", poll_s=0.2, ignore=(OSError,))
        ups = _values(prom, "up", "instance")
        assert ups == {t: 1.0 for t in targets}
        for path, target in zip((DEMO_LOG, VLLM_LOG), targets):
            want = _expected(path)
            sel = f'instance="{target}"'
            assert _values(prom, f"kvdiag_kv_blocks{{{sel}}}", "state") == want["blocks"]
            assert _values(prom, f"kvdiag_kv_bytes{{{sel}}}", "state") == want["bytes"]
            (hit,) = _values(prom, f"kvdiag_prefix_engine_hit_ratio{{{sel}}}").values()
            assert hit == pytest.approx(want["engine_hit"], abs=1e-12)
            assert _values(prom, f"kvdiag_requests_finished_total{{{sel}}}") == {None: want["finished"]}
            assert _values(prom, f"kvdiag_events_total{{{sel}}}") == {None: want["events"]}
            ttft = {None: want["ttft_count"]} if want["ttft_count"] else {}  # no TTFT in the log: absent
            assert _values(prom, f"kvdiag_request_ttft_seconds_count{{{sel}}}") == ttft
            labels = prom.query(f"kvdiag_events_total{{{sel}}}")[0]["metric"]
            header = read_header(path)
            # a local model folder is labelled by its name (its path differs from node to node)
            assert (labels["node"], labels["engine"], labels["model"]) == (
                header.node, header.engine, os.path.basename(header.model))
            if "shadow" not in want:  # the transformers demo log has no shadow cache: absent, not 0
                assert prom.query(f"kvdiag_prefix_content_hit_ratio{{{sel}}}") == []
                assert prom.query(f"kvdiag_shadow_token_hit_ratio{{{sel}}}") == []
                continue
            (content,) = _values(prom, f"kvdiag_prefix_content_hit_ratio{{{sel}}}").values()
            assert content == pytest.approx(want["content_hit"], abs=1e-12)
            (gap,) = _values(prom, f"kvdiag_prefix_hit_ratio_gap{{{sel}}}").values()
            assert gap == pytest.approx(want["content_hit"] - want["engine_hit"], abs=1e-12)
            what_if = {(r["metric"]["policy"], r["metric"]["block_size"], r["metric"]["capacity"]):
                       float(r["value"][1]) for r in prom.query(f"kvdiag_shadow_token_hit_ratio{{{sel}}}")}
            assert what_if == pytest.approx(want["shadow"], abs=1e-12)
        # every series Prometheus stored is documented in the table
        names = {r["metric"]["__name__"] for r in prom.query('{job="kvdiag"}')} - {
            "up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_series_added",
            "scrape_samples_post_metric_relabeling"}
        base = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
                if n.startswith("kvdiag_request_") and "seconds" in n else n for n in names}
        assert base <= set(BY_NAME), base - set(BY_NAME)
