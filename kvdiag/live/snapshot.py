"""The immutable picture of a KV cache at one moment, built by :mod:`kvdiag.live.state`.

Every panel of ``kvdiag top`` renders from one :class:`Snapshot` and nothing else. A value that
was not observed is ``None`` (rendered "N/A"); a view with no data at all carries a ``reason``
that tells the user what to start to get it. Histories hold one value per time bin (``bin_s``
seconds of event time), oldest first, ``None`` where the bin had no observation.

Pure data: no UI library is imported here (a test checks it in a subprocess).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvdiag.diagnosis.findings import Finding

History = tuple[Optional[float], ...]


@dataclass(frozen=True, slots=True)
class MemoryView:
    """Device and host memory by source. ``kv_pool_used_bytes`` = blocks held (live + cached)
    × block bytes (``KVPoolInfo.block_bytes``); ``host_rss_bytes`` = sum of the latest RSS of
    each process of the target; ``host_pss_bytes`` / ``host_swap_bytes`` = sum of the latest
    PSS / swap read of each process (None if never read). Without NVML and allocator samples
    the KV pool lives in host memory: ``kv_pool_rss_share`` = ``kv_pool_used_bytes`` /
    ``host_rss_bytes`` and ``kv_pool_total_rss_share`` = ``kv_pool_total_bytes`` /
    ``host_rss_bytes`` (None with a GPU source, or without RSS or pool info)."""

    nvml_used_bytes: Optional[int]
    nvml_total_bytes: Optional[int]
    nvml_process_bytes: Optional[int]
    allocator_reserved_bytes: Optional[int]
    allocator_allocated_bytes: Optional[int]
    kv_pool_used_bytes: Optional[int]
    kv_pool_total_bytes: Optional[int]
    host_rss_bytes: Optional[int]
    nvml_history: History
    allocator_history: History
    kv_pool_history: History
    rss_history: History
    gpu_hint: str  # why the NVML rows are N/A ("" when they are available)
    allocator_hint: str  # why the allocator rows are N/A
    host_pss_bytes: Optional[int] = None
    host_swap_bytes: Optional[int] = None
    kv_pool_rss_share: Optional[float] = None  # fraction 0-1 (can exceed 1: pages not resident)
    kv_pool_total_rss_share: Optional[float] = None


@dataclass(frozen=True, slots=True)
class PoolView:
    """The engine's KV block pool. Block occupancy = used / total; token occupancy = tokens
    written / (blocks used × block size); pool fragmentation = 1 - token occupancy (slots held
    but empty); allocator fragmentation = (reserved - allocated) / reserved."""

    num_blocks: Optional[int]
    block_size_tokens: Optional[int]
    blocks_used: Optional[int]
    blocks_cached: Optional[int]
    block_occupancy: Optional[float]
    token_occupancy: Optional[float]
    pool_fragmentation: Optional[float]
    allocator_fragmentation: Optional[float]
    evictions_per_s: Optional[float]  # BlockEvicted events per second over the rate window
    preemptions: int
    running_requests: Optional[int]
    waiting_requests: Optional[int]
    occupancy_history: History  # block occupancy per bin
    reason: str
    inconsistency: str = ""  # why a sampled number was rejected ("" when all are plausible)
    # from the block ledger (kvdiag.pool.blockledger), None without block events
    ledger_held_blocks: Optional[int] = None
    ledger_cached_blocks: Optional[int] = None
    ledger_free_blocks: Optional[int] = None  # also None without a KVPoolInfo
    finished_holding_requests: Optional[int] = None  # finished > the release grace ago, still holding
    finished_holding_blocks: Optional[int] = None  # the blocks those requests hold
    block_anomalies: tuple = ()  # (kind, count) per kvdiag.pool.blockledger.ANOMALY_KINDS
    # where the figures come from: "" the kvdiag agent's pool events; else the engine's own
    # gauges (kvdiag.live.views.engine: block occupancy = its KV cache usage gauge)
    source: str = ""


@dataclass(frozen=True, slots=True)
class WhatIfPoint:
    """One shadow prefix-cache configuration and its token hit rate so far."""

    policy: str
    block_size_tokens: int
    capacity_blocks: Optional[int]  # None = unbounded
    token_hit_rate: float
    block_hit_rate: float
    requests: int


@dataclass(frozen=True, slots=True)
class SharingView:
    """Prefix sharing. Engine hit rate = cached prompt tokens / prompt tokens over finished
    requests (or the engine's own prefix-cache counters, hits / queries, since the client
    joined). Shadow hit rate = token hit rate of the shadow cache at the engine's
    configuration. Gap = shadow - engine over the same requests, None when they cannot be
    matched or are fewer than ``rules.MIN_SHARING_REQUESTS`` (``gap_status`` then says so).
    With shadow results that carry the same-requests counters (schema 1.6), all three cover
    the same window: the requests that finished normally since ``window_start_ns`` (the
    client's first shadow result: its join, or the shadow's start), ``window_requests`` of
    them."""

    engine_hit_rate: Optional[float]
    shadow_hit_rate: Optional[float]
    shadow_config: Optional[WhatIfPoint]
    gap: Optional[float]
    engine_history: History  # per-bin engine token hit rate of requests finished in that bin
    shadow_history: History
    what_if: tuple[WhatIfPoint, ...]  # every latest shadow configuration, sorted
    finished_requests: int
    reason: str  # why the shadow half is empty ("" when it is there)
    window_start_ns: Optional[int] = None  # None: no same-requests window (older agent)
    window_requests: Optional[int] = None
    gap_status: str = ""  # rules.sharing_gap_status of unexplained_gap; "n/a (N of M needed)" with too few
    # the gap less what the engine's own events explain (rules.unexplained_gap); None with gap None
    unexplained_gap: Optional[float] = None
    # missed prompt tokens of the requests finished since the client joined, by cause
    # (kvdiag.diagnosis.miss_tally.CAUSES order: (cause, tokens)); they sum to missed_tokens
    miss_causes: tuple[tuple[str, int], ...] = ()
    missed_tokens: int = 0
    # the engine's /metrics scrape its counter increases start from (this client's join), when
    # engine_hit_rate is read from them (no finished requests seen); None otherwise
    engine_counters_since_ns: Optional[int] = None


@dataclass(frozen=True, slots=True)
class CompressionRow:
    """One compression method on one group of layers (means over the sampled layer/heads;
    error = max of the K and V relative Frobenius errors)."""

    layers: str  # e.g. "0-9"
    method: str
    ratio: float
    error: float
    attn_out_error: Optional[float]
    decode_us: Optional[float]
    samples: int
    recommendation: str  # "use", "check" or "avoid" (kvdiag.diagnosis.rules.compression_verdict)


@dataclass(frozen=True, slots=True)
class CompressionView:
    rows: tuple[CompressionRow, ...]
    reason: str
    sampling: str = ""  # kvdiag.diagnosis.compression.sampling_line of the latest ShadowBudget


LOCALITY_METRICS = ("recent", "sink", "entropy", "share")


@dataclass(frozen=True, slots=True)
class LocalityView:
    """Mean attention locality per (layer, head): ``cells[metric][layer][head]``; metrics are
    recent-window mass, sink mass, entropy (nats) and the head's share of the layer's
    non-recent mass. ``None`` where that head was never sampled."""

    num_layers: int
    num_heads: int
    cells: dict[str, tuple[tuple[Optional[float], ...], ...]]
    samples: int
    reason: str


@dataclass(frozen=True, slots=True)
class LatencyView:
    """TTFT, per-token latency (TPOT = (e2e - ttft) / (output tokens - 1)) and queue wait of
    requests finished in the latency window (kvdiag.live.latency_fold.LATENCY_WINDOWS rate windows), per-bin histories of their P50/P99, generated tokens/s,
    (whether P99 regressed is the ``p99.regression`` rule's verdict, among the alerts)."""

    ttft_p50_ms: Optional[float]
    ttft_p99_ms: Optional[float]
    tpot_p50_ms: Optional[float]
    tpot_p99_ms: Optional[float]
    tokens_per_s: Optional[float]
    ttft_p50_history: History
    ttft_p99_history: History
    tpot_p99_history: History
    tokens_history: History
    p99_verdict: Optional[Finding]  # the p99.regression rule's latest finding (None before its first run)
    reason: str
    # demanded KV read bandwidth over the rate window (kvdiag.diagnosis.bandwidth): bytes/s,
    # and its share of the log's measured copy bandwidth (None without a probe)
    kv_read_bytes_per_s: Optional[float] = None
    kv_bandwidth_utilisation: Optional[float] = None
    kv_bandwidth_history: History = ()  # per bin: utilisation in %, or GB/s without a probe
    kv_bandwidth_history_unit: str = "%"
    nvml_memory_util_pct: Optional[float] = None  # NVML memory-controller utilisation, mean of devices
    # queue wait = first scheduling - arrival (kvdiag.diagnosis.user_latency), requests finished in
    # the latency window; queue_reason says why there is none (no scheduling events)
    queue_p50_ms: Optional[float] = None
    queue_p99_ms: Optional[float] = None
    queue_p99_history: History = ()
    queue_reason: str = ""
    # "" when read from the requests' events; else where the figures come from (the engine's
    # /metrics histograms, their increase since the join: kvdiag.live.views.engine)
    source: str = ""


@dataclass(frozen=True, slots=True)
class RequestRow:
    """A request and the KV it holds: ``kv_bytes`` = blocks held × block bytes, or, for a
    running request of an engine that reports no block events, prompt tokens × bytes per token
    (an estimate); ``hit_tokens`` = prompt tokens served from cache."""

    request_id: str
    state: str  # "waiting", "running" or the finish status
    prompt_tokens: int
    output_tokens: Optional[int]
    blocks: int
    kv_bytes: Optional[int]
    hit_tokens: int
    hit_blocks: int
    age_s: float
    ttft_ms: Optional[float]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RequestsView:
    rows: tuple[RequestRow, ...]  # live requests by KV bytes, then recently finished ones
    live: int
    finished: int
    reason: str


@dataclass(frozen=True, slots=True)
class HealthView:
    """Collector health: dropped events, errors by collector, unavailable collectors."""

    dropped_events: int
    gaps: int
    errors: tuple[tuple[str, int, str], ...]  # (collector, count, last message)
    unavailable: tuple[tuple[str, str], ...]  # (collector, hint)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything ``kvdiag top`` shows at ``now_ns`` (event time: wall clock when live,
    the replay position when replaying a log)."""

    now_ns: int
    start_ns: int
    source: str
    paused: bool
    events: int
    events_per_s: float
    bin_s: float
    engine: str
    model: str
    memory: MemoryView
    pool: PoolView
    sharing: SharingView
    compression: CompressionView
    locality: LocalityView
    latency: LatencyView
    requests: RequestsView
    health: HealthView
    alerts: tuple[Finding, ...]
    finished_source: bool = False  # a replayed log reached its end
    curves: "CurvesView" = None  # type: ignore[assignment]  # capacity curves (set by LiveState)


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """LRU token hit rate at ``multiple`` x the tier's basis capacity (``capacity_blocks``);
    None beyond the fold's exact range."""

    multiple: float
    capacity_blocks: int
    token_hit_rate: Optional[float]


@dataclass(frozen=True, slots=True)
class CurveRow:
    """One tier's capacity curve (kvdiag.simulation.capacity_curve): "pool" = request content,
    else a KV-event ``medium``. ``basis_blocks``: the capacity the multiples scale (the pool's
    blocks, or for a lower tier its peak resident blocks); ``basis``: which of the two."""

    tier: str
    block_size_tokens: int
    basis_blocks: Optional[int]
    basis: str
    points: tuple[CurvePoint, ...]
    requests: int
    distinct_keys: int
    max_keys: int


@dataclass(frozen=True, slots=True)
class CurvesView:
    rows: tuple[CurveRow, ...] = ()
    reason: str = "no request content or KV events yet (the capacity curve needs either)"
