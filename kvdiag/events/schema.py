"""The one event schema of kvdiag, shared by live streams and recorded logs.

Long: the schema is one file by design, so that what a log may hold is read in one place.

Every observation is a tagged ``msgspec.Struct``; the tag (``type``) names it in JSON. Rules
that keep a log recorded today loadable next year:

- Fields are never renamed or removed within a major version. A field added later has a
  default, so old logs decode with it filled in, and unknown fields from newer minor
  versions are ignored.
- ``SCHEMA_VERSION`` is ``"MAJOR.MINOR"``; a reader refuses a log from a newer major version.
- Units are in field names: ``_ns`` (nanoseconds), ``_bytes``, ``_tokens``, ``_blocks``,
  ``_pct`` (0-100), ``_mw`` (milliwatts), ``_mj`` (millijoules). Rates are fractions 0-1.
- Timestamps ``ts_ns`` are wall-clock (``time.time_ns()``) so that events of several
  processes and nodes merge on one axis.
- Ranges are part of the types and checked where a line is decoded, once: every integer fits
  an int64, sizes, counts, ids and durations are non-negative, timestamps fall
  between 1970 and 2100, floats are finite,
  rates are fractions 0-1 and ``_pct`` 0-100. Analyses trust what the reader let through.
"""

from __future__ import annotations

import math
import sys
from typing import Annotated, ClassVar, Literal, NewType, Optional, Union

import msgspec

SCHEMA_VERSION = "1.8"  # 1.1: ProcessSample.pss_bytes, swap_bytes; 1.2: EngineMetrics cache config
# (block_size_tokens, num_blocks, prefix_caching), token counters and latency histograms;
# PrefixCacheStored/Removed/Cleared (an engine's own KV events); 1.3: MemoryBandwidthProbe,
# HostEnergySample, NvmlSample.memory_util_pct, ShadowBudget; 1.4: ShadowBudget.clock (CPU-time
# budget), sample_rate, sample_rate_max; 1.5: ShadowDelta; 1.6: ShadowSharing.finished_* (the
# same finished requests counted on the shadow's and the engine's side); 1.7: content as salted
# hashes (LogHeader.content, content_salt, content_chunk_tokens; RequestArrived.chunk_hashes,
# partial_tokens; BlockStored.chunk_hashes): a log without them holds token ids, if any;
# 1.8: RequestArrived.cache_domain (the engine's hash domain: salt, LoRA)
SCHEMA_MAJOR = int(SCHEMA_VERSION.split(".")[0])

INT64_MAX = 2**63 - 1
MASK63 = INT64_MAX
"""The fold mask: a 64-bit hash's low 63 bits, so that every key fits a non-negative int64."""
Int64 = Annotated[int, msgspec.Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]
"""An integer that fits an int64 column (device indices, temperatures)."""
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
"""A non-negative int64: sizes, lengths, counts, ids, durations and timestamps."""
TimestampNs = Annotated[int, msgspec.Meta(ge=0, le=4_102_444_800 * 10**9)]
"""Wall-clock nanoseconds since 1970, before 2100: a time axis that arithmetic cannot overflow."""
Index = Annotated[int, msgspec.Meta(ge=0, le=1023)]
"""A layer or head index (models have at most a few hundred of each): views draw a grid."""
Positive = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
"""A positive int64: a size that is divided by (tokens per block)."""
Real = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
"""A finite float."""
NonNegative = Annotated[float, msgspec.Meta(ge=0.0, le=sys.float_info.max)]
"""A finite float >= 0 (errors, ratios, cumulative counters)."""
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
"""A rate in [0, 1]."""
Pct = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
"""A percentage in [0, 100]."""

RequestId = NewType("RequestId", str)
BlockId = NewType("BlockId", Count)
"""Index of a KV block (page) in the engine's pool; unique within one pool at a time."""
BlockHash = NewType("BlockHash", Count)
"""A chained content key of a full block: equal keys mean equal prefixes. Adapters fold wider
hashes (blake2b, sha256) to 63 bits so that the key fits an int64 column."""
StepId = NewType("StepId", Count)


