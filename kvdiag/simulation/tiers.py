"""Tiered prefix-cache what-if: GPU, CPU, disk (or any stack of tiers) with LRU in each.

Rules (one pool of blocks keyed by chained content hashes, as in :mod:`kvdiag.simulation.sharing`;
tier 0 is the top, e.g. GPU memory, the others lie below it in the order given):

- **Lookup.** A request reuses the longest run of its leading blocks found in *any* tier and
  stops at the first miss. A hit block is served by the highest tier holding it.
- **Promotion.** Every block of the request ends in the top tier, in prompt order: a block in
  the top tier is touched (most recent); a block found only below is promoted to the top (its
  bytes are read from that tier: a *promotion*, on the request's critical path) if it was a
  prefix hit; past the first miss it is recomputed and simply put in the top tier (no bytes
  read); a block in no tier is computed and inserted.
- **Eviction = demotion.** A tier over its capacity evicts its least recently used block and
  demotes it to the tier below (bytes written down: a *demotion*), unless that tier already
  holds it; a full tier below evicts in turn; the last tier's victim is dropped.
- **Write policy of the lower tiers.** ``back`` (write-back, exclusive): a block is written
  below only when it is demoted, and a promoted block leaves the tier it was read from: every
  block lives in at most one tier. ``through`` (write-through, "asynchronous persistence"):
  every newly computed block is also written at once into every tier below the top (top tier
  first, then each lower tier in order), and copies stay where they are when promoted (a read
  makes the copy the most recent of its tier), so eviction from a tier whose block is already
  persisted below moves no bytes.
- A tier of capacity 0 evicts what it receives at once; ``None`` = unbounded.

With one tier this is exactly :func:`kvdiag.simulation.sharing.simulate` with ``lru``; with an
unbounded tier below, every block ever seen stays somewhere, so the any-tier hit rate is the
unbounded single cache's.

Quantities, per tier ``t``, each with its denominator:

- block hit rate = prefix-hit blocks served by ``t`` / referenced blocks (all requests');
  token hit rate = their tokens / prompt tokens (tokens per block as in sharing.py);
- promoted bytes = blocks promoted from ``t`` x bytes per block (a whole block moves even when
  the prompt fills it partly); demoted-in bytes = blocks demoted into ``t`` from the tier above;
  written bytes = write-through stores into ``t``; each also per second of the trace's span
  (first to last arrival; None without arrival times);
- TTFT effect per request = (tokens served by ``t`` x prefill seconds per token) - promoted
  bytes from ``t`` / ``t``'s bandwidth, divided by requests. Demotions and write-through stores
  are assumed asynchronous (off the critical path, as LMCache, Mooncake Store and Dynamo's KVBM
  offload), so only promotions cost TTFT. The top tier moves no bytes to be read.
- versus the top tier alone: hit tokens of the stack - hit tokens of an LRU cache of the top
  tier's capacity alone, times prefill seconds per token, minus all transfer time; per request.
- link busy = (promoted + demoted-in + written bytes) / span / the tier's bandwidth: one link
  for both directions; transfers are not queued in the simulation, so near or above 1 the
  TTFT effect is optimistic.

The tiers come from :mod:`kvdiag.simulation.tier_spec` (``--tiers``); prefill seconds per
token, given or fitted on a log, from :mod:`kvdiag.simulation.prefill_rate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd

from kvdiag.simulation import _tierkernels as K
from kvdiag.simulation.replay_common import CHUNK_REFS, request_chunks
from kvdiag.simulation.sharing import simulate
from kvdiag.traces.trace import Trace
from kvdiag.simulation.tier_spec import Tier

WRITE_MODES = ("back", "through")


@dataclass
class TieredResult:
    """One tiered run (module docstring has the rules and the definitions)."""

    tiers: list[Tier]
    write: str
    block_size_tokens: int
    requests: int
    block_refs: int
    prompt_tokens: int
    counters: np.ndarray = field(repr=False)  # int64 [tiers, K.N_TIER_COUNTERS]
    final_sizes: np.ndarray = field(repr=False)  # blocks held per tier at the end
    request_hit_blocks: np.ndarray = field(repr=False)  # int64 [requests]: any tier
    request_tier_hit_blocks: np.ndarray = field(repr=False)  # int64 [requests, tiers]
    request_tier_hit_tokens: np.ndarray = field(repr=False)  # int64 [requests, tiers]
    block_bytes: Optional[int] = None
    span_s: Optional[float] = None
    prefill_s_per_token: Optional[float] = None
    prefill_source: str = "not given"
    top_alone_hit_tokens: Optional[int] = None  # LRU with the top tier's capacity alone

    def counter(self, t: int, which: int) -> int:
        return int(self.counters[t, which])

    @property
    def hit_blocks(self) -> int:
        return int(self.request_hit_blocks.sum())

    @property
    def hit_tokens(self) -> int:
        return int(self.request_tier_hit_tokens.sum())

    @property
    def block_hit_rate(self) -> float:
        """Prefix-hit blocks in any tier / referenced blocks."""
        return self.hit_blocks / self.block_refs if self.block_refs else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def _bytes(self, blocks: int) -> Optional[int]:
        return None if not self.block_bytes else int(blocks) * self.block_bytes

    def _rate(self, blocks: int) -> Optional[float]:
        b = self._bytes(blocks)
        return None if b is None or not self.span_s else b / self.span_s

    def _busy(self, t: int, blocks: int) -> Optional[float]:
        """Share of the span the tier's link is busy moving ``blocks`` at its bandwidth (one
        link for reads and writes; > 1: it cannot keep up, and queueing, which is not
        simulated, would add to TTFT)."""
        rate = self._rate(blocks)
        bw = self.tiers[t].bandwidth_bytes_per_s
        return None if t == 0 or rate is None or not bw else rate / bw

    def request_ttft_s(self) -> Optional[np.ndarray]:
        """Per request and tier [requests, tiers]: prefill seconds saved by the tokens the tier
        served minus the seconds to read its promoted blocks (0 where the bandwidth is not
        given or the bytes per block unknown). None without prefill seconds per token."""
        if self.prefill_s_per_token is None:
            return None
        saved = self.request_tier_hit_tokens * self.prefill_s_per_token
        cost = np.zeros(saved.shape)
        for t, tier in enumerate(self.tiers):
            if t and tier.bandwidth_bytes_per_s and self.block_bytes:
                cost[:, t] = self.request_tier_hit_blocks[:, t] * self.block_bytes / \
                    tier.bandwidth_bytes_per_s
        return saved - cost

    def request_quantiles(self, qs: Sequence[float] = (0.5, 0.9, 0.99)) -> Optional[dict]:
        """Quantiles over requests of the net TTFT saved by all tiers (saved prefill - reads),
        ``{"p50": s, ...}``; None when a lower tier's bandwidth, the bytes per block or the
        prefill cost is unknown."""
        per = self.request_ttft_s()
        if per is None or not len(per) or (len(self.tiers) > 1 and not self.block_bytes) or \
                any(not t.bandwidth_bytes_per_s for t in self.tiers[1:]):
            return None
        total = per.sum(axis=1)
        return {f"p{round(100 * q):d}": float(np.quantile(total, q)) for q in qs}

    def per_tier(self) -> pd.DataFrame:
        """One row per tier: hits, bytes moved (and per second), TTFT effect per request."""
        rows = []
        n = max(self.requests, 1)
        for t, tier in enumerate(self.tiers):
            c = self.counters[t]
            promoted = int(c[K.T_PROMOTED])
            demoted_in = int(self.counters[t - 1, K.T_DEMOTED]) if t else 0
            transfer = None
            if t == 0:
                transfer = 0.0
            elif tier.bandwidth_bytes_per_s and self.block_bytes:
                transfer = promoted * self.block_bytes / tier.bandwidth_bytes_per_s / n
            saved = None if self.prefill_s_per_token is None else \
                int(c[K.T_HIT_TOKENS]) * self.prefill_s_per_token / n
            rows.append({
                "tier": tier.name,
                "capacity_blocks": tier.capacity_blocks,
                "bandwidth(B/s)": tier.bandwidth_bytes_per_s,
                "hit_blocks": int(c[K.T_HIT_BLOCKS]),
                "hit_tokens": int(c[K.T_HIT_TOKENS]),
                "block_hit_rate": int(c[K.T_HIT_BLOCKS]) / max(self.block_refs, 1),
                "token_hit_rate": int(c[K.T_HIT_TOKENS]) / max(self.prompt_tokens, 1),
                "promoted_blocks": promoted,
                "demoted_in_blocks": demoted_in,
                "written_blocks": int(c[K.T_WRITTEN]),
                "evicted_blocks": int(c[K.T_EVICTED]),
                "demoted_out_blocks": int(c[K.T_DEMOTED]),
                "already_below_blocks": int(c[K.T_ALREADY]),
                "dropped_blocks": int(c[K.T_DROPPED]),
                "peak_blocks": int(c[K.T_PEAK]),
                "promoted_bytes": self._bytes(promoted),
                "promote(B/s)": self._rate(promoted),
                "demote_in(B/s)": self._rate(demoted_in),
                "write(B/s)": self._rate(int(c[K.T_WRITTEN])),
                "link_busy": self._busy(t, promoted + demoted_in + int(c[K.T_WRITTEN])),
                "prefill_saved(s/request)": saved,
                "transfer(s/request)": transfer,
                "net_ttft(s/request)": None if saved is None or transfer is None
                else saved - transfer,
            })
        return pd.DataFrame(rows)

    def versus_top_alone_s_per_request(self) -> Optional[float]:
        """(hit tokens of the stack - of the top tier alone) x prefill s/token - transfer time
        of all promotions, per request (None when a term is unknown)."""
        if self.prefill_s_per_token is None or self.top_alone_hit_tokens is None:
            return None
        df = self.per_tier()
        if df["transfer(s/request)"].isna().any():
            return None
        gain = (self.hit_tokens - self.top_alone_hit_tokens) * self.prefill_s_per_token
        return gain / max(self.requests, 1) - float(df["transfer(s/request)"].sum())

    def to_json(self) -> dict:
        """The ``kvdiag replay --tiers --json`` object."""
        tiers = self.per_tier()
        return {
            "write": self.write,
            "block_size_tokens": self.block_size_tokens,
            "block_bytes": self.block_bytes,
            "requests": self.requests,
            "block_refs": self.block_refs,
            "prompt_tokens": self.prompt_tokens,
            "span_s": self.span_s,
            "block_hit_rate": self.block_hit_rate,
            "token_hit_rate": self.token_hit_rate,
            "prefill_s_per_token": self.prefill_s_per_token,
            "prefill_source": self.prefill_source,
            "top_alone_hit_tokens": self.top_alone_hit_tokens,
            "net_ttft_vs_top_alone(s/request)": self.versus_top_alone_s_per_request(),
            "net_ttft_saved_quantiles(s)": self.request_quantiles(),
            "tiers": [{k: (None if isinstance(v, float) and np.isnan(v) else v)
                       for k, v in row.items()} for row in tiers.to_dict("records")],
        }


class TierSim:
    """A stack of LRU tiers fed request batches in order (block ids may grow between calls)."""

    def __init__(self, tiers: Sequence[Tier], write: str = "back", num_blocks: int = 1) -> None:
        if write not in WRITE_MODES:
            raise ValueError(f"unknown write mode {write!r}; expected back or through")
        if not tiers:
            raise ValueError("expected at least one tier")
        if len(tiers) > K.MAX_TIERS:
            raise ValueError(f"at most {K.MAX_TIERS} tiers")
        for t in tiers:
            if t.capacity_bytes is not None:
                raise ValueError(f"tier {t.name}: resolve its capacity in bytes to blocks first")
            if t.capacity_blocks is not None and t.capacity_blocks < 0:
                raise ValueError(f"tier {t.name}: capacity must be >= 0 blocks")
        self.tiers = list(tiers)
        self.write = write
        self.caps = np.array([-1 if t.capacity_blocks is None else t.capacity_blocks
                              for t in tiers], np.int64)
        self.state = K.new_tier_state(len(tiers), num_blocks)

    def _grow(self, num_blocks: int) -> None:
        st = self.state
        old = len(st["mask"])
        if num_blocks <= old:
            return
        n = max(num_blocks, 2 * old)
        mask = np.zeros(n, np.uint8)
        mask[:old] = st["mask"]
        st["mask"] = mask
        for key in ("prev", "nxt"):
            arr = np.full((len(self.tiers), n), -1, np.int32)
            arr[:, :old] = st[key]
            st[key] = arr

    def feed(self, block_ids: np.ndarray, offsets: np.ndarray, block_tokens: np.ndarray,
             counted: np.ndarray, r_begin: int, r_end: int, hits_out: np.ndarray,
             tier_hits: np.ndarray, tier_tokens: np.ndarray) -> None:
        """Replay requests ``r_begin..r_end-1`` (kernel: :func:`_tierkernels.run_tiers`)."""
        if len(block_ids):
            self._grow(int(block_ids[offsets[r_begin]:offsets[r_end]].max(initial=0)) + 1)
        st = self.state
        K.run_tiers(len(self.tiers), self.caps, self.write == "through", block_ids, offsets,
                    block_tokens, counted, r_begin, r_end, st["mask"], st["prev"], st["nxt"],
                    st["heads"], st["tails"], st["sizes"], st["counters"], hits_out, tier_hits,
                    tier_tokens)


def trace_span_s(trace: Trace) -> Optional[float]:
    """Seconds from the first to the last arrival (None without arrival times or a zero span)."""
    if trace.arrival_ns is None:
        return None
    a = trace.arrival_ns[trace.arrival_ns >= 0]
    if len(a) < 2:
        return None
    span = (int(a.max()) - int(a.min())) / 1e9
    return span if span > 0 else None


def simulate_tiers(trace: Trace, tiers: Sequence[Tier], write: str = "back", *,
                   bytes_per_token: Optional[int] = None,
                   prefill_s_per_token: Optional[float] = None, prefill_source: str = "given",
                   compare_top_alone: bool = True,
                   progress: Optional[Callable[[int], None]] = None) -> TieredResult:
    """Replay ``trace`` through the tier stack ``tiers`` (top first; module docstring), any
    number of tiers up to ``MAX_TIERS`` in one kernel (:func:`_tierkernels.run_tiers`)."""
    bpt = bytes_per_token or trace.bytes_per_token
    block_bytes = bpt * trace.block_size_tokens if bpt else None
    tiers = [t.resolved(block_bytes) for t in tiers]
    sim = TierSim(tiers, write, trace.num_blocks)
    rows = trace.rows
    hits = np.zeros(rows, np.int64)
    tier_hits = np.zeros((rows, len(tiers)), np.int64)
    tier_tokens = np.zeros((rows, len(tiers)), np.int64)
    counted = trace.counted_rows
    for r0, r1 in request_chunks(trace.offsets, CHUNK_REFS):
        sim.feed(trace.block_ids, trace.offsets, trace.block_tokens, counted, r0, r1, hits,
                 tier_hits, tier_tokens)
        if progress is not None:
            progress(int(trace.offsets[r1] - trace.offsets[r0]))
    if trace.counted is not None:
        keep = trace.counted.astype(bool)
        hits, tier_hits, tier_tokens = hits[keep], tier_hits[keep], tier_tokens[keep]
    top_alone = None
    if compare_top_alone:
        top_alone = simulate(trace, "lru", tiers[0].capacity_blocks).hit_tokens
    return TieredResult(
        tiers=tiers, write=write, block_size_tokens=trace.block_size_tokens,
        requests=trace.requests, block_refs=trace.block_refs,
        prompt_tokens=int(trace.prompt_tokens.sum()), counters=sim.state["counters"].copy(),
        final_sizes=sim.state["sizes"].copy(), request_hit_blocks=hits,
        request_tier_hit_blocks=tier_hits, request_tier_hit_tokens=tier_tokens,
        block_bytes=block_bytes, span_s=trace_span_s(trace),
        prefill_s_per_token=prefill_s_per_token,
        prefill_source=prefill_source if prefill_s_per_token is not None else "not given",
        top_alone_hit_tokens=top_alone)
