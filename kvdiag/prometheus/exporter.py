"""Prometheus export of kvdiag's own metrics (the table in :mod:`kvdiag.prometheus.metrics`).

:class:`PrometheusSink` is a sink (``record``/``flush``/``close``): it folds every event into a
:class:`kvdiag.live.state.LiveState` (what ``kvdiag top`` shows) and keeps latency histograms;
at each scrape its collector takes a snapshot under the same lock and builds the metric
families. The snapshot is taken at the time of the last event folded (never going back; event
time, as ``top``), so a replayed log exports what it recorded. :func:`serve` listens on 127.0.0.1 unless a host is
given, with its own registry (none of prometheus_client's process or platform collectors).

    python -m kvdiag.prometheus.exporter --markdown > docs/metrics.md
"""

from __future__ import annotations

import bisect
import collections
import os
import sys
import threading
from typing import Iterator, Optional

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from kvdiag.events import schema as s
from kvdiag.pool import pressure
from kvdiag.live.state import LiveState
from kvdiag.prometheus.metrics import BY_NAME, COMMON_LABELS, INTER_TOKEN_BUCKETS_S, TTFT_BUCKETS_S, markdown

DEFAULT_HOST = "127.0.0.1"


class _Histogram:
    """Cumulative bucket counts and sum of observations (seconds)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += count
            out.append((bound, total))
        return out


def model_label(model: str) -> str:
    """The ``model`` label: a local model folder by its name (its absolute path would differ
    from node to node), anything else (an HF id) as given."""
    return os.path.basename(model.rstrip("/")) if os.path.isabs(model) else model


FOLD_INTERVAL_S = 1.0
"""How often queued events are folded into the state between scrapes (keeps the queue short)."""


class PrometheusSink:
    """Events in; metric families out at each scrape (``collect``). ``record`` (the engine's
    thread) only appends to a queue: a scrape, a ``flush`` and a background thread every
    :data:`FOLD_INTERVAL_S` fold the queue into the state, so a scrape never makes the engine
    wait on a lock."""

    def __init__(self, header: Optional[s.LogHeader] = None) -> None:
        self._lock = threading.Lock()
        self.state = LiveState(keep_facts_rows=False)  # no rule runs on it: no per-step rows
        self.labels = ("", "", "")
        if header is not None:
            self.set_header(header)
        self._last_ns = 0
        self.ttft = _Histogram(TTFT_BUCKETS_S)
        self.inter_token = _Histogram(INTER_TOKEN_BUCKETS_S)
        self._queue: collections.deque[s.Event] = collections.deque()
        self._stop = threading.Event()
        self._folder = threading.Thread(target=self._fold_periodically, name="kvdiag-exporter-fold",
                                        daemon=True)
        self._folder.start()

    def set_header(self, header: s.LogHeader) -> None:
        with self._lock:
            self.state.set_header(header)
            self.labels = (header.node or header.host, header.engine, model_label(header.model))

    def record(self, event: s.Event) -> None:
        self._queue.append(event)

    def _fold(self) -> None:
        """Fold the queued events into the state (under the lock; never raises)."""
        with self._lock:
            queue = self._queue
            if not queue:
                return
            pop = queue.popleft
            batch = [pop() for _ in range(len(queue))]  # record() may append meanwhile
            try:
                self.state.feed_all(batch)  # skips (and counts) events it cannot fold
                self._last_ns = max(self._last_ns, batch[-1].ts_ns)
            except Exception:
                pass
            finished = s.RequestFinished
            for event in [e for e in batch if type(e) is finished]:
                try:
                    if event.status == "finished":
                        self._observe_latency(event)
                except Exception:  # one bad event costs its own figures, not the endpoint
                    pass

    def _fold_periodically(self) -> None:
        while not self._stop.wait(FOLD_INTERVAL_S):
            self._fold()

    def _observe_latency(self, ev: s.RequestFinished) -> None:
        ttft = ev.ttft_ns
        if ttft is None:
            req = self.state.requests.finished.get(ev.request_id)
            ttft = req.ttft_ns if req is not None else None
        if ttft is None:
            return
        self.ttft.observe(ttft / 1e9)
        if ev.e2e_ns is not None and ev.output_tokens > 1:
            self.inter_token.observe((ev.e2e_ns - ttft) / (ev.output_tokens - 1) / 1e9)

    def flush(self) -> None:
        self._fold()

    def close(self) -> None:
        self._stop.set()
        self._fold()

    # ------------------------------------------------------------------ scrape

    def collect(self) -> Iterator:
        """The metric families of the state now (prometheus_client's Collector protocol)."""
        self._fold()
        with self._lock:
            if not self.state.events:
                return iter(())
            families = _Families(self.labels)
            snap = self.state.snapshot(self._last_ns)
            _pool(families, self.state, snap)
            _sharing(families, snap)
            _curves(families, snap)
            _shadow(families, snap)
            _latency(families, self)
            _memory(families, snap)
            _health(families, self.state, snap)
            return iter(families.built())


class _Families:
    """Metric families by name, created from the table on first use."""

    def __init__(self, common: tuple[str, str, str]) -> None:
        self.common = list(common)
        self.families: dict[str, object] = {}

    def _family(self, name: str):
        fam = self.families.get(name)
        if fam is None:
            d = BY_NAME[name]
            kind = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
                    "histogram": HistogramMetricFamily}[d.type]
            fam = self.families[name] = kind(name, d.help, labels=[*COMMON_LABELS, *d.labels], unit="")
        return fam

    def add(self, name: str, value, *labels: str) -> None:
        """One sample; nothing when ``value`` is None (the metric stays absent)."""
        if value is not None:
            self._family(name).add_metric([*self.common, *labels], float(value))

    def histogram(self, name: str, hist: _Histogram) -> None:
        if hist.counts and sum(hist.counts):
            self._family(name).add_metric(self.common, hist.buckets(), hist.sum)

    def built(self) -> list:
        return list(self.families.values())