class LogHeader(msgspec.Struct, kw_only=True):
    """First line of every event log: who recorded it and how to interpret its units."""

    schema_version: str  # required: a first line without it is not a kvdiag log
    kvdiag_version: str = ""
    host: str = ""
    pid: Count = 0
    engine: str = ""  # e.g. "transformers-cb", "vllm", "attach"
    model: str = ""
    block_size_tokens: Optional[Positive] = None
    bytes_per_token: Optional[Count] = None  # KV bytes of one token over all layers, K and V
    start_ns: TimestampNs = 0
    node: str = ""  # a label for merging logs of several nodes; defaults to host
    extra: dict = {}
    # what the log holds of prompts: "hashes" (salted chained hashes of content_chunk_tokens
    # chunks, no token ids) or "token_ids"; None: a log from before 1.7 (token ids if any)
    content: Optional[Literal["hashes", "token_ids"]] = None
    content_salt: Optional[str] = None  # per-log random salt folded into every chunk hash
    content_chunk_tokens: Optional[Positive] = None  # tokens per hashed chunk


class Event(msgspec.Struct, kw_only=True, tag_field="type"):
    """Base of all events. ``ts_ns``: wall-clock time the event was observed."""

    ts_ns: TimestampNs


# ---------------------------------------------------------------- request lifecycle


class RequestArrived(Event, tag="request_arrived"):
    """A request entered the engine. Its content, for shadow analyses to re-chunk at any block
    size: ``token_ids`` (only when recorded with ``--record-tokens``) or ``chunk_hashes``, the
    salted chained hashes of its full chunks of the header's ``content_chunk_tokens``
    (``partial_tokens`` = the tokens of its trailing partial chunk). ``conversation_id`` groups
    the turns of one chat. ``cache_domain``: what the engine folds into its block hashes beside
    the tokens, when not the default (vLLM: ``cache_salt``, LoRA adapter), as a digest: requests
    of different domains never share cached blocks; None: the default domain (or not recorded)."""

    request_id: RequestId
    prompt_tokens: Count
    max_new_tokens: Optional[Count] = None
    token_ids: Optional[list[Count]] = None
    conversation_id: Optional[str] = None
    chunk_hashes: Optional[list[BlockHash]] = None
    partial_tokens: Optional[Count] = None
    cache_domain: Optional[str] = None


class RequestScheduled(Event, tag="request_scheduled"):
    """The scheduler gave the request its first slot; ``queue_ns`` = scheduled - arrived."""

    request_id: RequestId
    queue_ns: Optional[Count] = None


class RequestFirstToken(Event, tag="request_first_token"):
    """The first output token was produced; ``ttft_ns`` = first token - arrived."""

    request_id: RequestId
    ttft_ns: Count


class RequestFinished(Event, tag="request_finished"):
    """The request left the engine. ``cached_prompt_tokens``: prompt tokens served from the
    prefix cache instead of being recomputed. ``status``: finished, aborted or failed."""

    request_id: RequestId
    prompt_tokens: Count
    output_tokens: Count
    cached_prompt_tokens: Count = 0
    status: Literal["finished", "aborted", "failed"] = "finished"
    e2e_ns: Optional[Count] = None  # finished - arrived
    ttft_ns: Optional[Count] = None


class RequestPreempted(Event, tag="request_preempted"):
    """The engine evicted a running request's KV to make room (it will be recomputed)."""

    request_id: RequestId
    blocks_freed: Count = 0


# ---------------------------------------------------------------- engine steps


class EngineStep(Event, tag="engine_step"):
    """One forward pass of the engine. ``phase``: prefill (only prompt tokens), decode (only
    one new token per request) or mixed. ``num_tokens``: tokens processed in the step."""

    step_id: StepId
    phase: Literal["prefill", "decode", "mixed"]
    batch_size: Count
    num_tokens: Count
    duration_ns: Count
    prefill_tokens: Count = 0
    decode_tokens: Count = 0


# ---------------------------------------------------------------- KV blocks


class KVPoolInfo(Event, tag="kv_pool_info"):
    """The shape of the engine's KV block pool; emitted once when it is created."""

    num_blocks: Count
    block_size_tokens: Positive
    block_bytes: Count  # one block over all layers, K and V
    num_layers: Count
    num_kv_heads: Count
    head_dim: Count
    dtype: str
    prefix_sharing: bool = False


class BlockAllocated(Event, tag="block_allocated"):
    """A fresh block was taken from the free list for a request."""

    request_id: RequestId
    block_id: BlockId
    num_blocks_free: Optional[Count] = None  # free-list size after the allocation


class BlockStored(Event, tag="block_stored"):
    """A full block was registered in the prefix cache under its chained content key."""

    block_id: BlockId
    block_hash: BlockHash
    parent_hash: Optional[BlockHash] = None
    num_tokens: Count = 0
    request_id: Optional[RequestId] = None
    token_ids: Optional[list[Count]] = None
    # hashes-mode content: the request's salted chunk hashes of the chunks that end in this block
    chunk_hashes: Optional[list[BlockHash]] = None


