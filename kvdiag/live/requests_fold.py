"""The requests of ``kvdiag top``: each live request and the recently finished ones (state,
prompt and output tokens, prefix hits, TTFT, queue wait), folded from request events, and the
requests view (the largest by KV bytes held, then the latest finished). Block state is the
ledger's (:mod:`kvdiag.pool.blockledger`): a request's blocks are read from it."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from kvdiag.events import schema as s
from kvdiag.pool.blockledger import BlockLedger
from kvdiag.live.snapshot import RequestRow, RequestsView
from kvdiag.live.time_bins import Bin

TOP_REQUESTS = 20
RECENT_FINISHED = 200


@dataclass(slots=True)
class TrackedRequest:
    request_id: str
    arrived_ns: int
    prompt_tokens: int = 0
    state: str = "waiting"
    hit_tokens: int = 0
    hit_blocks: int = 0
    arrival_seen: bool = False  # a RequestArrived was seen (its prompt length is known)
    scheduled_seen: bool = False  # admitted by the scheduler (a RequestScheduled was seen)
    max_new_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    ttft_ns: Optional[int] = None
    finished_ns: Optional[int] = None
    queue_ns: Optional[int] = None  # first scheduling - arrival (kvdiag.diagnosis.user_latency)


class RequestsFold:
    """``on_finished_ok``: called with each request that finished with status "finished" (the
    sharing fold counts its prompt and cached tokens)."""

    def __init__(self, ledger: BlockLedger, on_finished_ok: Callable[[s.RequestFinished], None]) -> None:
        self.ledger = ledger
        self._on_finished_ok = on_finished_ok
        self.live: dict[str, TrackedRequest] = {}
        self.finished: OrderedDict[str, TrackedRequest] = OrderedDict()
        self.finished_count = 0
        self.saw_scheduled = False
        self.preemptions = 0
        self.handlers = {
            s.RequestArrived: self.on_arrived, s.RequestScheduled: self.on_scheduled,
            s.RequestFirstToken: self.on_first_token, s.RequestFinished: self.on_finished,
            s.RequestPreempted: self.on_preempted, s.PrefixHit: self.on_hit,
        }
        if hasattr(s, "BlockDeduplicated"):  # added to the schema by the engine adapter's work
            self.handlers[s.BlockDeduplicated] = self.on_deduplicated

    def request(self, request_id: str, ts_ns: int) -> TrackedRequest:
        """The request's row, live or recently finished; a new live one if neither."""
        req = self.live.get(request_id)
        if req is None:
            req = self.finished.get(request_id)
        if req is None:
            req = self.live[request_id] = TrackedRequest(request_id, ts_ns)
        return req

    def on_arrived(self, ev: s.RequestArrived, b: Bin, idx: int) -> None:
        req = self.request(ev.request_id, ev.ts_ns)
        req.arrived_ns = ev.ts_ns
        req.prompt_tokens = ev.prompt_tokens
        req.arrival_seen = True
        req.max_new_tokens = ev.max_new_tokens

    def on_scheduled(self, ev: s.RequestScheduled, b: Bin, idx: int) -> None:
        req = self.request(ev.request_id, ev.ts_ns)
        if not req.scheduled_seen:  # the first scheduling; a preempted request is scheduled again
            req.queue_ns = ev.ts_ns - req.arrived_ns if req.arrival_seen else ev.queue_ns
        req.scheduled_seen = self.saw_scheduled = True
        if req.finished_ns is None:
            req.state = "running"

    def on_first_token(self, ev: s.RequestFirstToken, b: Bin, idx: int) -> None:
        req = self.request(ev.request_id, ev.ts_ns)
        req.ttft_ns = ev.ttft_ns
        if req.finished_ns is None:
            req.state = "running"
        b.generated_tokens += 1

    def on_finished(self, ev: s.RequestFinished, b: Bin, idx: int) -> None:
        req = self.live.pop(ev.request_id, None) or self.finished.get(ev.request_id)
        if req is None:
            req = TrackedRequest(ev.request_id, ev.ts_ns - (ev.e2e_ns or 0))
        req.prompt_tokens = ev.prompt_tokens
        req.output_tokens = ev.output_tokens
        req.state = ev.status
        req.finished_ns = ev.ts_ns
        if ev.ttft_ns is not None:
            req.ttft_ns = ev.ttft_ns
        self.finished[ev.request_id] = req
        self.finished.move_to_end(ev.request_id)
        while len(self.finished) > RECENT_FINISHED:
            self.finished.popitem(last=False)
        self.finished_count += 1
        b.finished_output_tokens += ev.output_tokens
        if ev.status == "finished":
            self._on_finished_ok(ev)
            b.prompt_tokens += ev.prompt_tokens
            b.cached_tokens += ev.cached_prompt_tokens
            if req.queue_ns is not None:
                b.queue_ns.append(req.queue_ns)
            if req.ttft_ns is not None:
                b.ttft_ns.append(req.ttft_ns)
                if ev.e2e_ns is not None and ev.output_tokens > 1:
                    b.tpot_ns.append((ev.e2e_ns - req.ttft_ns) / (ev.output_tokens - 1))

    def on_preempted(self, ev: s.RequestPreempted, b: Bin, idx: int) -> None:
        self.preemptions += 1
        req = self.live.get(ev.request_id)
        if req is not None:
            req.state = "waiting"

    # block state is the ledger's (kvdiag.pool.blockledger: holdings, cache, bad releases; it
    # folds every block event before the handlers see one): the handlers here add only the
    # per-request figures top shows. BlockAllocated, BlockReleased and BlockEvicted reach no
    # handler: a request first seen by its allocation gets its row from new_holder.

    def new_holder(self, request_id: str, ts_ns: int) -> None:
        """A ``BlockAllocated`` made ``request_id``, which held no block, a holder."""
        self.request(request_id, ts_ns)

    def on_hit(self, ev: s.PrefixHit, b: Bin, idx: int) -> None:
        req = self.request(ev.request_id, ev.ts_ns)
        req.hit_tokens += ev.num_tokens
        req.hit_blocks += 1

    def on_deduplicated(self, ev, b: Bin, idx: int) -> None:
        """``BlockDeduplicated``: the request now holds the cached ``block_id`` (its duplicate
        is given back by the ``BlockReleased`` that follows)."""
        self.request(ev.request_id, ev.ts_ns)

    def view(self, now_ns: int, block_bytes: Optional[int], bytes_per_token: Optional[int]) -> RequestsView:
        """The live requests holding the most KV bytes, then the latest finished, up to
        ``TOP_REQUESTS`` rows. A request's KV bytes: its blocks x ``block_bytes``; without
        block events, its prompt tokens x ``bytes_per_token`` (an estimate)."""
        blocks_of = self.ledger.blocks_of
        block_events_seen = self.ledger.block_events > 0

        def kv_bytes(r: TrackedRequest) -> Optional[int]:
            blocks = blocks_of(r.request_id)
            if blocks and block_bytes:
                return len(blocks) * block_bytes
            if block_events_seen or r.finished_ns is not None or r.state == "waiting":
                return 0  # the engine reports blocks and this request holds none
            return r.prompt_tokens * bytes_per_token if bytes_per_token is not None else None  # no block events: estimate

        live = heapq.nlargest(TOP_REQUESTS, self.live.values(),
                              key=lambda r: (kv_bytes(r) or 0, -r.arrived_ns))
        rows = [_row(r, kv_bytes(r), now_ns, blocks_of(r.request_id)) for r in live]
        for r in reversed(self.finished.values()):
            if len(rows) >= TOP_REQUESTS:
                break
            rows.append(_row(r, kv_bytes(r), now_ns, blocks_of(r.request_id)))
        reason = "" if rows else "no requests seen yet"
        return RequestsView(rows=tuple(rows), live=len(self.live), finished=self.finished_count, reason=reason)


def _row(r: TrackedRequest, kv: Optional[int], now_ns: int, blocks) -> RequestRow:
    end = r.finished_ns if r.finished_ns is not None else now_ns
    return RequestRow(
        request_id=r.request_id, state=r.state, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
        blocks=len(blocks), kv_bytes=kv, hit_tokens=r.hit_tokens, hit_blocks=r.hit_blocks,
        age_s=max(0.0, (end - r.arrived_ns) / 1e9),
        ttft_ms=r.ttft_ns / 1e6 if r.ttft_ns is not None else None, block_ids=tuple(sorted(blocks)))
