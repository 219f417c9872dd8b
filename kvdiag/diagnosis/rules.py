"""Every check kvdiag makes, defined once: its id, what it checks, its thresholds and verdict.

``kvdiag doctor``, ``kvdiag report`` and ``kvdiag top``'s alerts all evaluate these checks
through :func:`kvdiag.diagnosis.doctor.run_rules` (``top`` over the events it has seen so far,
the others over a recorded log), so the same events give the same verdict in every view. The
analyses measure (leaks, fragmentation, memory, latency, sharing); this module judges. A
number that decides pass, warn or fail lives here and nowhere else.
"""

from __future__ import annotations

from typing import Literal, Optional

from kvdiag.diagnosis.findings import Status

# ---------------------------------------------------------------- memory leak checklist

RELEASE_GRACE_NS = 5_000_000_000
"""``leak.finished_holding``/``leak.release_paths``: a request that finished this long before
the end of the window must have released its KV blocks (engines release on the next step)."""

GROWTH_WARN = (0.05, 32 << 20)
"""``leak.memory_growth`` warns when process memory grew beyond KV growth by both this share
of its starting size and this many bytes ..."""
GROWTH_FAIL = (0.10, 128 << 20)
"""... and fails at both of these."""

# ---------------------------------------------------------------- enough samples
# A rule judges a window only with enough of what it compares; with fewer it says
# ``n/a (N of M needed)`` (:func:`too_few`), never a verdict on noise.

MIN_MEMORY_SAMPLES = 4
"""``leak.memory_growth``: memory samples per process/device in the serving window (its growth
compares the median of the first and the last 10% of them, at least 2 each)."""

MIN_POOL_GROWTH_SAMPLES = 3
"""``leak.pool_growth``: KV pool samples at the window's lowest running-request count, none of
them taken while a running request is still in its prefill."""

MIN_SHARING_REQUESTS = 10
"""``sharing.consistency``: finished requests in the window whose prompts both the shadow
cache and the engine counted (a gap over a handful of requests is one prompt's luck)."""


def too_few(have: int, need: int, what: str) -> str:
    """The message of a rule that lacks samples: ``n/a (N of M needed)`` with what it counts."""
    return f"n/a ({have} of {need} needed): {what}"


FRAGMENTATION_LIMIT = 0.15
"""``fragmentation.*``: the share of empty token slots among the slots of held KV blocks (KV
pool), or of reserved bytes not allocated (torch's allocator), at which a pool is fragmented."""

# ---------------------------------------------------------------- forecast, sharing, P99

PRESSURE_WARN = 0.8
"""``forecast.memory_pressure``: warn when the blocks active requests still need exceed this
share of the free blocks (fail above 1: preemption or OOM ahead)."""

SHARING_GAP_LIMIT = 0.10
"""``sharing.consistency``: the content's hit rate (shadow cache at the engine's settings)
minus the engine's own, beyond which the engine's prefix cache misses what it could hit (or
reports hits the content cannot explain): 10 percentage points."""

P99_THRESHOLD = 0.10
"""``p99.regression``: fail when the 90% bootstrap interval of P99_current / P99_baseline - 1
lies wholly above +10% (:mod:`kvdiag.diagnosis.latency`)."""

REGRESSION_MIN_SAMPLES = {0.99: 100, 0.90: 50, 0.50: 20}
"""``p99.regression``: the fewest samples on each side for comparing a quantile. P99 needs 100
(below, the P99 is the sample maximum and the bootstrap interval of a maximum is too narrow:
6-7 false alarms in 100 were measured at n = 50-60); P90 and P50 need at least 5 and 10
samples above them. A latency with too few samples for P99 is compared at the highest quantile
its counts allow (P90, then P50), with :data:`GROSS_SHIFT_THRESHOLD`; with fewer than the P50's
count it is ``n/a (N of M needed)``, never a pass."""
GROSS_SHIFT_THRESHOLD = 0.50
"""``p99.regression``'s fallback comparison (P90 or P50, too few samples for P99): fail only
on a gross shift, when the 90% bootstrap interval of the ratio lies wholly above +50%.
Requests in a queue are not independent (a backlog delays its neighbours), so small logs judge
only large shifts; the fallback splits at the middle request (halves), not at a change point
chosen to maximise the difference."""

# P99 causes (kvdiag.diagnosis.causes): what counts as "rose" or "dropped" between the windows
# before and after the change point, as absolute changes of fractions or ratios of rates
HIT_RATE_DROP = 0.05
HIT_RATE_FLUCTUATION = 0.05
LONG_SHARE = 0.05
RATE_RATIO = 1.5
PRESSURE_HIGH = 0.90
FRAGMENTATION_RISE = 0.05
EVICTION_RISE = 2.0
"""``memory_pressure`` cause: prefix-cache evictions per second rose by at least this factor."""
QUEUE_WAIT_RISE = 2.0
"""``queueing`` cause: the median queue wait rose by at least this factor between the windows
(and reached :data:`QUEUE_WAIT_FLOOR_NS`)."""

