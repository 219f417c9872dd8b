"""The metrics kvdiag serves to Prometheus, defined once: name, type, unit, labels and meaning.

:mod:`kvdiag.prometheus.exporter` builds its metric families from this table and ``docs/metrics.md`` is
generated from it (``python -m kvdiag.prometheus.exporter --markdown``; a test compares the two), so the
documentation cannot drift from what is served. Every metric also carries the labels
``node``, ``engine`` and ``model`` of the observed process (its log header). A metric whose
source was not observed (no pool, no shadow, no finished request ...) is absent, not zero.
"""

from __future__ import annotations

from dataclasses import dataclass

COMMON_LABELS = ("node", "engine", "model")


@dataclass(frozen=True)
class MetricDef:
    name: str
    type: str  # "gauge", "counter" or "histogram"
    unit: str  # "bytes", "ratio", "seconds", "blocks", "tokens", "requests", "steps", "events", "errors", "nats"
    help: str
    labels: tuple[str, ...] = ()


TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

METRICS: tuple[MetricDef, ...] = (
    # ------------------------------------------------------------------ KV pool
    MetricDef("kvdiag_kv_bytes", "gauge", "bytes",
              "KV pool bytes by state: held by live requests, held only by the prefix cache, free "
              "(blocks x KVPoolInfo.block_bytes).", ("state",)),
    MetricDef("kvdiag_kv_blocks", "gauge", "blocks",
              "KV pool blocks by state (requests, prefix_cache, free); the latest pool sample, or "
              "counted from block events without samples; without the agent, requests only: the "
              "engine's KV cache usage gauge x its pool blocks.", ("state",)),
    MetricDef("kvdiag_kv_block_occupancy_ratio", "gauge", "ratio",
              "Blocks held by live requests / blocks in the pool (without the agent: the engine's KV "
              "cache usage gauge, e.g. vllm:kv_cache_usage_perc)."),
    MetricDef("kvdiag_kv_token_occupancy_ratio", "gauge", "ratio",
              "Tokens written / token slots of the blocks held by live requests (pool samples only)."),
    MetricDef("kvdiag_kv_pool_fragmentation_ratio", "gauge", "ratio",
              "1 - token occupancy: share of empty token slots in held blocks (doctor: "
              "fragmentation.kv_pool)."),
    MetricDef("kvdiag_kv_token_slots_tokens", "gauge", "tokens",
              "Token slots of the blocks held by live requests (blocks used x block size), latest "
              "pool sample; absent with the empty slots when the sample is inconsistent."),
    MetricDef("kvdiag_kv_empty_slots_tokens", "gauge", "tokens",
              "Empty token slots in the blocks held by live requests, latest pool sample. The "
              "doctor's fragmentation.kv_pool is sum(empty) / sum(slots) over samples: the alert "
              "takes both sums over a window."),
    MetricDef("kvdiag_kv_demand_needed_blocks", "gauge", "blocks",
              "Blocks the active requests still need to reach their expected length "
              "(kvdiag/pool/pressure.py)."),
    MetricDef("kvdiag_kv_demand_free_blocks", "gauge", "blocks",
              "Free plus evictable cached blocks, latest pool sample."),
    MetricDef("kvdiag_kv_pressure_ratio", "gauge", "ratio",
              "Needed / free blocks (doctor: forecast.memory_pressure); +Inf when none is free."),
    MetricDef("kvdiag_allocator_fragmentation_ratio", "gauge", "ratio",
              "(reserved - allocated) / reserved bytes of the CUDA caching allocator."),
    MetricDef("kvdiag_requests_running", "gauge", "requests",
              "Requests the engine is running (latest pool sample)."),
    MetricDef("kvdiag_requests_waiting", "gauge", "requests",
              "Requests waiting for the engine (latest pool sample)."),
    MetricDef("kvdiag_request_preemptions_total", "counter", "requests",
              "Request preemptions seen since the exporter started."),
    MetricDef("kvdiag_requests_finished_total", "counter", "requests",
              "Requests finished (any status) since the exporter started."),
    MetricDef("kvdiag_finished_requests_holding_blocks", "gauge", "requests",
              "Finished requests that still hold KV blocks, among those finished longer than the "
              "doctor's release grace ago (leak.finished_holding), from the block ledger: every "
              "finished request seen since the exporter started, however many finished after it."),
    MetricDef("kvdiag_finished_requests_held_blocks", "gauge", "blocks",
              "KV blocks held by the requests of kvdiag_finished_requests_holding_blocks."),
    MetricDef("kvdiag_kv_block_anomalies_total", "counter", "events",
              "Block events that contradict the pool state, by kind (kvdiag/pool/blockledger.py): "
              "double_release, release_unheld (also blocks allocated before kvdiag joined), "
              "alloc_in_use, evict_held.", ("kind",)),
    # ------------------------------------------------------------------ prefix sharing
    MetricDef("kvdiag_prefix_engine_hit_ratio", "gauge", "ratio",
              "Engine prefix-cache token hit rate: cached prompt tokens / prompt tokens of finished "
              "requests (or the increase of the engine's own counters, hits / queries, since the "
              "exporter started)."),
    MetricDef("kvdiag_prefix_content_hit_ratio", "gauge", "ratio",
              "Content hit rate: token hit rate of the shadow cache at the engine's settings, over the "
              "same finished requests as the engine's."),
    MetricDef("kvdiag_prefix_hit_ratio_gap", "gauge", "ratio",
              "Content hit rate - engine hit rate over the same finished requests (doctor: "
              "sharing.consistency); absent with fewer than its minimum of requests."),
    MetricDef("kvdiag_prefix_hit_ratio_gap_unexplained", "gauge", "ratio",
              "The hit-rate gap less what the engine's own events explain: prompt tokens the shadow "
              "held that the engine had let go (its pool under pressure), recomputed after a "
              "preemption or not stored yet (in flight in another request), as a share of the same requests' prompt tokens; what sharing.consistency "
              "judges. Absent with fewer than its minimum of requests."),
    MetricDef("kvdiag_prompt_tokens_missed_total", "counter", "tokens",
              "Prompt tokens of finished requests the engine did not serve from its prefix cache, "
              "by cause: cold, evicted, hash_domain, below_block, preemption, in_flight, engine_skip, "
              "unknown (kvdiag/diagnosis/miss_causes.py); summed over causes, the engine's missed tokens "
              "(vLLM: prefix_cache_queries - prefix_cache_hits) since the exporter started.",
              ("cause",)),
    MetricDef("kvdiag_shadow_token_hit_ratio", "gauge", "ratio",
              "Token hit rate of a what-if prefix cache; block_size in tokens, capacity in blocks "
              "(\"unbounded\" without a limit).", ("policy", "block_size", "capacity")),
    MetricDef("kvdiag_prefix_hit_ratio_at_capacity", "gauge", "ratio",
              "LRU token hit rate the content would get at multiple x the tier's capacity in blocks "
              "(Mattson stack distances folded from the stream, equal to `kvdiag replay --curve`; "
              "kvdiag/simulation/capacity_curve.py). tier: \"pool\" (request content, multiples of "
              "the engine's pool) or a KV-event medium (multiples of the pool for GPU, else of the "
              "tier's peak resident blocks); absent beyond the fold's exact range.",
              ("multiple", "tier")),
    # ------------------------------------------------------------------ compression, locality
    MetricDef("kvdiag_compression_ratio", "gauge", "ratio",
              "Mean compression ratio (original / compressed bytes) of a method on a layer group.",
              ("method", "layers")),
    MetricDef("kvdiag_compression_error_ratio", "gauge", "ratio",
              "Max relative Frobenius error of K and V of a method on a layer group.",
              ("method", "layers")),
    MetricDef("kvdiag_compression_attn_out_error_ratio", "gauge", "ratio",
              "Mean relative error of the attention output of a method on a layer group.",
              ("method", "layers")),
    MetricDef("kvdiag_attention_recent_mass_ratio", "gauge", "ratio",
              "Mean attention mass on the recent window, over the sampled heads of a layer.",
              ("layer",)),
    MetricDef("kvdiag_attention_sink_mass_ratio", "gauge", "ratio",
              "Mean attention mass on the sink tokens, over the sampled heads of a layer.",
              ("layer",)),
    MetricDef("kvdiag_attention_entropy_nats", "gauge", "nats",
              "Mean attention entropy, over the sampled heads of a layer.", ("layer",)),
    # ------------------------------------------------------------------ latency
    MetricDef("kvdiag_request_ttft_seconds", "histogram", "seconds",
              "Time to first token of requests finished with status \"finished\"."),
    MetricDef("kvdiag_request_inter_token_seconds", "histogram", "seconds",
              "Mean time per output token after the first, (e2e - ttft) / (output tokens - 1), "
              "of finished requests with more than one output token (one observation per request)."),
    MetricDef("kvdiag_kv_read_bytes_total", "counter", "bytes",
              "KV bytes engine steps had to read: blocks held at each step x block bytes "
              "(kvdiag/diagnosis/bandwidth.py); absent without block events."),
    MetricDef("kvdiag_kv_read_step_seconds_total", "counter", "seconds",
              "Duration of the engine steps counted in kvdiag_kv_read_bytes_total: rate(bytes) / "
              "rate(seconds) is the demanded KV read bandwidth."),
    MetricDef("kvdiag_memory_copy_bandwidth_bytes_per_second", "gauge", "bytes",
              "The machine's measured copy bandwidth (kvdiag's bounded memcpy probe, bytes read + "
              "written per second): the peak KV read bandwidth is measured against."),
    # ------------------------------------------------------------------ memory
    MetricDef("kvdiag_gpu_memory_used_bytes", "gauge", "bytes", "NVML device memory used, all devices."),
    MetricDef("kvdiag_gpu_memory_total_bytes", "gauge", "bytes", "NVML device memory, all devices."),
    MetricDef("kvdiag_gpu_process_memory_bytes", "gauge", "bytes",
              "NVML device memory of the observed process."),
    MetricDef("kvdiag_allocator_reserved_bytes", "gauge", "bytes", "CUDA caching allocator reserved bytes."),
    MetricDef("kvdiag_allocator_allocated_bytes", "gauge", "bytes", "CUDA caching allocator allocated bytes."),
    MetricDef("kvdiag_host_rss_bytes", "gauge", "bytes",
              "Resident memory of the observed processes (latest sample of each, last 30 s)."),
    # ------------------------------------------------------------------ collector health
    MetricDef("kvdiag_events_total", "counter", "events", "Events kvdiag observed since the exporter started."),
    MetricDef("kvdiag_collector_events_dropped_total", "counter", "events",
              "Events collectors dropped (CollectorGap), always present."),
    MetricDef("kvdiag_shadow_steps_offered_total", "counter", "steps",
              "Decode steps offered to the shadow runner (ShadowBudget)."),
    MetricDef("kvdiag_shadow_steps_sampled_total", "counter", "steps",
              "Decode steps the shadow runner sampled (drawn at its rate, within its budget)."),
    MetricDef("kvdiag_shadow_steps_skipped_budget_total", "counter", "steps",
              "Decode steps drawn for shadow work but skipped to stay within the CPU budget."),
    MetricDef("kvdiag_shadow_seconds_total", "counter", "seconds",
              "CPU time the shadow runner spent on sampled steps (in the engine's thread or its worker; "
              "wall time for runners before schema 1.4)."),
    MetricDef("kvdiag_shadow_budget_used_ratio", "gauge", "ratio",
              "Shadow CPU spent / (budget fraction x the engine's CPU since its first step); absent "
              "without a budget. Above 1 only by the last run's overshoot."),
    MetricDef("kvdiag_collector_errors_total", "counter", "errors",
              "Errors reported by a collector (CollectorError); absent for collectors without errors.",
              ("collector",)),
    MetricDef("kvdiag_kv_event_batches_total", "counter", "events",
              "Batches of the engine's KV-event stream received (duplicates not counted); absent "
              "without KV events."),
    MetricDef("kvdiag_kv_event_stream_problems_total", "counter", "events",
              "The KV-event stream's health checks (kvdiag.pool.kv_stream_health; the doctor's "
              "kv_events.health): check = lost_batches, duplicate_batches, removed_before_stored "
              "(keys), clear_storms, over_pool_batches (batches after which the device tier "
              "held more keys than the pool has blocks); absent without KV events.", ("check",)),
)

BY_NAME = {m.name: m for m in METRICS}


def markdown() -> str:
    """``docs/metrics.md``: one row per metric."""
    lines = [
        "# Prometheus metrics",
        "",
        "Served by `python -m kvdiag.run --prometheus [HOST:]PORT -- ...`, "
        "`kvdiag.agent.start(prometheus=...)`, `kvdiag demo --prometheus ...` and "
        "`kvdiag attach PID --prometheus ...` (127.0.0.1 unless a host is given). "
        "Generated by `python -m kvdiag.prometheus.exporter --markdown` from `kvdiag/prometheus/metrics.py`; "
        "a test checks this file equals that output. `docs/grafana-dashboard.json` (a Grafana "
        "dashboard of these metrics by node) is generated from the same table by "
        "`python -m kvdiag.prometheus.dashboard`.",
        "",
        f"Every metric carries the labels {', '.join(f'`{n}`' for n in COMMON_LABELS)} (from the "
        "log header). A metric whose source was not observed is absent, not zero.",
        "",
        "| name | type | unit | labels | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in METRICS:
        labels = ", ".join(f"`{n}`" for n in m.labels) or "-"
        lines.append(f"| `{m.name}` | {m.type} | {m.unit} | {labels} | {m.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
