"""CONSTRUCTED event logs (not recorded from an engine) for unit tests of the report machinery.

They follow the schema's semantics (blocks allocated then released, pool samples consistent
with block events) so that analyses can be checked against values computed here by brute
force. Tests that judge real behaviour use the recorded demo logs in tests/data/.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np

from kvdiag.events import schema as s
from kvdiag.events.eventlog import make_header
from kvdiag.events.log_writer import LogWriter

BLOCK = 16
BLOCK_BYTES = 16 * 1024
NUM_BLOCKS = 400


def events(n_requests=120, seed=0, leak_ids=(), long_from=None, t0=1_700_000_000_000_000_000,
           slow_from=None):
    """A sequence of events of ``n_requests`` requests, one arriving every 0.25 s.
    ``leak_ids``: request indexes that never release their blocks. ``long_from``: from this
    request index on, prompts are 8x longer (and TTFT grows with prompt length).
    ``slow_from``: from this index on, per-step durations are 1.3x longer."""
    rng = np.random.default_rng(seed)
    out = [s.KVPoolInfo(ts_ns=t0, num_blocks=NUM_BLOCKS, block_size_tokens=BLOCK, block_bytes=BLOCK_BYTES,
                        num_layers=4, num_kv_heads=2, head_dim=8, dtype="float32", prefix_sharing=True)]
    free = NUM_BLOCKS
    used = 0
    next_block = 0
    leaked: set[int] = set()
    step = 0
    for i in range(n_requests):
        rid = f"req-{i}"
        t = t0 + int(i * 0.25e9)
        prompt = int(rng.integers(40, 120)) * (8 if long_from is not None and i >= long_from else 1)
        out_tok = int(rng.integers(8, 24))
        cached = BLOCK * int(rng.integers(0, 2))
        out.append(s.RequestArrived(ts_ns=t, request_id=rid, prompt_tokens=prompt, max_new_tokens=32))
        nb = math.ceil((prompt + out_tok) / BLOCK)
        ids = []
        for _ in range(nb):
            free -= 1
            used += 1
            while next_block % NUM_BLOCKS in leaked:  # a leaked block never returns to the free list
                next_block += 1
            ids.append(next_block % NUM_BLOCKS)
            out.append(s.BlockAllocated(ts_ns=t + 1000, request_id=rid, block_id=ids[-1], num_blocks_free=free))
            next_block += 1
        slow = 1.3 if slow_from is not None and i >= slow_from else 1.0
        ttft = int(rng.lognormal(np.log(30e6 * prompt / 80), 0.2) * slow)
        per_tok = int(rng.lognormal(np.log(8e6), 0.2) * slow)
        e2e = ttft + per_tok * (out_tok - 1)
        out.append(s.RequestFirstToken(ts_ns=t + ttft, request_id=rid, ttft_ns=ttft))
        for k in range(out_tok):
            step += 1
            out.append(s.EngineStep(ts_ns=t + ttft + k * per_tok, step_id=step,
                                    phase="prefill" if k == 0 else "decode", batch_size=1,
                                    num_tokens=prompt if k == 0 else 1,
                                    duration_ns=int(rng.lognormal(np.log(6e6), 0.15) * slow),
                                    decode_tokens=0 if k == 0 else 1))
        out.append(s.KVPoolSample(ts_ns=t + ttft, num_blocks=NUM_BLOCKS, blocks_used=used,
                                  blocks_free=free, tokens_held=used * BLOCK - int(rng.integers(0, BLOCK)),
                                  running_requests=1))
        out.append(s.ProcessSample(ts_ns=t + ttft, pid=4242, rss_bytes=int(500e6 + rng.integers(0, 1e6)),
                                   name="server"))
        out.append(s.RequestFinished(ts_ns=t + e2e, request_id=rid, prompt_tokens=prompt, output_tokens=out_tok,
                                     cached_prompt_tokens=cached, e2e_ns=e2e, ttft_ns=ttft))
        if i in leak_ids:
            leaked.update(ids)
        else:
            for b in ids:
                free += 1
                used -= 1
                out.append(s.BlockReleased(ts_ns=t + e2e + 1000, request_id=rid, block_id=b, num_blocks_free=free))
        out.append(s.KVPoolSample(ts_ns=t + e2e + 2000, num_blocks=NUM_BLOCKS, blocks_used=used,
                                  blocks_free=free, tokens_held=max(used * BLOCK - 5, 0), running_requests=0))
    for layer in range(4):
        for head in range(2):
            out.append(s.ShadowLocality(ts_ns=t0 + 10**9, layer=layer, head=head, seq_len_tokens=100,
                                        recent_mass=0.6 + 0.05 * head, sink_mass=0.1, other_mass=0.3 - 0.05 * head,
                                        entropy_nats=2.0, outside_share=0.5))
            for method, ratio, err in (("int8", 4.0, 0.01), ("int4", 8.0, 0.05)):
                out.append(s.ShadowCompression(ts_ns=t0 + 2 * 10**9, layer=layer, head=head, method=method,
                                               seq_len_tokens=600, ratio=ratio, k_rel_error=err,
                                               v_rel_error=err, decode_ns=50_000))
    finished = [e for e in out if isinstance(e, s.RequestFinished)]
    engine = sum(e.cached_prompt_tokens for e in finished) / sum(e.prompt_tokens for e in finished)
    for cap in (50, 100, None):  # unbounded: the content allows what the engine hit, and 2 points more
        out.append(s.ShadowSharing(ts_ns=t0 + 20 * 10**9, policy="lru", block_size_tokens=BLOCK,
                                   capacity_blocks=cap, requests=n_requests, block_hit_rate=0.3,
                                   token_hit_rate=engine - 0.1 if cap == 50 else engine + 0.02,
                                   bytes_saved=10**7, engine_hit_rate=engine))
    out.append(s.CollectorStatus(ts_ns=t0, collector="nvml", available=False, hint="no GPU"))
    return sorted(out, key=lambda e: e.ts_ns)


def write(path: Path, evs, node="") -> Path:
    header = make_header(engine="constructed", model="none", block_size_tokens=BLOCK,
                         bytes_per_token=BLOCK_BYTES // BLOCK, node=node or "node-a")
    with LogWriter(path, header) as w:
        for e in evs:
            w.record(e)
    return path


def rewrite(src: Path, dst: Path, change) -> Path:
    """A recorded log ``src`` written to ``dst`` with each event line passed through
    ``change(dict) -> dict | None`` (None drops it): a fault made in a real log."""
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt") as f:
        header, *lines = f.read().splitlines()
    events = [change(json.loads(line)) for line in lines if line.strip()]
    dst.write_text("\n".join([header] + [json.dumps(e) for e in events if e is not None]) + "\n")
    return dst


SILENT_BLOCK_EVENTS = frozenset({"block_evicted", "block_stored", "block_deduplicated"})


def without_engine_evidence(src: Path, dst: Path) -> Path:
    """A recorded log as from an engine that publishes no block stores or evictions: nothing in
    it tells why the engine missed content the shadow held (the miss causes' ``engine_skip``)."""
    return rewrite(src, dst, lambda e: None if e["type"] in SILENT_BLOCK_EVENTS else e)