# ---------------------------------------------------------------- latency as users see it

QUEUE_MIN_REQUESTS = 20
"""``latency.queueing``: the fewest finished requests with a queue wait and a TTFT to judge."""
QUEUE_SHARE_LIMIT = 0.5
"""``latency.queueing``: queue wait dominates TTFT when, at the median over finished requests,
at least half of a request's TTFT was spent queued (queue wait / TTFT, per request) ..."""
QUEUE_WAIT_FLOOR_NS = 100_000_000
"""... and the median queue wait is at least 100 ms: below, waiting is a step or two for a
batch slot, not a backlog a user notices."""
OVERLOAD_RATIO = 1.2
"""``latency.queueing``: the load exceeds what the engine serves when the arrival rate is at
least 1.2x the completion rate over the window (:mod:`kvdiag.diagnosis.user_latency`); equal
rates within sampling noise are a sustainable load."""


def queueing_status(queue_share_p50: float, queue_p50_ns: float, rate_ratio: float) -> Status:
    """Verdict of ``latency.queueing``: fail when queue wait dominates TTFT (median share >=
    :data:`QUEUE_SHARE_LIMIT` with a median wait >= :data:`QUEUE_WAIT_FLOOR_NS`) and arrivals
    outpace completions (ratio >= :data:`OVERLOAD_RATIO`): a backlog that grows; warn on either
    alone; pass otherwise. NaN (not measured) counts as not met."""
    queued = bool(queue_share_p50 >= QUEUE_SHARE_LIMIT and queue_p50_ns >= QUEUE_WAIT_FLOOR_NS)
    overloaded = bool(rate_ratio >= OVERLOAD_RATIO)
    return "fail" if queued and overloaded else "warn" if queued or overloaded else "pass"


def queue_wait_rose(p50_before_ns: float, p50_after_ns: float) -> bool:
    """Verdict of the ``queueing`` P99 cause: the median queue wait rose by
    :data:`QUEUE_WAIT_RISE` (from any measured value, zero included) to at least
    :data:`QUEUE_WAIT_FLOOR_NS`; unmeasured (NaN) in either window is no rise."""
    return bool(p50_before_ns >= 0 and p50_after_ns >= QUEUE_WAIT_FLOOR_NS
                and p50_after_ns >= QUEUE_WAIT_RISE * p50_before_ns)

KV_BANDWIDTH_RISE = 1.5
"""``p99.kv_bandwidth``: the demanded KV read bandwidth (KV bytes read per second of engine
steps, :mod:`kvdiag.diagnosis.bandwidth`) rose by at least this factor ..."""
KV_BANDWIDTH_BUSY = 0.6
"""... or the window's utilisation of the measured copy bandwidth reached this share while
the KV bytes read per step rose by that factor (a saturated bandwidth cannot rise further:
each step reads more and takes longer)."""


def kv_bandwidth_rose(rate_before: float, rate_after: float, bytes_per_step_before: float,
                      bytes_per_step_after: float, utilisation_after: float) -> bool:
    """Verdict of the ``kv_bandwidth`` P99 cause between the windows before and after (NaN
    utilisation: no probe, judged on the demanded bandwidth alone)."""
    def rose(before: float, after: float) -> bool:
        return bool(after > 0 and (not before > 0 or after >= KV_BANDWIDTH_RISE * before))
    saturated = bool(utilisation_after >= KV_BANDWIDTH_BUSY)  # False for NaN
    return rose(rate_before, rate_after) or (saturated and rose(bytes_per_step_before, bytes_per_step_after))

# ---------------------------------------------------------------- engine event streams


def kv_event_gaps_status(kv_events: int, gaps: int) -> Status:
    """Verdict of ``kv_events.gaps``: n/a with neither KV cache events nor gaps of their
    stream; warn on any gap (batches the subscriber lost and could not replay); pass otherwise.
    Warn, not fail: the observation is incomplete, not the engine faulty. What is derived
    from the stream (the keys the cache holds, duplicate stores, the replayed traffic) misses
    the lost batches and must be read with that in mind, but no request was served worse, so
    ``kvdiag doctor`` does not exit non-zero for it."""
    if not kv_events and not gaps:
        return "n/a"
    return "warn" if gaps else "pass"