class PrefixHit(Event, tag="prefix_hit"):
    """A request reused a cached block instead of recomputing ``num_tokens`` tokens."""

    request_id: RequestId
    block_id: BlockId
    block_hash: Optional[BlockHash] = None
    num_tokens: Count = 0


class BlockDeduplicated(Event, tag="block_deduplicated"):
    """Right after its forward pass, a request found that a block it had just filled has the
    same content key as an already cached block: it adopted ``block_id`` (the cached one) in
    place of ``duplicate_block_id``, which it releases (a ``BlockReleased`` follows). Held-block
    accounting: the request holds ``block_id`` from here on."""

    request_id: RequestId
    block_id: BlockId
    duplicate_block_id: BlockId
    block_hash: Optional[BlockHash] = None


class BlockReleased(Event, tag="block_released"):
    """A request gave a block back. ``cached``: the block stays in the prefix cache
    (evictable) instead of returning to the free list."""

    request_id: RequestId
    block_id: BlockId
    cached: bool = False
    num_blocks_free: Optional[Count] = None


class BlockEvicted(Event, tag="block_evicted"):
    """A cached prefix block was dropped from the prefix cache and returned to the free list."""

    block_id: BlockId
    block_hash: Optional[BlockHash] = None


class KVPoolSample(Event, tag="kv_pool_sample"):
    """Periodic occupancy of the pool. Block occupancy = blocks_used / num_blocks; token
    occupancy = tokens_held / (blocks_used * block_size)."""

    num_blocks: Count
    blocks_used: Count  # held by live requests
    blocks_cached: Count = 0  # held only by the prefix cache (evictable)
    blocks_free: Count = 0
    tokens_held: Count = 0  # tokens actually written in blocks held by live requests
    running_requests: Count = 0
    waiting_requests: Count = 0


# ---------------------------------------------------------------- prefix-cache content (engine events)


class PrefixCacheStored(Event, tag="prefix_cache_stored"):
    """Content keys entered the engine's prefix cache, as the engine published them (vLLM's
    ``BlockStored``): ``block_hashes`` chain from ``parent_hash`` (None: from the start of a
    prompt), each over ``block_size_tokens`` of ``token_ids``. No block ids: these are content,
    not the pool ledger of :class:`BlockStored`. ``seq``: the publisher's batch sequence
    number (events of one batch share it); ``medium``: the tier (e.g. "GPU", "CPU");
    ``group_idx``: the KV cache group of hybrid models."""

    seq: Count
    block_hashes: list[BlockHash]
    parent_hash: Optional[BlockHash] = None
    token_ids: list[Count] = []
    block_size_tokens: Count = 0
    medium: Optional[str] = None
    group_idx: Optional[Count] = None


class PrefixCacheRemoved(Event, tag="prefix_cache_removed"):
    """Content keys left the engine's prefix cache (evicted), as the engine published them
    (vLLM's ``BlockRemoved``); ``seq``, ``medium``, ``group_idx`` as in
    :class:`PrefixCacheStored`."""

    seq: Count
    block_hashes: list[BlockHash]
    medium: Optional[str] = None
    group_idx: Optional[Count] = None


class PrefixCacheCleared(Event, tag="prefix_cache_cleared"):
    """The engine dropped every key of its prefix cache (vLLM's ``AllBlocksCleared``)."""

    seq: Count


# ---------------------------------------------------------------- memory and hardware


class AllocatorSample(Event, tag="allocator_sample"):
    """``torch.cuda.memory_stats()`` of one device (the "all" pool, current values)."""

    device: Int64
    reserved_bytes: Count
    allocated_bytes: Count
    active_bytes: Count = 0
    inactive_split_bytes: Count = 0
    alloc_retries: Count = 0
    num_ooms: Count = 0


class NvmlSample(Event, tag="nvml_sample"):
    """One NVML reading of a device; a field NVML could not read is null."""

    device: Int64
    memory_used_bytes: Optional[Count] = None
    memory_total_bytes: Optional[Count] = None
    gpu_util_pct: Optional[Pct] = None
    power_mw: Optional[Count] = None
    energy_mj: Optional[Count] = None  # total energy since driver load
    temperature_c: Optional[Int64] = None
    process_memory_bytes: Optional[Count] = None  # used by the target and its children
    # 1.3: share of the last sample period during which device memory was being read or
    # written (nvmlDeviceGetUtilizationRates().memory)
    memory_util_pct: Optional[Pct] = None


