"""Prometheus text exposition (``/metrics``): parsed by prometheus_client's parser, and a
scraper mapping the engine's metrics onto ``EngineMetrics`` (vLLM, SGLang and TensorRT-LLM
names; every other sample stays in ``raw``)."""

from __future__ import annotations

import http.client
import math
import time
import urllib.request
from dataclasses import dataclass
from typing import Iterable, Optional

from prometheus_client.parser import text_string_to_metric_families

from kvdiag.events.schema import INT64_MAX, EngineMetrics


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
        except Exception as line_exc:
            why = f" ({line_exc})" if str(line_exc) else ""
            return (f"line {lineno}: expected 'name{{labels}} value' or a # HELP/# TYPE line, "
                    f"got {line[:80]!r}{why}")
    return f"expected a Prometheus text exposition ({exc or type(exc).__name__})"


def parse_prometheus(text: str) -> list[MetricSample]:
    """The samples of a text exposition, read by ``prometheus_client.parser``; names as exposed
    (``x_total``, ``x_bucket`` with its ``le`` label, ``x_created``), labels in their order,
    HELP/TYPE lines and timestamps dropped. That parser names the samples of a counter declared
    without ``_total`` with it. Values may be NaN or infinite (Prometheus allows them):
    :func:`engine_metrics` keeps only finite ones. Raises :class:`PrometheusParseError` naming
    the line."""
    try:
        return _parse(text)
    except Exception as exc:  # the parser raises ValueError, and on some garbage others
        raise PrometheusParseError(_locate(text, exc)) from None


# first matching name wins; sums over label sets (e.g. several model names or engines). vLLM
# (vllm:*), SGLang (sglang:*, its scheduler's collector) and TensorRT-LLM (trtllm_*, its
# MetricsCollector) names; SGLang and TensorRT-LLM count prefix-cache queries as prompt tokens
_FIELDS: dict[str, tuple[str, ...]] = {
    "prefix_cache_queries_tokens": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total",
                                    "sglang:prompt_tokens_total", "trtllm_prompt_tokens_total"),
    "prefix_cache_hits_tokens": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total",
                                 "sglang:cached_tokens_total", "trtllm_prompt_cached_tokens_total"),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                       "trtllm_kv_cache_utilization"),
    "num_preemptions": ("vllm:num_preemptions_total", "sglang:num_retracted_requests_total",
                        "sglang:num_retracted_reqs"),
    "num_requests_running": ("vllm:num_requests_running", "sglang:num_running_reqs",
                             "trtllm_num_requests_running"),
    "num_requests_waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "trtllm_num_requests_waiting"),
    "prompt_tokens": ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total", "trtllm_prompt_tokens_total"),
    "generation_tokens": ("vllm:generation_tokens_total", "sglang:generation_tokens_total",
                          "trtllm_generation_tokens_total"),
}

# EngineMetrics.histograms keys -> histogram names, first present wins. vLLM before 0.11 called
# its inter-token histogram time_per_output_token (SGLang's of that name is per request: not used)
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft_s": ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds",
               "trtllm_time_to_first_token_seconds"),
    "inter_token_s": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
                      "sglang:inter_token_latency_seconds"),
    "e2e_s": ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds",
              "trtllm_e2e_request_latency_seconds"),
    "queue_s": ("vllm:request_queue_time_seconds", "sglang:queue_time_seconds",
                "trtllm_request_queue_time_seconds"),
}

CACHE_CONFIG_INFO = "vllm:cache_config_info"


def _series_key(s: MetricSample) -> str:
    if not s.labels:
        return s.name
    return s.name + "{" + ",".join(f'{k}="{v}"' for k, v in s.labels) + "}"


def _histogram(buckets: list[MetricSample]) -> list[tuple[float, float]]:
    """Cumulative ``(le, count)`` of one histogram's ``_bucket`` samples summed over label sets
    (what PromQL's ``sum by (le)`` does), sorted by ``le``, +Inf as ``EngineMetrics.INF_LE``."""
    by_le: dict[float, float] = {}
    for s in buckets:
        try:
            le = float(dict(s.labels)["le"])  # "+Inf" -> inf
        except (KeyError, ValueError):
            continue  # without a numeric le it is not a bucket
        if math.isnan(le) or le == -math.inf or not math.isfinite(s.value) or s.value < 0:
            continue  # not a bucket a histogram can have: no place to put it
        by_le[le] = by_le.get(le, 0.0) + s.value
    return [(EngineMetrics.INF_LE if le == math.inf else le, c) for le, c in sorted(by_le.items())]