def kv_stream_health_status(events: int, removed_before_stored: int, duplicate_batches: int,
                            clear_storms: int, over_pool_batches: int) -> Status:
    """Verdict of ``kv_events.health`` (:mod:`kvdiag.pool.kv_stream_health` defines each count): n/a
    without KV-event stream events; warn on any key removed before it was stored on a complete
    stream, any duplicate batch, any ``AllBlocksCleared`` storm, or any batch after which more
    keys are held in the device tier than the pool has blocks; pass otherwise. Warn, not fail:
    each says the stream (what a router or kvdiag builds from it) disagrees with the engine's
    cache, not that a request was served worse. Gaps are ``kv_events.gaps``; duplicate stores
    are counted, not judged (vLLM legitimately stores one content twice)."""
    if not events:
        return "n/a"
    bad = removed_before_stored or duplicate_batches or clear_storms or over_pool_batches
    return "warn" if bad else "pass"


# ---------------------------------------------------------------- compression

COMPRESSION_USE_MAX = 0.01
"""Relative error of the attention output up to which a compression method is safe to use."""
COMPRESSION_ERROR_BUDGET = 0.03
"""Relative error of the attention output up to which a method may be used after checking
its per-head table and the logits test; beyond it, avoid. The recommendation per layer group
picks the cheapest method within this budget."""

CompressionVerdict = Literal["use", "check", "avoid"]


def compression_verdict(rel_error: float) -> CompressionVerdict:
    """"use" at <= 1%, "check" at <= 3% (the error budget), "avoid" above."""
    if rel_error <= COMPRESSION_USE_MAX:
        return "use"
    if rel_error <= COMPRESSION_ERROR_BUDGET:
        return "check"
    return "avoid"


def growth_status(share: float, unexplained_bytes: float) -> Status:
    """Verdict of ``leak.memory_growth`` on unexplained growth (share of the start, bytes)."""
    if share >= GROWTH_FAIL[0] and unexplained_bytes >= GROWTH_FAIL[1]:
        return "fail"
    if share >= GROWTH_WARN[0] and unexplained_bytes >= GROWTH_WARN[1]:
        return "warn"
    return "pass"


def fragmentation_status(value: float, limit: float = FRAGMENTATION_LIMIT) -> Status:
    """Verdict of a fragmentation share: warn at or above the limit."""
    return "warn" if value >= limit else "pass"


def within_fragmentation_limit(value: float) -> bool:
    """What the live panels mark with a check: the same verdict as :func:`fragmentation_status`."""
    return fragmentation_status(value) == "pass"


def pressure_status(need_ratio: float) -> Status:
    """Verdict of ``forecast.memory_pressure`` on blocks needed / blocks free."""
    return "fail" if need_ratio > 1 else "warn" if need_ratio > PRESSURE_WARN else "pass"


def unexplained_gap(gap: float, explained_tokens: int, prompt_tokens: Optional[int]) -> float:
    """``sharing.consistency``: the part of the gap (shadow minus engine hit rate over the same
    requests, of ``prompt_tokens`` prompt tokens) that the engine's own events do not explain. A
    positive gap less the share of ``explained_tokens``: those the shadow held and the engine
    missed because it had evicted them (its ``BlockEvicted``/``BlockStored``: running requests
    took the pool's blocks) or preempted the request
    (:func:`kvdiag.diagnosis.miss_tally.explained_tokens`), never below 0; a negative gap (hits
    the content cannot explain) as it is."""
    if gap <= 0 or not explained_tokens or not prompt_tokens:
        return gap
    return max(gap - explained_tokens / prompt_tokens, 0.0)


def sharing_gap_status(gap: float) -> Status:
    """Verdict of ``sharing.consistency`` on the :func:`unexplained_gap`."""
    return "warn" if abs(gap) > SHARING_GAP_LIMIT else "pass"


# ---------------------------------------------------------------- leak, OOM and pool verdicts

MIN_POOL_GROWTH_BLOCKS = 1
"""``leak.pool_growth``: blocks held by live requests at the window's lowest load that grew by
at least this many between its first and last such sample is growth, not noise."""


def finished_holding_status(holding_requests: int) -> Status:
    """Verdict of ``leak.release_paths`` (``leak.finished_holding``): fail when any request
    that finished more than :data:`RELEASE_GRACE_NS` ago still holds a KV block."""
    return "fail" if holding_requests else "pass"


def double_release_status(double_releases: int) -> Status:
    """Verdict of ``leak.double_release``: fail on any release of a block the same request had
    already released (a release path that fires twice corrupts the free list)."""
    return "fail" if double_releases else "pass"


def pool_growth_status(growth_blocks: float, min_growth_blocks: int = MIN_POOL_GROWTH_BLOCKS) -> Status:
    """Verdict of ``leak.pool_growth`` on the growth of blocks held by live requests at the
    window's lowest load: fail at :data:`MIN_POOL_GROWTH_BLOCKS` or more."""
    return "fail" if growth_blocks >= min_growth_blocks else "pass"