class MemoryBandwidthProbe(Event, tag="memory_bandwidth_probe"):
    """The measured memory bandwidth of the machine the log was recorded on: the peak that
    KV bandwidth utilisation divides by (:mod:`kvdiag.diagnosis.bandwidth`).

    ``copy_bandwidth_bytes_per_s``: (bytes read + bytes written) per second of the fastest of
    ``repetitions`` copies of a ``buffer_bytes`` buffer, larger than the last-level cache, on
    ``device`` ("cpu", "cuda:0"), the convention of STREAM's Copy. ``method``: what copied
    ("numpy", "torch"). ``cached``: read from the per-host cache of an earlier probe."""

    device: str
    copy_bandwidth_bytes_per_s: NonNegative
    buffer_bytes: Count
    repetitions: Count
    device_name: str = ""
    method: str = ""
    cached: bool = False


class HostEnergySample(Event, tag="host_energy_sample"):
    """One reading of a host energy counter (RAPL, ``/sys/class/powercap/*/energy_uj``):
    ``energy_uj`` microjoules since an arbitrary origin, wrapping at ``max_energy_uj``.
    ``domain``: the zone's name (``package-0``, ``dram``)."""

    domain: str
    energy_uj: Count
    max_energy_uj: Optional[Count] = None


class ProcessSample(Event, tag="process_sample"):
    """Host view of one process of the target (the server or one of its children).

    ``rss_bytes``: resident set size (``/proc/PID/statm``). ``pss_bytes``: proportional set
    size, shared pages divided among the processes that map them, and ``swap_bytes``: pages of
    the process in swap, both from ``/proc/PID/smaps_rollup``; None when not read in this
    sample (not readable, or read less often than RSS because it walks the page tables)."""

    pid: Count
    rss_bytes: Count
    num_threads: Count = 0
    cpu_time_ns: Count = 0
    name: str = ""
    pss_bytes: Optional[Count] = None
    swap_bytes: Optional[Count] = None


class PhaseProfile(Event, tag="phase_profile"):
    """Share of sampled stacks per phase over ``window_ns`` (py-spy); ``shares`` sum to 1."""

    pid: Count
    window_ns: Count
    num_samples: Count
    shares: dict[str, Fraction] = {}
    top_functions: list[tuple[str, NonNegative]] = []


class EngineMetrics(Event, tag="engine_metrics"):
    """Metrics scraped from the engine's own Prometheus ``/metrics``, summed over label sets.
    Counters (queries, hits, preemptions, tokens) are cumulative since the engine started and
    restart from zero with it; gauges are their value at the scrape.

    ``histograms``: the engine's latency histograms in seconds, keyed ``ttft_s`` (arrival to
    first token), ``inter_token_s`` (between consecutive output tokens), ``e2e_s`` (arrival to
    finish), ``queue_s`` (time waiting before scheduling); each a list of cumulative buckets
    ``(le, count)``: observations <= ``le`` seconds since the engine started, sorted by ``le``.
    The last bucket is +Inf, stored as ``INF_LE`` (the largest finite double) because JSON has
    no infinity; an infinite ``le`` given here is replaced by it."""

    INF_LE: ClassVar[float] = sys.float_info.max

    prefix_cache_queries_tokens: Optional[NonNegative] = None
    prefix_cache_hits_tokens: Optional[NonNegative] = None
    kv_cache_usage: Optional[NonNegative] = None  # fraction 0-1
    num_preemptions: Optional[NonNegative] = None
    num_requests_running: Optional[NonNegative] = None
    num_requests_waiting: Optional[NonNegative] = None
    raw: dict[str, Real] = {}  # every sample but histogram buckets and _created, by series
    # 1.2: the engine's cache config (vLLM's vllm:cache_config_info labels)
    block_size_tokens: Optional[Count] = None
    num_blocks: Optional[Count] = None  # KV blocks of the pool, summed over engines
    prefix_caching: Optional[bool] = None
    prompt_tokens: Optional[NonNegative] = None  # prompt tokens processed (cumulative)
    generation_tokens: Optional[NonNegative] = None  # output tokens generated (cumulative)
    histograms: dict[str, list[tuple[Real, NonNegative]]] = {}

    def __post_init__(self) -> None:
        # msgspec writes an infinite float as null, which would make the line unreadable
        for key, buckets in self.histograms.items():
            if any(le == math.inf for le, _ in buckets):
                self.histograms[key] = [(self.INF_LE if le == math.inf else le, c) for le, c in buckets]


