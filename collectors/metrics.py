"""Prometheus text exposition (``/metrics``): a parser, and a scraper mapping the engine's
counters to ``EngineMetrics`` (vLLM and SGLang names; everything else stays in ``raw``)."""

from __future__ import annotations

import math
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Iterable, Optional

from kvdiag.schema import EngineMetrics


class PrometheusParseError(ValueError):
    """``line N: expected ...``."""


@dataclass(frozen=True, slots=True)
class MetricSample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LINE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _value(text: str) -> float:
    low = text.lower()
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    return float(text)  # handles NaN and exponents


def _labels(text: str, lineno: int) -> tuple[tuple[str, str], ...]:
    out, pos, text = [], 0, text.strip()
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            raise PrometheusParseError(f"line {lineno}: expected label=\"value\" at {text[pos:pos + 20]!r}")
        value = re.sub(r'\\\\|\\"|\\n', lambda x: _UNESCAPE[x.group(0)], m.group(2))
        out.append((m.group(1), value))
        pos = m.end()
    return tuple(out)


def parse_prometheus(text: str) -> list[MetricSample]:
    """Samples of a text exposition (comments and ``# HELP``/``# TYPE`` skipped); raises
    :class:`PrometheusParseError` naming the line."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise PrometheusParseError(f"line {lineno}: expected 'name{{labels}} value'")
        try:
            value = _value(m.group(3))
        except ValueError:
            raise PrometheusParseError(f"line {lineno}: expected a number, got {m.group(3)!r}") from None
        out.append(MetricSample(m.group(1), _labels(m.group(2) or "", lineno), value))
    return out


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
