"""Prometheus text exposition (``/metrics``): parsed by prometheus_client's parser, and a
scraper mapping the engine's metrics onto ``EngineMetrics`` (vLLM and SGLang names; every other
sample stays in ``raw``)."""

from __future__ import annotations

import math
import time
import urllib.request
from dataclasses import dataclass
from typing import Iterable, Optional

from prometheus_client.parser import text_string_to_metric_families

from kvdiag.schema import EngineMetrics


class PrometheusParseError(ValueError):
    """``line N: expected ...`` naming the first line prometheus_client's parser rejects."""


@dataclass(frozen=True, slots=True)
class MetricSample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def _parse(text: str) -> list[MetricSample]:
    return [MetricSample(s.name, tuple(s.labels.items()), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def _locate(text: str, exc: ValueError) -> str:
    """Which line made the parse fail: the first that fails on its own (the parser reads line
    by line and keeps no line numbers)."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            _parse(line + "\n")
        except ValueError as line_exc:
            why = f" ({line_exc})" if str(line_exc) else ""
            return (f"line {lineno}: expected 'name{{labels}} value' or a # HELP/# TYPE line, "
                    f"got {line[:80]!r}{why}")
    return f"expected a Prometheus text exposition ({exc or type(exc).__name__})"


def parse_prometheus(text: str) -> list[MetricSample]:
    """The samples of a text exposition, read by ``prometheus_client.parser``; names as exposed
    (``x_total``, ``x_bucket`` with its ``le`` label, ``x_created``), labels in their order,
    HELP/TYPE lines and timestamps dropped. That parser names the samples of a counter declared
    without ``_total`` with it. Raises :class:`PrometheusParseError` naming the line."""
    try:
        return _parse(text)
    except ValueError as exc:
        raise PrometheusParseError(_locate(text, exc)) from None


# first matching name wins; sums over label sets (e.g. several model names or engines)
_FIELDS: dict[str, tuple[str, ...]] = {
    "prefix_cache_queries_tokens": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits_tokens": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "num_preemptions": ("vllm:num_preemptions_total", "sglang:num_retracted_reqs"),
    "num_requests_running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "num_requests_waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
}


def _series_key(s: MetricSample) -> str:
    if not s.labels:
        return s.name
    return s.name + "{" + ",".join(f'{k}="{v}"' for k, v in s.labels) + "}"


def engine_metrics(samples: Iterable[MetricSample], ts_ns: Optional[int] = None) -> EngineMetrics:
    """Map known engine counters onto ``EngineMetrics`` fields (summed over label sets);
    ``raw`` keeps every sample except histogram buckets and info-only ``_created`` series."""
    samples = list(samples)
    by_name: dict[str, float] = {}
    for s in samples:
        by_name[s.name] = by_name.get(s.name, 0.0) + s.value
    fields = {}
    for field, names in _FIELDS.items():
        for n in names:
            if n in by_name:
                fields[field] = by_name[n]
                break
    raw = {_series_key(s): s.value for s in samples
           if not s.name.endswith(("_bucket", "_created")) and math.isfinite(s.value)}
    return EngineMetrics(ts_ns=ts_ns or time.time_ns(), raw=raw, **fields)


def fetch_metrics_text(url: str, timeout_s: float = 2.0) -> str:
    """GET ``url`` and return its body (raises OSError/ValueError on failure)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        if resp.status != 200:
            raise OSError(f"{url}: HTTP {resp.status}")
        return resp.read(8 << 20).decode("utf-8", "replace")


def find_metrics_url(candidates: Iterable[tuple[str, int]], timeout_s: float = 1.0) -> Optional[str]:
    """The first ``http://host:port/metrics`` among ``(host, port)`` that returns a parseable
    exposition with at least one sample."""
    for host, port in candidates:
        h = f"[{host}]" if ":" in host else host
        url = f"http://{h}:{port}/metrics"
        try:
            if parse_prometheus(fetch_metrics_text(url, timeout_s)):
                return url
        except (OSError, ValueError):
            continue
    return None