# ---------------------------------------------------------------- shadow results


class ShadowSharing(Event, tag="shadow_sharing"):
    """What-if prefix sharing over the traffic seen so far. Block hit rate = hit blocks /
    referenced blocks; token hit rate = hit tokens / prompt tokens (requests counted at their
    arrival). ``capacity_blocks`` null means unbounded. ``engine_hit_rate``: the engine's own
    token hit rate for comparison.

    The ``finished_*`` counters (cumulative since the shadow started) cover one population on
    both sides: the requests that finished normally and whose arrival this cache counted:
    their number, their prompt tokens, this cache's hit tokens on them (at their arrival) and
    the engine's cached prompt tokens of the same requests. A reader compares engine and
    shadow over a window as the difference of two events' counters (a client that joins a
    running engine takes them at join time)."""

    policy: str
    block_size_tokens: Count
    capacity_blocks: Optional[Count]
    requests: Count
    block_hit_rate: Fraction
    token_hit_rate: Fraction
    request_hit_rate: Optional[Fraction] = None
    bytes_saved: Optional[Count] = None
    engine_hit_rate: Optional[Fraction] = None
    finished_requests: Optional[Count] = None
    finished_prompt_tokens: Optional[Count] = None
    finished_hit_tokens: Optional[Count] = None
    finished_engine_cached_tokens: Optional[Count] = None


class ShadowCompression(Event, tag="shadow_compression"):
    """A compressor run on a copy of one layer/head's live KV. Relative errors are
    ||x - x_hat|| / ||x|| (Frobenius); ``ratio`` = original bytes / stored bytes."""

    layer: Index
    head: Index
    method: str
    seq_len_tokens: Count
    ratio: NonNegative
    k_rel_error: NonNegative
    v_rel_error: NonNegative
    attn_score_error: Optional[NonNegative] = None
    attn_out_rel_error: Optional[NonNegative] = None
    encode_ns: Optional[Count] = None
    decode_ns: Optional[Count] = None


DISTANCE_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Bins of ``ShadowLocality.distance_hist``: attention mass at a distance (query position
minus key position, in tokens) in [DISTANCE_EDGES[i], DISTANCE_EDGES[i+1]); the last bin is
open-ended."""


class ShadowLocality(Event, tag="shadow_locality"):
    """Where one query head's attention went on a sampled decode step (fractions of 1)."""

    layer: Index
    head: Index
    seq_len_tokens: Count
    recent_mass: NonNegative  # on the most recent 20% of positions
    sink_mass: NonNegative  # on the first 4 positions
    other_mass: Real
    entropy_nats: Real
    outside_share: Optional[NonNegative] = None  # this head's share of the layer's non-recent mass
    distance_hist: list[NonNegative] = []


class ShadowSimilarity(Event, tag="shadow_similarity"):
    """Mean cosine similarity of K (and V) at the first ``positions`` of two request groups."""

    layer: Index
    positions: Count
    same_prompt: bool
    k_cosine: Real
    v_cosine: Real
    pairs: Count = 0


class ShadowLogits(Event, tag="shadow_logits"):
    """Teacher-forced next-token agreement of the whole model with compressed KV."""

    method: str
    tokens: Count
    kl_divergence: Real
    top1_agreement: Fraction


class ShadowDelta(Event, tag="shadow_delta"):
    """One layer of one KV block written out of the pool (offloaded, persisted, migrated),
    measured in shadow: the bytes a writer needs under four encodings (kvdiag.kernels.delta).

    ``full_bytes``: the block as served (K+V). ``dedup_bytes``: ``full_bytes``, or a 64-bit
    key when a bitwise-equal block is already stored. ``delta_bytes``: the smallest of
    ``dedup_bytes`` and a quantized delta against the most similar stored block at the same
    positions and layer (``reference``: duplicate, previous (this block's earlier version),
    other, zero (no stored block was closer than the zero block), full (no delta was
    smaller)). ``quant_bytes``: the same encoder against the zero block (quantization alone,
    at the same bound). ``prev_bytes``: a delta against the previous version of this block,
    when it was written before (a rewrite). Every delta keeps each element within
    ``error_bound`` x the rms of its (K/V, head); errors are those of ``delta_bytes``'s
    reconstruction: relative Frobenius errors of the block's K and V, and of the attention
    output of the sequence's last query with this block replaced (``attn_out_rel_error``).
    ``encode_ns`` includes the reference search."""

    layer: Index
    block_index: Count
    block_tokens: Count
    seq_len_tokens: Count
    rewrite: bool
    full_bytes: Count
    dedup_bytes: Count
    delta_bytes: Count
    quant_bytes: Count
    prev_bytes: Optional[Count] = None
    reference: str = "full"
    error_bound: NonNegative = 0.0
    k_rel_error: NonNegative = 0.0
    v_rel_error: NonNegative = 0.0
    attn_out_rel_error: Optional[NonNegative] = None
    encode_ns: Optional[Count] = None
    decode_ns: Optional[Count] = None


