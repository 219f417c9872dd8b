"""Capacity plan: the KV memory a workload needs on a model, and the GPUs that holds it.

From a model shape (:mod:`kvdiag.pool.kv_shape`), a workload
(:mod:`kvdiag.traces.workload`) and engine settings, the event simulation of
:mod:`kvdiag.simulation.concurrency` gives the KV blocks live requests hold over time; bytes are
blocks x block size x ``kv_bytes_per_token`` (so block-rounded), and

    GPUs needed = ceil(KV bytes / (GPU memory x KV share))

for the peak and for the time-weighted P99. Variants: as is; with prefix sharing (exact from
the prompts' content keys when the trace has them, else prompts shortened by a measured token
hit rate); with compression (bytes / ratio, every layer); with both.

Timing ("how long a request holds its KV"): ``recorded`` takes each request's first-token and
finish times from a log; ``model`` starts decoding ``prompt x prefill_s_per_token`` after
arrival and produces one token every ``decode_s_per_token`` (no queueing: the engine is
assumed to keep up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvdiag.simulation import concurrency
from kvdiag.pool.kv_shape import ModelShape, kv_bytes_per_token
from kvdiag.traces.workload import Workload

GIB = 2**30


@dataclass
class PlanSettings:
    """Engine and hardware settings of a plan (units in the names)."""

    dtype: str
    block_size_tokens: int = 16
    gpu_memory_gib: float = 80.0
    kv_share: float = 0.5  # fraction of each GPU's memory given to KV
    gpus_per_server: int = 8
    timing: str = "model"  # "model" or "recorded"
    decode_s_per_token: float = 0.02
    prefill_s_per_token: float = 0.0
    decode_source: str = "assumed"
    sharing_hit_rate: Optional[float] = None  # token hit rate when no content keys are used
    sharing_source: str = ""
    use_prompt_keys: bool = True
    compression_ratio: Optional[float] = None
    compression_source: str = ""
    pool_blocks: Optional[int] = None  # a KV pool to replay the demand against (what-if)

    @property
    def kv_bytes_per_gpu(self) -> int:
        return int(self.gpu_memory_gib * GIB * self.kv_share)


@dataclass
class PlanRow:
    """One variant's KV need: blocks held (peak, time-weighted P99, mean) and what they cost."""

    variant: str
    assumption: str
    peak_blocks: int
    p99_blocks: int
    mean_blocks: float
    peak_kv_bytes: int
    p99_kv_bytes: int
    gpus_needed: int  # for the peak
    gpus_needed_p99: int
    servers_needed: float  # gpus_needed / gpus per server


@dataclass
class Plan:
    model: ModelShape
    settings: PlanSettings
    workload: Workload
    kv_bytes_per_token: int
    sequences: concurrency.Timeline
    blocks: concurrency.Timeline
    rows: list[PlanRow]
    littles_law_sequences: float
    assumptions: list[str] = field(default_factory=list)
    overflow: Optional[concurrency.PoolOverflow] = None  # of the demand over the pool
    pool_demand: str = ""  # which variant's demand the pool is compared with
    reserved_peak_blocks: Optional[int] = None  # admission by predicted growth (see there)

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.settings.block_size_tokens


def formula(model: ModelShape, dtype: str, bytes_per_token: int) -> str:
    from kvdiag.pool.kv_shape import element_bytes

    return (f"2 x {model.num_layers} layers x {model.num_kv_heads} KV heads x {model.head_dim} "
            f"head_dim x {element_bytes(dtype)} bytes ({dtype}) = {bytes_per_token:,} bytes/token")


def schedule(workload: Workload, settings: PlanSettings) -> concurrency.HoldSchedule:
    """Each request's hold interval under the settings' timing (module docstring)."""
    if settings.timing == "recorded":
        if not workload.recorded_timing:
            raise ValueError("recorded timing needs first-token and finish times (a kvdiag log)")
        first, finish = workload.first_token_s, workload.finish_s
    else:
        first = workload.arrival_s + workload.prompt_tokens * settings.prefill_s_per_token
        finish = first + workload.output_tokens * settings.decode_s_per_token
    return concurrency.HoldSchedule(workload.arrival_s, first, finish, workload.prompt_tokens,
                                    workload.output_tokens)


