"""The KV pool of ``kvdiag top``: the pool's shape (``KVPoolInfo``), its latest sample, the
histories of its bytes used and block occupancy by event-time bin, and the pool view: blocks
used and cached, occupancy, fragmentation, evictions/s, the ledger's counts and anomalies;
without the agent's pool events, the engine's /metrics gauges."""

from __future__ import annotations

from typing import Callable, Optional

from kvdiag.events import schema as s
from kvdiag.pool.blockfacts import BlockFacts
from kvdiag.pool.blockledger import ANOMALY_KINDS, BlockLedger
from kvdiag.diagnosis.rules import RELEASE_GRACE_NS
from kvdiag.live.snapshot import PoolView
from kvdiag.live.time_bins import Bin
from kvdiag.live.views.engine import SOURCE as ENGINE_SOURCE, EngineFold
from kvdiag.live.views.memory import MemoryFold
from kvdiag.live.views.series import Series


class PoolFold:
    """``block_size_tokens()``: tokens per block (the pool's, else the header's);
    ``preemptions()``: the requests' preemptions so far."""

    def __init__(self, ledger: BlockLedger, facts: BlockFacts, memory: MemoryFold, engine: EngineFold,
                 block_size_tokens: Callable[[], Optional[int]], preemptions: Callable[[], int]) -> None:
        self.ledger = ledger
        self.facts = facts
        self.memory = memory
        self.engine = engine
        self._block_size_tokens = block_size_tokens
        self._preemptions = preemptions
        self.info: Optional[s.KVPoolInfo] = None
        self.sample: Optional[s.KVPoolSample] = None
        self.series: dict[str, Series] = {k: Series() for k in ("kv_pool", "occupancy")}
        self.handlers = {s.KVPoolInfo: self.on_pool_info, s.KVPoolSample: self.on_pool_sample}

    def on_pool_info(self, ev: s.KVPoolInfo, b: Bin, idx: int) -> None:
        self.info = ev

    def on_pool_sample(self, ev: s.KVPoolSample, b: Bin, idx: int) -> None:
        self.sample = ev
        self.facts.pool_sample(ev)
        if ev.num_blocks:
            self.series["occupancy"].set(idx, ev.blocks_used / ev.num_blocks)
        if self.info is not None:
            used = ev.blocks_used + ev.blocks_cached
            self.series["kv_pool"].set(idx, used * self.info.block_bytes)

    def trim(self, first: int) -> None:
        for series in self.series.values():
            series.trim(first)

    def blocks(self) -> Optional[tuple[int, int]]:
        """(blocks held by requests, blocks held only by the prefix cache): the latest pool
        sample, else the ledger's counts."""
        if self.sample is not None:
            return self.sample.blocks_used, self.sample.blocks_cached
        ledger = self.ledger
        if self.info is None and not ledger.held_blocks and not ledger.cached_blocks:
            return None
        return ledger.held_blocks, ledger.cached_blocks

    def kv_bytes(self) -> tuple[Optional[int], Optional[int]]:
        """(bytes of the blocks used and cached, bytes of the whole pool); None where unknown."""
        kv_used = kv_total = None
        info = self.info
        if info is not None:
            kv_total = info.num_blocks * info.block_bytes
            blocks = self.blocks()
            if blocks is not None:
                kv_used = (blocks[0] + blocks[1]) * info.block_bytes
        return kv_used, kv_total

    def record_derived(self, last: int) -> None:
        """Without pool samples, the gauges come from block events: record them for this bin."""
        if self.sample is not None:
            return
        blocks = self.blocks()
        if blocks is None:
            return
        if self.info is not None:
            self.series["kv_pool"].set(last, (blocks[0] + blocks[1]) * self.info.block_bytes)
            if self.info.num_blocks:
                self.series["occupancy"].set(last, blocks[0] / self.info.num_blocks)

    def view(self, first: int, last: int, window: list[Bin], window_s: float, now_ns: int) -> PoolView:
        info, sample = self.info, self.sample
        blocks = self.blocks()
        num_blocks = sample.num_blocks if sample else (info.num_blocks if info else None)
        block_size = self._block_size_tokens()
        used, cached = blocks if blocks else (None, None)
        block_occ = used / num_blocks if used is not None and num_blocks else None
        token_occ = None
        inconsistency = ""
        if sample is not None and block_size and sample.blocks_used:
            slots = sample.blocks_used * block_size
            token_occ = sample.tokens_held / slots
            if token_occ > 1:  # more tokens than slots: the sampler counted shared blocks per request
                inconsistency = (f"pool sample: {sample.tokens_held} tokens held > {slots} slots of "
                                 f"{sample.blocks_used} used blocks; token occupancy not shown")
                token_occ = None
        alloc_frag = self.memory.allocator_fragmentation()
        ledger = self.ledger
        has_pool = info is not None or sample is not None or ledger.held_blocks > 0
        seen = ledger.block_events > 0
        holding = ledger.finished_holding_count(now_ns, RELEASE_GRACE_NS) if seen else (None, None)
        if not has_pool:
            gauges = self._engine_view(first, last)
            if gauges is not None:
                return gauges
        return PoolView(
            num_blocks=num_blocks, block_size_tokens=block_size, blocks_used=used, blocks_cached=cached,
            block_occupancy=block_occ, token_occupancy=token_occ,
            pool_fragmentation=1.0 - token_occ if token_occ is not None else None,
            allocator_fragmentation=alloc_frag,
            evictions_per_s=sum(b.evictions for b in window) / window_s if has_pool else None,
            preemptions=self._preemptions(),
            running_requests=sample.running_requests if sample else None,
            waiting_requests=sample.waiting_requests if sample else None,
            occupancy_history=self.series["occupancy"].history(first, last, 10),
            reason="" if has_pool else "no KV pool events: the server needs the kvdiag agent (kvdiag demo runs one)",
            inconsistency=inconsistency,
            ledger_held_blocks=ledger.held_blocks if seen else None,
            ledger_cached_blocks=ledger.cached_blocks if seen else None,
            ledger_free_blocks=ledger.free_blocks if seen else None,
            finished_holding_requests=holding[0], finished_holding_blocks=holding[1],
            block_anomalies=tuple((k, ledger.anomaly_counts[k]) for k in ANOMALY_KINDS) if seen else ())

    def _engine_view(self, first: int, last: int) -> Optional[PoolView]:
        """Without the agent's pool events: the pool as the engine's /metrics gauges say
        (:meth:`kvdiag.live.views.engine.EngineFold.pool`), None without a usage gauge."""
        g = self.engine.pool()
        if g is None:
            return None
        return PoolView(
            num_blocks=g["num_blocks"], block_size_tokens=g["block_size_tokens"], blocks_used=g["blocks_used"],
            blocks_cached=None, block_occupancy=g["usage"], token_occupancy=None, pool_fragmentation=None,
            allocator_fragmentation=self.memory.allocator_fragmentation(), evictions_per_s=None,
            preemptions=g["preemptions"], running_requests=g["running"], waiting_requests=g["waiting"],
            occupancy_history=self.engine.usage.history(first, last, 10), reason="",
            source=f"{ENGINE_SOURCE}: KV cache usage gauge")