# ---------------------------------------------------------------- collector health


class ShadowBudget(Event, tag="shadow_budget"):
    """The shadow runner's sampling so far (cumulative since it saw its first decode step):
    steps offered to it, sampled (drawn at the rate in force and within the budget), skipped
    for the budget, and dropped (sampled while its worker was still busy); shadow work
    ``spent_ns`` against ``budget_frac`` x ``elapsed_ns``. ``clock="cpu"`` (schema 1.4): both
    are CPU time, ``elapsed_ns`` being the observed process's CPU outside shadow work;
    ``"wall"`` (older logs): wall time. ``sample_rate``: the rate in force after the budget
    adapted it, at most ``sample_rate_max``; the achieved rate is sampled / offered."""

    steps_offered: Count
    steps_sampled: Count
    steps_skipped_budget: Count
    steps_dropped: Count
    spent_ns: Count
    elapsed_ns: Count
    budget_frac: Optional[Fraction] = None
    clock: Literal["wall", "cpu"] = "wall"
    sample_rate: Optional[Fraction] = None
    sample_rate_max: Optional[Fraction] = None


class CollectorGap(Event, tag="collector_gap"):
    """Events between ``start_ns`` and ``end_ns`` were dropped (queue full, target busy)."""

    collector: str
    start_ns: TimestampNs
    end_ns: TimestampNs
    dropped_events: Count


class CollectorError(Event, tag="collector_error"):
    """A collector or shadow task raised; it was caught and counted, not propagated."""

    collector: str
    message: str
    count: Count = 1


class CollectorStatus(Event, tag="collector_status"):
    """A collector's availability, reported once: e.g. no CUDA, no NVML, no ptrace."""

    collector: str
    available: bool
    hint: str = ""


EVENT_TYPES: tuple[type[Event], ...] = (
    RequestArrived,
    RequestScheduled,
    RequestFirstToken,
    RequestFinished,
    RequestPreempted,
    EngineStep,
    KVPoolInfo,
    BlockAllocated,
    BlockStored,
    PrefixHit,
    BlockDeduplicated,
    BlockReleased,
    BlockEvicted,
    KVPoolSample,
    AllocatorSample,
    NvmlSample,
    ProcessSample,
    PhaseProfile,
    EngineMetrics,
    ShadowSharing,
    ShadowCompression,
    ShadowLocality,
    ShadowSimilarity,
    ShadowLogits,
    ShadowBudget,
    ShadowDelta,
    CollectorGap,
    CollectorError,
    CollectorStatus,
    PrefixCacheStored,
    PrefixCacheRemoved,
    PrefixCacheCleared,
    MemoryBandwidthProbe,
    HostEnergySample,
)

AnyEvent = Union[EVENT_TYPES]  # type: ignore[valid-type]

TAGS: dict[str, type[Event]] = {cls.__struct_config__.tag: cls for cls in EVENT_TYPES}


def elapsed_ns(start_ns: float, end_ns: float) -> int:
    """``end_ns - start_ns`` as a duration field: an int, at least 0 (two wall-clock readings
    can go backwards when the clock is stepped; a negative duration would make the line
    unreadable)."""
    return max(0, int(end_ns - start_ns))


def event_tag(cls_or_event: type[Event] | Event) -> str:
    """The ``type`` string that names an event class in JSON."""
    cls = cls_or_event if isinstance(cls_or_event, type) else type(cls_or_event)
    return cls.__struct_config__.tag


def fields_of(cls: type[Event]) -> tuple[str, ...]:
    """Field names of an event class, in declaration order (the DataFrame columns)."""
    return cls.__struct_fields__


def parse_version(version: str) -> tuple[int, int]:
    """``"1.3"`` -> ``(1, 3)``; raises ValueError on anything else."""
    major, _, minor = version.partition(".")
    return int(major), int(minor or 0)
