"""The Grafana dashboard of kvdiag's Prometheus metrics, generated from :mod:`kvdiag.prometheus.metrics`.

``docs/grafana-dashboard.json`` is this module's output (a test compares the two, checks that
every metric a panel queries is in the table, and that a real Prometheus accepts every query):

    python -m kvdiag.prometheus.dashboard > docs/grafana-dashboard.json

Variables: ``datasource`` (any Prometheus) and ``node`` (multi-select, with All, from
``label_values(kvdiag_events_total, node)``). Every query selects ``node=~"$node"`` and keeps
the ``node`` label, so each panel plots one series per node.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Optional

from kvdiag.prometheus.metrics import BY_NAME

UID = "kvdiag-fleet"
SEL = 'node=~"$node"'
NODE_QUERY = "label_values(kvdiag_events_total, node)"


def _q(name: str) -> str:
    """A gauge on the selected nodes, one series per node (and per its own labels)."""
    assert name in BY_NAME, name
    return f"{name}{{{SEL}}}"


def _rate(name: str, by: str = "") -> str:
    assert name in BY_NAME and BY_NAME[name].type == "counter", name
    return f"sum by (node{', ' + by if by else ''}) (rate({name}{{{SEL}}}[$__rate_interval]))"


def _quantile(q: float, name: str) -> str:
    assert name in BY_NAME and BY_NAME[name].type == "histogram", name
    return (f"histogram_quantile({q}, sum by (node, le) "
            f"(rate({name}_bucket{{{SEL}}}[$__rate_interval])))")


def _window_ratio(numerator: str, denominator: str, window: str = "10m") -> str:
    """sum over the window of one gauge / of another (the fragmentation alert's measure)."""
    return f"sum_over_time({_q(numerator)}[{window}]) / sum_over_time({_q(denominator)}[{window}])"


N = "{{node}}"

# (row title, [(panel title, unit, [(expr, legend), ...]), ...])
ROWS: tuple = (
    ("KV pool", [
        ("KV bytes by state", "bytes", [(_q("kvdiag_kv_bytes"), N + " {{state}}")]),
        ("KV blocks by state", "short", [(_q("kvdiag_kv_blocks"), N + " {{state}}")]),
        ("Block and token occupancy", "percentunit", [
            (_q("kvdiag_kv_block_occupancy_ratio"), N + " blocks"),
            (_q("kvdiag_kv_token_occupancy_ratio"), N + " tokens")]),
        ("Fragmentation", "percentunit", [
            (_q("kvdiag_kv_pool_fragmentation_ratio"), N + " KV pool"),
            (_window_ratio("kvdiag_kv_empty_slots_tokens", "kvdiag_kv_token_slots_tokens"),
             N + " KV pool, 10m (the alert's)"),
            (_q("kvdiag_allocator_fragmentation_ratio"), N + " allocator")]),
        ("KV demand of active requests", "short", [
            (_q("kvdiag_kv_demand_needed_blocks"), N + " needed"),
            (_q("kvdiag_kv_demand_free_blocks"), N + " free")]),
        ("KV pressure (needed / free)", "percentunit", [(_q("kvdiag_kv_pressure_ratio"), N)]),
        ("Requests running / waiting", "short", [
            (_q("kvdiag_requests_running"), N + " running"),
            (_q("kvdiag_requests_waiting"), N + " waiting")]),
        ("Finished requests still holding blocks", "short", [
            (_q("kvdiag_finished_requests_holding_blocks"), N + " requests"),
            (_q("kvdiag_finished_requests_held_blocks"), N + " blocks")]),
        ("Bad block events /s", "short", [
            (_rate("kvdiag_kv_block_anomalies_total"), N + " {{kind}}")]),
        ("Preemptions and finished requests /s", "reqps", [
            (_rate("kvdiag_request_preemptions_total"), N + " preempted"),
            (_rate("kvdiag_requests_finished_total"), N + " finished")]),
    ]),
    ("Prefix sharing", [
        ("Engine vs content hit ratio", "percentunit", [
            (_q("kvdiag_prefix_engine_hit_ratio"), N + " engine"),
            (_q("kvdiag_prefix_content_hit_ratio"), N + " content")]),
        ("Hit ratio gap (content - engine)", "percentunit", [
            (_q("kvdiag_prefix_hit_ratio_gap"), N + " gap"),
            (_q("kvdiag_prefix_hit_ratio_gap_unexplained"), N + " unexplained (judged)")]),
        ("What-if hit ratios (shadow caches)", "percentunit", [
            (_q("kvdiag_shadow_token_hit_ratio"),
             N + " {{policy}} bs={{block_size}} cap={{capacity}}")]),
        ("Missed prompt tokens by cause (per second)", "short", [
            (_rate("kvdiag_prompt_tokens_missed_total", "cause"), N + " {{cause}}")]),
        ("Hit ratio at capacity (x the pool)", "percentunit", [
            (_q("kvdiag_prefix_hit_ratio_at_capacity"), N + " {{tier}} {{multiple}}x")]),
    ]),
    ("Latency", [
        ("TTFT P50 / P99", "s", [
            (_quantile(0.5, "kvdiag_request_ttft_seconds"), N + " P50"),
            (_quantile(0.99, "kvdiag_request_ttft_seconds"), N + " P99")]),
        ("Inter-token P50 / P99", "s", [
            (_quantile(0.5, "kvdiag_request_inter_token_seconds"), N + " P50"),
            (_quantile(0.99, "kvdiag_request_inter_token_seconds"), N + " P99")]),
    ]),
    ("Compression and locality", [
        ("Compression ratio", "short", [
            (_q("kvdiag_compression_ratio"), N + " {{method}} {{layers}}")]),
        ("Compression K/V error", "percentunit", [
            (_q("kvdiag_compression_error_ratio"), N + " {{method}} {{layers}}")]),
        ("Compression attention-output error", "percentunit", [
            (_q("kvdiag_compression_attn_out_error_ratio"),
             N + " {{method}} {{layers}}")]),
        ("Attention mass: recent window / sinks", "percentunit", [
            (_q("kvdiag_attention_recent_mass_ratio"), N + " recent L{{layer}}"),
            (_q("kvdiag_attention_sink_mass_ratio"), N + " sink L{{layer}}")]),
        ("Attention entropy", "short", [
            (_q("kvdiag_attention_entropy_nats"), N + " L{{layer}}")]),
    ]),
    ("Memory", [
        ("GPU memory", "bytes", [
            (_q("kvdiag_gpu_memory_used_bytes"), N + " used"),
            (_q("kvdiag_gpu_memory_total_bytes"), N + " total"),
            (_q("kvdiag_gpu_process_memory_bytes"), N + " process")]),
        ("CUDA caching allocator", "bytes", [
            (_q("kvdiag_allocator_reserved_bytes"), N + " reserved"),
            (_q("kvdiag_allocator_allocated_bytes"), N + " allocated")]),
        ("Host RSS", "bytes", [(_q("kvdiag_host_rss_bytes"), N)]),
        ("KV read bandwidth demanded / measured copy bandwidth", "Bps", [
            (f"sum by (node) (rate(kvdiag_kv_read_bytes_total{{{SEL}}}[$__rate_interval])) / "
             f"sum by (node) (rate(kvdiag_kv_read_step_seconds_total{{{SEL}}}[$__rate_interval]))",
             N + " KV read demanded"),
            (_q("kvdiag_memory_copy_bandwidth_bytes_per_second"), N + " copy (probe)")]),
    ]),
    ("Collector health", [
        ("Events /s", "short", [(_rate("kvdiag_events_total"), N)]),
        ("Events dropped /s", "short", [(_rate("kvdiag_collector_events_dropped_total"), N)]),
        ("Collector errors /s", "short", [
            (_rate("kvdiag_collector_errors_total", "collector"), N + " {{collector}}")]),
        ("Shadow budget used", "percentunit", [(_q("kvdiag_shadow_budget_used_ratio"), N)]),
        ("Shadow decode steps /s and shadow time", "short", [
            (_rate("kvdiag_shadow_steps_offered_total"), N + " offered"),
            (_rate("kvdiag_shadow_steps_sampled_total"), N + " sampled"),
            (_rate("kvdiag_shadow_steps_skipped_budget_total"), N + " skipped (budget)"),
            (_rate("kvdiag_shadow_seconds_total"), N + " shadow s/s")]),
        ("Engine KV-event stream /s", "short", [
            (_rate("kvdiag_kv_event_batches_total"), N + " batches"),
            (_rate("kvdiag_kv_event_stream_problems_total", "check"), N + " {{check}}")]),
    ]),
)

_DS = {"type": "prometheus", "uid": "${datasource}"}


def _panel(pid: int, title: str, unit: str, targets: list, x: int, y: int) -> dict:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": _DS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"datasource": _DS, "expr": expr, "legendFormat": legend,
                     "refId": chr(ord("A") + i)} for i, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict:
    """The dashboard as Grafana's JSON model (one row per group, two panels per line)."""
    panels, pid, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, targets) in enumerate(row_panels):
            panels.append(_panel(pid, title, unit, targets, 12 * (i % 2), y + 8 * (i // 2)))
            pid += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "uid": UID,
        "title": "kvdiag: KV cache across nodes",
        "description": "Generated by `python -m kvdiag.prometheus.dashboard` from kvdiag/prometheus/metrics.py.",
        "tags": ["kvdiag"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": "",
             "options": []},
            {"name": "node", "label": "Node", "type": "query", "datasource": _DS,
             "query": {"query": NODE_QUERY, "refId": "node"}, "definition": NODE_QUERY,
             "multi": True, "includeAll": True, "allValue": ".*", "current": {}, "hide": 0,
             "refresh": 2, "regex": "", "sort": 1, "options": []},
        ]},
        "panels": panels,
    }


def exprs() -> list[str]:
    """Every panel query, in panel order."""
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The kvdiag metrics an expression reads (histogram series by their base name)."""
    return {re.sub(r"_(bucket|count|sum)$", "", n) if n.startswith("kvdiag_request_") and "_seconds_" in n
            else n for n in re.findall(r"\bkvdiag_[a-z0-9_]+", expr)}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    if (sys.argv[1:] if argv is None else argv):
        print("usage: python -m kvdiag.prometheus.dashboard > docs/grafana-dashboard.json", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