def _int(text: Optional[str]) -> Optional[int]:
    """A count from a label: 0..2^63-1, else None (vLLM writes "None" before the pool is
    sized)."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        return None
    return value if 0 <= value <= INT64_MAX else None


def _bool(text: Optional[str]) -> Optional[bool]:
    low = (text or "").strip().lower()
    return True if low in ("true", "1") else False if low in ("false", "0") else None


def _cache_config(samples: list[MetricSample]) -> dict:
    """block_size_tokens, num_blocks and prefix_caching from vLLM's cache_config_info labels
    (one label set per engine: blocks are summed, the block size and flag taken from the first)."""
    infos = [dict(s.labels) for s in samples if s.name == CACHE_CONFIG_INFO]
    if not infos:
        return _gauge_cache_config(samples)
    blocks = [_int(i.get("num_gpu_blocks")) for i in infos]
    total = sum(blocks) if None not in blocks else None
    return {"block_size_tokens": _int(infos[0].get("block_size")),
            "num_blocks": total if total is None or total <= INT64_MAX else None,
            "prefix_caching": _bool(infos[0].get("enable_prefix_caching"))}


def _gauge_cache_config(samples: list[MetricSample]) -> dict:
    """block_size_tokens and num_blocks from gauges: TensorRT-LLM's
    ``trtllm_kv_cache_tokens_per_block`` and ``trtllm_kv_cache_max_blocks``; SGLang's
    ``sglang:page_size`` and ``sglang:max_total_num_tokens`` (blocks: tokens // page size)."""
    first = {}
    for smp in samples:
        if math.isfinite(smp.value) and smp.value >= 0:
            first.setdefault(smp.name, int(smp.value))
    if "trtllm_kv_cache_tokens_per_block" in first or "trtllm_kv_cache_max_blocks" in first:
        return {"block_size_tokens": first.get("trtllm_kv_cache_tokens_per_block") or None,
                "num_blocks": first.get("trtllm_kv_cache_max_blocks")}
    page = first.get("sglang:page_size")
    if page:
        tokens = first.get("sglang:max_total_num_tokens")
        return {"block_size_tokens": page, "num_blocks": None if tokens is None else tokens // page}
    return {}


def engine_metrics(samples: Iterable[MetricSample], ts_ns: Optional[int] = None) -> EngineMetrics:
    """Map known engine metrics onto ``EngineMetrics`` fields (summed over label sets), the
    cache config from ``vllm:cache_config_info``'s labels, and the latency histograms in
    :data:`HISTOGRAMS`; ``raw`` keeps every sample except histogram buckets and ``_created``."""
    samples = list(samples)
    by_name: dict[str, float] = {}
    for s in samples:
        by_name[s.name] = by_name.get(s.name, 0.0) + s.value
    fields = {}
    for field, names in _FIELDS.items():
        # the parser adds _total to the samples of a counter declared without it
        found = [n for name in names for n in (name, name + "_total") if n in by_name]
        if found and math.isfinite(by_name[found[0]]):  # NaN/Inf gauges: not a value to keep
            fields[field] = by_name[found[0]]
    buckets: dict[str, list[MetricSample]] = {}
    for s in samples:
        if s.name.endswith("_bucket"):
            buckets.setdefault(s.name[:-len("_bucket")], []).append(s)
    histograms = {}
    for key, names in HISTOGRAMS.items():
        for name in names:
            if name in buckets and (h := _histogram(buckets[name])):
                histograms[key] = h
                break
    raw = {_series_key(s): s.value for s in samples
           if not s.name.endswith(("_bucket", "_created")) and math.isfinite(s.value)}
    return EngineMetrics(ts_ns=ts_ns or time.time_ns(), raw=raw, histograms=histograms,
                         **fields, **_cache_config(samples))


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
        except (OSError, ValueError, http.client.HTTPException):
            continue
    return None


def scrape_into(url: str, sink, timeout_s: float = 2.0) -> bool:
    """GET ``url`` once and record its ``EngineMetrics`` into ``sink``; a failure is recorded as
    a ``CollectorError`` (never raised). True when the scrape succeeded."""
    from kvdiag.events.schema import CollectorError

    try:
        sink.record(engine_metrics(parse_prometheus(fetch_metrics_text(url, timeout_s))))
        return True
    except (OSError, ValueError, http.client.HTTPException) as exc:
        sink.record(CollectorError(ts_ns=time.time_ns(), collector="metrics",
                                   message=str(exc) or type(exc).__name__))
        return False
