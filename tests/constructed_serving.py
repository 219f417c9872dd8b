"""CONSTRUCTED logs of a batching engine whose decode steps are bandwidth-bound (not recorded).

A small discrete simulation: requests arrive at a fixed rate; each step admits the arrived
ones (prefill), every running request decodes one token, blocks are allocated as contexts
grow and released at finish. A share of each prompt is a prefix shared with the earlier
prompts of the same length (``PrefixHit`` after the first), so the prefix hit rate does not
depend on the prompt length. A step takes ``base_step_ns`` plus the KV bytes the batch holds
divided by ``hw_bytes_per_s``: longer contexts make steps slower through KV reads alone. No
compression runs, no preemption, a pool far larger than the demand. Tests compute what they
check from the events, not from this simulation's variables.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

from kvdiag.events import schema as s
from kvdiag.events.eventlog import make_header
from kvdiag.events.log_writer import LogWriter

BLOCK = 16
BYTES_PER_TOKEN = 46_080
BLOCK_BYTES = BLOCK * BYTES_PER_TOKEN
NUM_BLOCKS = 200_000
T0 = 1_700_000_000_000_000_000


def serving(n_requests: int, prompt_tokens: Callable[[int], int], rate_per_s: float = 20.0,
            output_tokens: int = 16, shared_share: float = 0.5, base_step_ns: int = 10_000_000,
            hw_bytes_per_s: float = 10e9, prefill_ns_per_token: float = 200.0,
            shared_share_from: Optional[tuple[int, float]] = None, peak_copy_bytes_per_s: Optional[float] = 20e9,
            max_batch: int = 256, t0: int = T0) -> list[s.Event]:
    """The events of ``n_requests`` requests, request ``i`` with ``prompt_tokens(i)`` tokens
    arriving at ``t0 + i / rate_per_s``; ``peak_copy_bytes_per_s``: the probe written at
    the start (None: no probe); ``shared_share_from`` = (index, share): from request index
    on, that share of the prompt is shared (a hit-rate change with the same lengths)."""
    out: list[s.Event] = [s.KVPoolInfo(ts_ns=t0, num_blocks=NUM_BLOCKS, block_size_tokens=BLOCK,
                                       block_bytes=BLOCK_BYTES, num_layers=30, num_kv_heads=3,
                                       head_dim=64, dtype="float32", prefix_sharing=True)]
    if peak_copy_bytes_per_s:
        out.append(s.MemoryBandwidthProbe(ts_ns=t0, device="cpu", copy_bandwidth_bytes_per_s=peak_copy_bytes_per_s,
                                          buffer_bytes=64 << 20, repetitions=5, method="constructed"))
    arrivals = [t0 + int(i * 1e9 / rate_per_s) for i in range(n_requests)]
    prefix_blocks: dict[int, list[int]] = {}  # prompt length -> cached shared blocks
    next_block, step_id, t, i = 0, 0, t0, 0
    running: dict[str, dict] = {}
    while i < n_requests or running:
        if not running and i < n_requests and arrivals[i] > t:
            t = arrivals[i]
        admitted = []
        while i < n_requests and arrivals[i] <= t and len(running) < max_batch:
            rid, prompt = f"r{i}", prompt_tokens(i)
            out.append(s.RequestArrived(ts_ns=arrivals[i], request_id=rid, prompt_tokens=prompt,
                                        max_new_tokens=output_tokens))
            out.append(s.RequestScheduled(ts_ns=t, request_id=rid, queue_ns=t - arrivals[i]))
            share = shared_share if shared_share_from is None or i < shared_share_from[0] else shared_share_from[1]
            shared = int(prompt * share) // BLOCK
            req = {"share": share, "arrived": arrivals[i], "prompt": prompt, "blocks": [], "out": 0, "cached": 0,
                   "first": None, "owns_prefix": False}
            if prompt in prefix_blocks and shared:
                for b in prefix_blocks[prompt]:
                    out.append(s.PrefixHit(ts_ns=t, request_id=rid, block_id=b, num_tokens=BLOCK))
                req["blocks"] = list(prefix_blocks[prompt])
                req["cached"] = shared * BLOCK
            else:
                req["owns_prefix"] = shared > 0
            running[rid] = req
            admitted.append(rid)
            i += 1
        for rid, req in running.items():  # blocks for the context after this step
            need = math.ceil((req["prompt"] + req["out"] + 1) / BLOCK)
            while len(req["blocks"]) < need:
                out.append(s.BlockAllocated(ts_ns=t, request_id=rid, block_id=next_block,
                                            num_blocks_free=NUM_BLOCKS - next_block - 1))
                req["blocks"].append(next_block)
                next_block += 1
            if req["owns_prefix"] and req["prompt"] not in prefix_blocks:
                prefix_blocks[req["prompt"]] = req["blocks"][:int(req["prompt"] * req["share"]) // BLOCK]
        held = sum(len(r["blocks"]) for r in running.values())
        new_tokens = sum(r["prompt"] - r["cached"] for rid, r in running.items() if rid in admitted)
        dur = int(base_step_ns + prefill_ns_per_token * new_tokens + held * BLOCK_BYTES / hw_bytes_per_s * 1e9)
        step_id += 1
        start = t + 1_000
        out.append(s.EngineStep(ts_ns=start, step_id=step_id, phase="mixed" if admitted else "decode",
                                batch_size=len(running), num_tokens=new_tokens + len(running) - len(admitted),
                                duration_ns=dur, prefill_tokens=new_tokens,
                                decode_tokens=len(running) - len(admitted)))
        end = start + dur
        distinct = {b for r in running.values() for b in r["blocks"]}
        tokens = sum(r["prompt"] + r["out"] for r in running.values())
        out.append(s.KVPoolSample(ts_ns=end, num_blocks=NUM_BLOCKS, blocks_used=len(distinct),
                                  blocks_free=NUM_BLOCKS - len(distinct),
                                  tokens_held=min(tokens, len(distinct) * BLOCK), running_requests=len(running),
                                  waiting_requests=sum(a <= t for a in arrivals[i:])))
        for rid in list(running):
            req = running[rid]
            req["out"] += 1
            if req["first"] is None:
                req["first"] = end
                out.append(s.RequestFirstToken(ts_ns=end, request_id=rid, ttft_ns=end - req["arrived"]))
            if req["out"] >= output_tokens:
                out.append(s.RequestFinished(ts_ns=end, request_id=rid, prompt_tokens=req["prompt"],
                                             output_tokens=req["out"], cached_prompt_tokens=req["cached"],
                                             e2e_ns=end - req["arrived"], ttft_ns=req["first"] - req["arrived"]))
                shared = set(prefix_blocks.get(req["prompt"], ())) if req["share"] else set()
                for b in req["blocks"]:
                    out.append(s.BlockReleased(ts_ns=end + 1_000, request_id=rid, block_id=b, cached=b in shared))
                del running[rid]
        t = end + 2_000
    return sorted(out, key=lambda e: e.ts_ns)


def write(path: Path, evs: list[s.Event], node: str = "node-a", **header) -> Path:
    """``evs`` as a log at ``path`` (header: block size, bytes per token, ``header``)."""
    hdr = make_header(engine="constructed", model="none", block_size_tokens=BLOCK,
                      bytes_per_token=BYTES_PER_TOKEN, node=node, **header)
    with LogWriter(path, hdr) as w:
        for e in evs:
            w.record(e)
    return path