def _pool(f: _Families, state: LiveState, snap) -> None:
    pool = snap.pool
    if pool.blocks_used is not None:
        # the engine's gauges (no agent) say nothing of cached blocks: then free is unknown
        free = (pool.num_blocks - pool.blocks_used - pool.blocks_cached
                if pool.num_blocks and pool.blocks_cached is not None else None)
        block_bytes = state.pool.info.block_bytes if state.pool.info is not None else None
        for label, blocks in (("requests", pool.blocks_used), ("prefix_cache", pool.blocks_cached),
                              ("free", free)):
            if blocks is not None:
                f.add("kvdiag_kv_blocks", blocks, label)
                if block_bytes is not None:
                    f.add("kvdiag_kv_bytes", blocks * block_bytes, label)
    f.add("kvdiag_kv_block_occupancy_ratio", pool.block_occupancy)
    f.add("kvdiag_kv_token_occupancy_ratio", pool.token_occupancy)
    f.add("kvdiag_kv_pool_fragmentation_ratio", pool.pool_fragmentation)
    _slots(f, state)
    demand = state.kv_demand()
    if demand is not None:
        needed, free = demand
        f.add("kvdiag_kv_demand_needed_blocks", needed)
        f.add("kvdiag_kv_demand_free_blocks", free)
        f.add("kvdiag_kv_pressure_ratio", pressure.need_ratio(needed, free))
    f.add("kvdiag_allocator_fragmentation_ratio", pool.allocator_fragmentation)
    f.add("kvdiag_requests_running", pool.running_requests)
    f.add("kvdiag_requests_waiting", pool.waiting_requests)
    if not pool.reason:
        f.add("kvdiag_request_preemptions_total", pool.preemptions)
    if pool.finished_holding_requests is not None:  # the block ledger's, as the doctor counts them
        f.add("kvdiag_finished_requests_holding_blocks", pool.finished_holding_requests)
        f.add("kvdiag_finished_requests_held_blocks", pool.finished_holding_blocks)
    for kind, count in pool.block_anomalies:
        f.add("kvdiag_kv_block_anomalies_total", count, kind)


def _slots(f: _Families, state: LiveState) -> None:
    """Token slots and empty slots of the latest pool sample, as the doctor's
    :func:`kvdiag.diagnosis.pool_fragmentation.kv_pool_frame` counts them (both absent when the
    sample holds more tokens than slots)."""
    sample = state.pool.sample
    block_size = state.block_size_tokens()
    if sample is None or not block_size:
        return
    slots = sample.blocks_used * block_size
    if sample.tokens_held <= slots:
        f.add("kvdiag_kv_token_slots_tokens", slots)
        f.add("kvdiag_kv_empty_slots_tokens", slots - sample.tokens_held)


def _sharing(f: _Families, snap) -> None:
    sh = snap.sharing
    if snap.requests.finished:
        f.add("kvdiag_requests_finished_total", snap.requests.finished)
    f.add("kvdiag_prefix_engine_hit_ratio", sh.engine_hit_rate)
    f.add("kvdiag_prefix_content_hit_ratio", sh.shadow_hit_rate)
    f.add("kvdiag_prefix_hit_ratio_gap", sh.gap)
    f.add("kvdiag_prefix_hit_ratio_gap_unexplained", sh.unexplained_gap)
    if snap.requests.finished:  # the fold counted finished requests
        for cause, n in sh.miss_causes:
            f.add("kvdiag_prompt_tokens_missed_total", n, cause)
    for p in sh.what_if:
        cap = str(p.capacity_blocks) if p.capacity_blocks is not None else "unbounded"
        f.add("kvdiag_shadow_token_hit_ratio", p.token_hit_rate, p.policy, str(p.block_size_tokens), cap)