def derived_timing(workload: Workload) -> tuple[float, float]:
    """(decode s/token, prefill s/token) measured on a log's requests: medians over requests of
    (finish - first token) / output tokens and (first token - arrival) / prompt tokens."""
    o, p = workload.output_tokens, workload.prompt_tokens
    decode = (workload.finish_s - workload.first_token_s)[o > 0] / o[o > 0]
    prefill = (workload.first_token_s - workload.arrival_s)[p > 0] / p[p > 0]
    return (float(np.median(decode)) if len(decode) else 0.0,
            float(np.median(prefill)) if len(prefill) else 0.0)


def _row(variant: str, assumption: str, blocks: concurrency.Timeline, block_bytes: int,
         settings: PlanSettings, ratio: float = 1.0) -> PlanRow:
    peak_b = int(math.ceil(blocks.peak * block_bytes / ratio))
    p99_b = int(math.ceil(blocks.quantile(0.99) * block_bytes / ratio))
    per_gpu = settings.kv_bytes_per_gpu
    gpus = -(-peak_b // per_gpu)
    return PlanRow(variant, assumption, blocks.peak, blocks.quantile(0.99), blocks.mean(),
                   peak_b, p99_b, gpus, -(-p99_b // per_gpu), gpus / settings.gpus_per_server)


def make_plan(workload: Workload, model: ModelShape, settings: PlanSettings) -> Plan:
    """The plan (module docstring) with every assumption it rests on, in words."""
    bpt = kv_bytes_per_token(model, settings.dtype)
    block_bytes = bpt * settings.block_size_tokens
    sched = schedule(workload, settings)
    seqs = concurrency.sequences(sched)
    base = concurrency.held_blocks(sched, settings.block_size_tokens)
    rows = [_row("as is", "no prefix sharing, no compression", base, block_bytes, settings)]
    shared, exact_sharing = None, False
    if settings.use_prompt_keys and workload.prompt_keys is not None and settings.sharing_hit_rate is None:
        shared = concurrency.held_blocks(sched, settings.block_size_tokens, keys=workload.prompt_keys)
        exact_sharing = True
        sharing_text = ("prefix sharing among live requests, exact from the trace's prompt "
                        "content keys")
    elif settings.sharing_hit_rate is not None:
        h = settings.sharing_hit_rate
        prompts = workload.prompt_tokens - np.rint(h * workload.prompt_tokens).astype(np.int64)
        shared = concurrency.held_blocks(sched, settings.block_size_tokens, prompt_tokens=prompts)
        sharing_text = (f"token hit rate {h:.1%} ({settings.sharing_source}): each prompt holds "
                        "only its (1 - hit rate) share in new blocks")
    if shared is not None:
        rows.append(_row("prefix sharing", sharing_text, shared, block_bytes, settings))
    r = settings.compression_ratio
    if r:
        rows.append(_row("compression", f"{r:.2f}x fewer bytes on every layer "
                         f"({settings.compression_source})", base, block_bytes, settings, r))
        if shared is not None:
            rows.append(_row("sharing + compression", "both of the above", shared, block_bytes,
                             settings, r))
    span = float(workload.arrival_s[-1] - workload.arrival_s[0]) if workload.requests > 1 else 0.0
    rate = (workload.requests - 1) / span if span > 0 else float("nan")
    littles = rate * float(np.mean(sched.finish_s - sched.start_s))
    plan = Plan(model, settings, workload, bpt, seqs, base, rows, littles)
    if settings.pool_blocks is not None:
        demand = shared if exact_sharing else base
        plan.pool_demand = "with exact prefix sharing" if exact_sharing else "as is"
        plan.overflow = concurrency.pool_overflow(demand, sched, settings.pool_blocks)
        plan.reserved_peak_blocks = concurrency.predicted_reservations(
            sched, settings.block_size_tokens).peak
    plan.assumptions = assumptions(plan)
    return plan


def assumptions(plan: Plan) -> list[str]:
    """Every assumption behind the plan's numbers, in words."""
    s, m = plan.settings, plan.model
    queries = m.num_query_heads or "?"
    out = [f"model {m.name}: {m.num_layers} layers, {queries} query heads, "
           f"{m.num_kv_heads} KV heads ({m.attention}), head_dim {m.head_dim}; source: {m.source}",
           f"KV dtype {s.dtype}: {formula(m, s.dtype, plan.kv_bytes_per_token)}",
           f"workload: {plan.workload.source}"]
    if s.timing == "recorded":
        out.append("timing: each request's arrival, first token and finish as the log recorded "
                   "them; tokens produced evenly between first token and finish")
    else:
        out.append(f"timing: decoding starts {s.prefill_s_per_token * 1e3:g} ms per prompt token "
                   f"after arrival, then one token every {s.decode_s_per_token * 1e3:g} ms per "
                   f"request ({s.decode_source}); no queueing (the engine keeps up with the load)")
    out += [f"a request holds prompt + generated tokens, rounded up to blocks of "
            f"{s.block_size_tokens} tokens, from arrival to finish; KV held only by a prefix "
            "cache after its requests finished is not counted",
            f"each GPU gives {s.kv_share:.0%} of {s.gpu_memory_gib:g} GiB to KV "
            f"({s.kv_bytes_per_gpu / GIB:.1f} GiB); {s.gpus_per_server} GPUs per server; "
            "KV is spread over GPUs without waste (tensor/pipeline parallel splits are ignored)",
            "P99 is time-weighted over the simulated span (from the first arrival to the last "
            "finish, including warm-up and drain)"]
    if s.pool_blocks is not None:
        out.append(f"pool what-if: {s.pool_blocks:,} blocks against the demand {plan.pool_demand}, "
                   "simulated unconstrained "
                   "(no queueing, no preemption) and compared with the pool; a request live while "
                   "demand exceeds the pool counts as affected (preempted or OOM); predicted "
                   "growth = prompt + mean output of the requests finished before it arrived")
    out += plan.workload.notes
    return out


def to_json(plan: Plan, bins: int = 100) -> dict:
    """The plan as one JSON-ready dict (``kvdiag plan --json``)."""
    from dataclasses import asdict

    s, m, w = plan.settings, plan.model, plan.workload

    def dist(a: np.ndarray) -> dict:
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
                "p99": float(np.percentile(a, 99)), "max": int(a.max())}

    seq_bins = dict(plan.sequences.binned_max(bins))
    return {
        "model": {**asdict(m), "attention": m.attention, "kv_dtype": s.dtype,
                  "kv_bytes_per_token": plan.kv_bytes_per_token,
                  "formula": formula(m, s.dtype, plan.kv_bytes_per_token)},
        "workload": {"source": w.source, "requests": w.requests,
                     "span_s": float(w.arrival_s[-1] - w.arrival_s[0]),
                     "prompt_tokens": dist(w.prompt_tokens), "output_tokens": dist(w.output_tokens)},
        "engine": {"block_size_tokens": s.block_size_tokens, "block_bytes": plan.block_bytes,
                   "gpu_memory_gib": s.gpu_memory_gib, "kv_share": s.kv_share,
                   "kv_bytes_per_gpu": s.kv_bytes_per_gpu, "gpus_per_server": s.gpus_per_server},
        "timing": {"mode": s.timing, "decode_s_per_token": s.decode_s_per_token,
                   "prefill_s_per_token": s.prefill_s_per_token, "decode_source": s.decode_source},
        "sequences": {"peak": plan.sequences.peak, "p99": plan.sequences.quantile(0.99),
                      "mean": plan.sequences.mean(), "littles_law": plan.littles_law_sequences},
        "rows": [asdict(r) for r in plan.rows],
        "timeline": [{"t_s": t, "sequences_max": seq_bins.get(t, 0), "blocks_max": b}
                     for t, b in plan.blocks.binned_max(bins)],
        "assumptions": plan.assumptions,
        "pool": None if plan.overflow is None else {
            **asdict(plan.overflow), "demand": plan.pool_demand, "pool_bytes": plan.overflow.pool_blocks * plan.block_bytes,
            "predicted_reservation_peak_blocks": plan.reserved_peak_blocks},
    }