def oom_status(ooms: int, alloc_retries: int, failed_requests: int) -> Status:
    """Verdict of ``leak.oom``: fail on an out-of-memory error; warn on an allocator retry
    (cudaMalloc failed and the cache was flushed: the next one may be an OOM) or a request
    that failed."""
    return "fail" if ooms else "warn" if alloc_retries or failed_requests else "pass"


def preemption_status(preemptions: int) -> Status:
    """Verdict of ``pool.preemptions``: warn on any request preempted for lack of KV blocks
    (its KV is recomputed or swapped; its latency suffers, nothing is lost)."""
    return "warn" if preemptions else "pass"


def p99_regression_status(flagged: int) -> Status:
    """Verdict of ``p99.regression``: fail when any latency's comparison was flagged (its
    interval wholly above :data:`P99_THRESHOLD`, or for a fallback quantile above
    :data:`GROSS_SHIFT_THRESHOLD`)."""
    return "fail" if flagged else "pass"


# ---------------------------------------------------------------- P99 cause verdicts
# Each candidate cause of a P99 regression (kvdiag.diagnosis.causes) is "supported" by one of
# these, comparing the window before the change point with the window after it.


def rose(before: float, after: float, ratio: float = RATE_RATIO) -> bool:
    """A rate rose: it is positive after and was zero before, or grew by at least ``ratio``."""
    return bool(after > 0 and (before <= 0 or after >= ratio * before))


def hit_rate_moved(before: float, after: float, std_before: float, std_after: float) -> bool:
    """``prefix_hit_rate``: the token hit rate dropped by :data:`HIT_RATE_DROP` or more, or its
    std over sub-windows reached :data:`HIT_RATE_FLUCTUATION` and twice the baseline's (NaN:
    not measured, never supports)."""
    import math
    dropped = math.isfinite(before) and math.isfinite(after) and before - after >= HIT_RATE_DROP
    base = std_before if math.isfinite(std_before) else 0.0
    fluct = math.isfinite(std_after) and std_after >= max(HIT_RATE_FLUCTUATION, 2 * base)
    return bool(dropped or fluct)


def long_sequences_rose(share_before: float, share_after: float) -> bool:
    """``long_sequences``: the share of prompts longer than the baseline's P90 reached
    :data:`LONG_SHARE` and at least doubled."""
    return bool(share_after >= max(LONG_SHARE, 2 * share_before))


def occupancy_crossed(peak_before: float, peak_after: float) -> bool:
    """``memory_pressure`` (one of its signs): the pool's peak occupancy reached
    :data:`PRESSURE_HIGH` after, and had not before."""
    return bool(peak_after >= PRESSURE_HIGH > peak_before)


def fragmentation_rose(rise: float) -> bool:
    """``fragmentation``: the pool's or the allocator's fragmentation rose by
    :data:`FRAGMENTATION_RISE` or more (absolute share)."""
    return bool(rise >= FRAGMENTATION_RISE)


# ---------------------------------------------------------------- the catalogue

CHECKLISTS: dict[str, tuple[str, ...]] = {
    "memory leak": ("leak.memory_growth", "leak.release_paths", "leak.double_release", "leak.pool_growth",
                    "fragmentation.kv_pool", "fragmentation.allocator", "leak.oom"),
    "latency": ("latency.queueing", "p99.regression", "p99.compression", "p99.kv_bandwidth",
                "p99.prefix_hit_rate", "p99.long_sequences", "p99.memory_pressure", "p99.fragmentation",
                "p99.queueing"),
    "forecast": ("forecast.memory_pressure",),
    "sharing": ("sharing.consistency",),
    "pool": ("pool.preemptions",),
    "observation": ("kv_events.gaps", "kv_events.health"),
    "engine numbers": ("engine.number_traps",),
}
"""Every rule id the doctor reports, by checklist, in the order it reports them. The doctor's
registry (:data:`kvdiag.diagnosis.doctor.REGISTRY`) evaluates exactly these; Prometheus alerts
(:mod:`kvdiag.prometheus.alert_rules`) and top's alerts name rules by these ids."""

RULE_IDS: tuple[str, ...] = tuple(r for ids in CHECKLISTS.values() for r in ids)


# ---------------------------------------------------------------- engine-number traps

USAGE_TRAP_GAP = 0.10
"""``engine.number_traps`` (usage_counts_blocks): the engine's block-usage gauge peak minus the
peak share of token slots written, beyond which its usage misleads (10 points of the pool)."""

GAUGE_PEAK_TRAP_GAP = 0.10
"""``engine.number_traps`` (gauge_is_a_point_in_time): kvdiag's pool-sample peak minus the
engine gauge's peak over its scrapes, beyond which the scrapes missed the peak."""


def number_traps_status(traps: int, checked: int) -> Status:
    """``engine.number_traps``: warn on any trap, n/a when no check had its inputs."""
    if not checked:
        return "n/a"
    return "warn" if traps else "pass"