def _curves(f: _Families, snap) -> None:
    for row in snap.curves.rows if snap.curves is not None else ():
        for p in row.points:
            f.add("kvdiag_prefix_hit_ratio_at_capacity", p.token_hit_rate, f"{p.multiple:g}", row.tier)


def _shadow(f: _Families, snap) -> None:
    for row in snap.compression.rows:
        f.add("kvdiag_compression_ratio", row.ratio, row.method, row.layers)
        f.add("kvdiag_compression_error_ratio", row.error, row.method, row.layers)
        f.add("kvdiag_compression_attn_out_error_ratio", row.attn_out_error, row.method, row.layers)
    loc = snap.locality
    for metric, name in (("recent", "kvdiag_attention_recent_mass_ratio"),
                         ("sink", "kvdiag_attention_sink_mass_ratio"),
                         ("entropy", "kvdiag_attention_entropy_nats")):
        for layer, heads in enumerate(loc.cells.get(metric, ())):
            seen = [v for v in heads if v is not None]
            if seen:
                f.add(name, sum(seen) / len(seen), str(layer))


def _latency(f: _Families, sink: PrometheusSink) -> None:
    f.histogram("kvdiag_request_ttft_seconds", sink.ttft)
    f.histogram("kvdiag_request_inter_token_seconds", sink.inter_token)
    state = sink.state
    if state.latency.kv_read_step_ns_total:
        f.add("kvdiag_kv_read_bytes_total", state.latency.kv_read_bytes_total)
        f.add("kvdiag_kv_read_step_seconds_total", state.latency.kv_read_step_ns_total / 1e9)
    f.add("kvdiag_memory_copy_bandwidth_bytes_per_second", state.latency.peak_copy_bytes_per_s)


def _memory(f: _Families, snap) -> None:
    m = snap.memory
    f.add("kvdiag_gpu_memory_used_bytes", m.nvml_used_bytes)
    f.add("kvdiag_gpu_memory_total_bytes", m.nvml_total_bytes)
    f.add("kvdiag_gpu_process_memory_bytes", m.nvml_process_bytes)
    f.add("kvdiag_allocator_reserved_bytes", m.allocator_reserved_bytes)
    f.add("kvdiag_allocator_allocated_bytes", m.allocator_allocated_bytes)
    f.add("kvdiag_host_rss_bytes", m.host_rss_bytes)


def _health(f: _Families, state: LiveState, snap) -> None:
    f.add("kvdiag_events_total", state.events)
    f.add("kvdiag_collector_events_dropped_total", snap.health.dropped_events)
    budget = state.shadow_budget
    if budget is not None:
        f.add("kvdiag_shadow_steps_offered_total", budget.steps_offered)
        f.add("kvdiag_shadow_steps_sampled_total", budget.steps_sampled)
        f.add("kvdiag_shadow_steps_skipped_budget_total", budget.steps_skipped_budget)
        f.add("kvdiag_shadow_seconds_total", budget.spent_ns / 1e9)
        if budget.budget_frac and budget.elapsed_ns:
            f.add("kvdiag_shadow_budget_used_ratio", budget.spent_ns / (budget.budget_frac * budget.elapsed_ns))
    for collector, count, _message in snap.health.errors:
        f.add("kvdiag_collector_errors_total", count, collector)
    kv = state.facts.health.counts  # the KV-event stream's health, as the doctor folds it
    if kv.events:
        f.add("kvdiag_kv_event_batches_total", kv.batches)
        for check in ("lost_batches", "duplicate_batches", "removed_before_stored", "clear_storms",
                      "over_pool_batches"):
            f.add("kvdiag_kv_event_stream_problems_total", getattr(kv, check), check)


# ---------------------------------------------------------------------- serving


def parse_address(address: str | int) -> tuple[str, int]:
    """``PORT``, ``HOST:PORT`` or ``[IPv6]:PORT`` -> (host, port); the host defaults to 127.0.0.1."""
    text = str(address).strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host = DEFAULT_HOST
    host = host.strip("[]") or DEFAULT_HOST
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"expected [HOST:]PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    return host, number


class Exporter:
    """A running HTTP endpoint serving one sink's metrics; ``port`` is the bound port."""

    def __init__(self, sink: PrometheusSink, address: str | int) -> None:
        from prometheus_client import start_http_server

        host, port = parse_address(address)
        self.sink = sink
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(sink)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host, self.port = self._server.server_address[:2]

    def close(self) -> None:
        self.sink.close()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(address: str | int, header: Optional[s.LogHeader] = None) -> Exporter:
    """Start serving a new :class:`PrometheusSink` on ``address`` (``[HOST:]PORT``; port 0:
    a free one); record events into ``exporter.sink``, ``close()`` when done."""
    return Exporter(PrometheusSink(header), address)


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    print("usage: python -m kvdiag.prometheus.exporter --markdown", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
